"""The KubeRay simulator's stand-ins for two pods it does not run as pods: a RayJob's K8sJobMode
submitter pod (from its `submitterPodTemplate`) and the head pod whose environment a Ray
driver inherits. Every simulated cluster shares one real Ray, so both are played locally:

- the submitter: its volumes are written under a private root (`_pod_files`), its init
  containers run there as local processes, and the runtime env's local `working_dir` is mapped
  to where they left the code, so Ray's client uploads it on submit, as `ray job submit` in the
  real submitter container does;
- the head's environment: what the head container's `env` and `envFrom` give it (the Secret
  prefect-nemo mounts there, say) goes into a file only this user can read, which the Ray job's
  shell sources before the entrypoint, so the driver sees it as it would on the real head, and
  the values never enter the Ray job's runtime env, entrypoint or metadata.
"""

from __future__ import annotations

import logging
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from kubernetes import client

from prefect_nemo.testing.operators._pod_files import PathMapper, container_env, mounted_volumes

log = logging.getLogger(__name__)
Obj = dict[str, Any]
INIT_TIMEOUT_S = 120.0
# what KubeRay writes when the submitter Job runs out of retries (rayjob_controller.go)
SUBMISSION_FAILED = (
    "Job submission has failed. Reason: BackoffLimitExceeded. Message: Job has reached the "
    "specified backoff limit"
)


class SubmitterFailed(Exception):
    """An init container of the submitter pod failed (the message is KubeRay's)."""


def run_submitter_pod(
    core: client.CoreV1Api, ns: str, template: Obj, root: Path, *, pvc_root: Path
) -> PathMapper:
    """Write the template's volumes under `root` and run its init containers there, in order,
    as the kubelet would before the submitter container; returns the pod's path mapper.
    SubmitterFailed when one exits non-zero or runs past INIT_TIMEOUT_S."""
    spec = template.get("spec") or {}
    pod = {"metadata": {"name": root.name, **(template.get("metadata") or {})}, "spec": spec}
    containers = [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]
    mapper = PathMapper(root, [m["mountPath"] for c in containers
                               for m in c.get("volumeMounts") or []])  # fmt: skip
    root.mkdir(parents=True, exist_ok=True)
    mounted_volumes(core, ns, spec, containers, mapper, pvc_root=pvc_root)
    for init in spec.get("initContainers") or []:
        argv = [mapper(a) for a in [*(init.get("command") or []), *(init.get("args") or [])]]
        env = {
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}/usr/local/bin:/usr/bin:/bin",
            "HOME": str(root),
            "LANG": "C.UTF-8",
            **{k: mapper(v) for k, v in container_env(core, ns, pod, init).items()},
        }
        try:
            done = subprocess.run(argv, env=env, cwd=root, capture_output=True,
                                  timeout=INIT_TIMEOUT_S, stdin=subprocess.DEVNULL)  # fmt: skip
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.warning("kuberay-sim: submitter init container %s: %s", init.get("name"), exc)
            raise SubmitterFailed(SUBMISSION_FAILED) from None
        if done.returncode != 0:
            out = (done.stdout + done.stderr).decode(errors="replace")[-2000:]
            log.warning("kuberay-sim: submitter init container %s exited %d: %s",
                        init.get("name"), done.returncode, out)  # fmt: skip
            raise SubmitterFailed(SUBMISSION_FAILED)
    return mapper


def map_runtime_env(runtime_env: Obj | None, mapper: PathMapper) -> Obj | None:
    """The runtime env with its local paths (working_dir, py_modules) as the submitter pod's
    files lie here; URIs (gcs://, s3://) stay as they are."""
    if not runtime_env:
        return runtime_env
    out = dict(runtime_env)
    if isinstance(out.get("working_dir"), str):
        out["working_dir"] = mapper(out["working_dir"])
    if isinstance(out.get("py_modules"), list):
        out["py_modules"] = [mapper(m) if isinstance(m, str) else m for m in out["py_modules"]]
    return out


def with_head_env(
    core: client.CoreV1Api, ns: str, rc: Obj | None, entrypoint: str, env_file: Path
) -> str:
    """`entrypoint` run with the head container's env (the driver runs on the head and
    inherits it): written to `env_file` (0600) and sourced first; unchanged when the head's
    spec gives no env."""
    head_pod = ((rc or {}).get("spec") or {}).get("headGroupSpec", {}).get("template") or {}
    containers = (head_pod.get("spec") or {}).get("containers") or []
    if not containers:
        return entrypoint
    pod = {"metadata": head_pod.get("metadata") or {}, "spec": head_pod.get("spec")}
    env = container_env(core, ns, pod, containers[0])
    if not env:
        return entrypoint
    env_file.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(env_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.writelines(f"export {k}={shlex.quote(v)}\n" for k, v in env.items()
                       if k.isidentifier())  # fmt: skip
    return f". {shlex.quote(str(env_file))}; {entrypoint}"
