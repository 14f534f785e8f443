"""What a kubelet gives a container that our local-process stand-ins share: its volumes as files
and its environment from the API server, with container paths mapped under a local root.

Used by the TrainJob simulator (its pods), the KubeRay simulator (a RayJob's submitter pod
template) and the control plane's node agent (every pod it runs). A pod here is local processes
on one machine, so a mount path (`/workspace/code`) cannot be what it says; each pod gets a
private root directory and `PathMapper` rewrites those paths in command lines and env values to
lie under it. ConfigMap and Secret volumes (plain or projected) are written there as files, as
the kubelet writes them; emptyDir is a fresh directory; a PVC is one shared directory per claim.
A projected `serviceAccountToken` is a real TokenRequest for the pod's ServiceAccount, bound to
the pod (given `pod`), written once: a pod here outlives no token (the kubelet would refresh it
at 80% of its life).
"""

from __future__ import annotations

import base64
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kubernetes import client

Obj = dict[str, Any]


class PathMapper:
    """Rewrites absolute container paths (under the given roots) to lie under a local root."""

    def __init__(self, root: Path, prefixes: Iterable[str]) -> None:
        self.root = root
        roots = sorted({p.rstrip("/") for p in prefixes if p.rstrip("/")}, key=len, reverse=True)
        alternatives = "|".join(re.escape(p) for p in roots)
        # a path ends where a word of a command line, a quoted string or a JSON value does
        # (KubeRay's submitter line carries `--runtime-env-json "{\"working_dir\":\"/x\"}"`)
        self._pattern = (
            re.compile(rf"(?<![\w./-])({alternatives})(?=$|[/\s\"'\\;:,}})&|>])") if roots else None
        )

    def __call__(self, text: str) -> str:
        if self._pattern is None:
            return text
        return self._pattern.sub(lambda m: f"{self.root}{m.group(1)}", text)


def mounted_volumes(
    core: client.CoreV1Api,
    ns: str,
    pod_spec: Obj,
    containers: Iterable[Obj],
    mapper: PathMapper,
    *,
    pvc_root: Path,
    pod: Obj | None = None,
) -> None:
    """Write every volume that one of `containers` mounts at its mapped mount path (a volume
    mounted twice is written at both paths, as two bind mounts of one directory would show)."""
    volumes = {v["name"]: v for v in pod_spec.get("volumes") or []}
    for container in containers:
        for mount in container.get("volumeMounts") or []:
            volume = volumes.get(mount["name"])
            if volume is not None:
                materialise(core, ns, volume, Path(mapper(mount["mountPath"])),
                            pvc_root=pvc_root, pod=pod)  # fmt: skip


def materialise(
    core: client.CoreV1Api, ns: str, volume: Obj, target: Path, *, pvc_root: Path,
    pod: Obj | None = None,
) -> None:  # fmt: skip
    """Make a volume's content appear at target (a path under the pod's root)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if "configMap" in volume or "secret" in volume:
        write_source(core, ns, volume, target)
    elif "projected" in volume:
        for source in volume["projected"].get("sources") or []:
            if "serviceAccountToken" in source and pod is not None:
                write_token(core, pod, source["serviceAccountToken"], target)
            else:
                write_source(core, ns, source, target)
    elif "persistentVolumeClaim" in volume:
        shared = pvc_root / ns / volume["persistentVolumeClaim"]["claimName"]
        shared.mkdir(parents=True, exist_ok=True)
        if not target.exists():
            target.symlink_to(shared, target_is_directory=True)
    else:  # emptyDir and anything else: a fresh directory
        target.mkdir(parents=True, exist_ok=True)


def write_source(core: client.CoreV1Api, ns: str, source: Obj, target: Path) -> None:
    """Write a configMap or secret volume (source) as files under target, as the kubelet."""
    if "configMap" in source:
        ref = source["configMap"]
        obj = core.read_namespaced_config_map(ref["name"], ns)
        data = {k: v.encode() for k, v in (obj.data or {}).items()}
        data.update({k: base64.b64decode(v) for k, v in (obj.binary_data or {}).items()})
    elif "secret" in source:
        ref = source["secret"]
        obj = core.read_namespaced_secret(ref.get("secretName") or ref["name"], ns)
        data = {k: base64.b64decode(v) for k, v in (obj.data or {}).items()}
    else:
        raise RuntimeError(f"volume source {sorted(source)} is not simulated")
    items = ref.get("items")
    paths = {i["key"]: i["path"] for i in items} if items else {k: k for k in data}
    target.mkdir(parents=True, exist_ok=True)
    for k, rel in paths.items():
        if k not in data:
            raise RuntimeError(f"volume source {ref.get('name')}: key {k!r} is missing")
        dest = target / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(data[k])


def write_token(core: client.CoreV1Api, pod: Obj, source: Obj, target: Path) -> None:
    """A projected serviceAccountToken: the pod's ServiceAccount's token for the source's
    audience and life, bound to the pod (so it dies with it), as the kubelet requests it."""
    meta = pod["metadata"]
    account = pod["spec"].get("serviceAccountName") or "default"
    spec: Obj = {"expirationSeconds": int(source.get("expirationSeconds") or 3600),
                 "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"],
                                    "uid": meta["uid"]}}  # fmt: skip
    if source.get("audience"):
        spec["audiences"] = [source["audience"]]
    made = core.create_namespaced_service_account_token(account, meta["namespace"], {"spec": spec})
    dest = target / source["path"]
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(made.status.token)
    dest.chmod(0o600)


def env_value(core: client.CoreV1Api, ns: str, pod: Obj, item: Obj) -> str:
    """One `env` entry's value: plain, or from a Secret / ConfigMap key or the pod's fields."""
    if "value" in item or "valueFrom" not in item:
        return str(item.get("value", ""))
    source = item["valueFrom"]
    if "secretKeyRef" in source:
        ref = source["secretKeyRef"]
        secret = core.read_namespaced_secret(ref["name"], ns)
        return base64.b64decode((secret.data or {})[ref["key"]]).decode()
    if "configMapKeyRef" in source:
        ref = source["configMapKeyRef"]
        return (core.read_namespaced_config_map(ref["name"], ns).data or {})[ref["key"]]
    if "fieldRef" in source:
        path = source["fieldRef"]["fieldPath"]
        match = re.fullmatch(r"metadata\.(annotations|labels)\['(.+)'\]", path)
        if match:
            return str((pod["metadata"].get(match.group(1)) or {}).get(match.group(2), ""))
        if path == "metadata.name":
            return str(pod["metadata"].get("name", ""))
        if path == "metadata.namespace":
            return ns
    return ""


def container_env(core: client.CoreV1Api, ns: str, pod: Obj, container: Obj) -> dict[str, str]:
    """What the container's spec puts in its environment: `envFrom` (Secrets, ConfigMaps, with
    their prefix), then `env` in order, as the kubelet resolves them."""
    env: dict[str, str] = {}
    for source in container.get("envFrom") or []:
        if ref := source.get("secretRef"):
            data = core.read_namespaced_secret(ref["name"], ns).data or {}
            values = {k: base64.b64decode(v).decode() for k, v in data.items()}
        else:
            ref = source.get("configMapRef") or {}
            values = dict(core.read_namespaced_config_map(ref["name"], ns).data or {})
        for key, value in values.items():
            env[(source.get("prefix") or "") + key] = value
    for item in container.get("env") or []:
        env[item["name"]] = env_value(core, ns, pod, item)
    return env
