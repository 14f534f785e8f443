"""A Kubeflow Trainer v2 (trainer.kubeflow.org/v1alpha1) + JobSet simulator.

For each TrainJob it does what the Trainer controller and JobSet do together, through the same
HTTP API: it resolves the runtime (`runtimeRef`), applies the TrainJob's `trainer` fields and
`runtimePatches` to the runtime's `node` pod template, injects the Torch plugin's PET_* env, and
creates one pod per node, named and labelled as JobSet names them
(`<trainjob>-node-0-<index>-xxxxx`, `jobset.sigs.k8s.io/jobset-name`, `.../replicatedjob-name`,
`.../job-index`, `batch.kubernetes.io/job-completion-index`, ...). Pods go Pending → Running →
Succeeded/Failed; the TrainJob gets `Complete` / `Failed` conditions (JobSet's reasons) and
`jobsStatus`; `suspend: true` deletes the pods and sets `Suspended`.

With `run_locally` (the default) every pod runs its container command for real, in a local
`sh` subprocess with the pod's env (secretKeyRef/configMapKeyRef resolved like the kubelet), so
logs (served by `pods/log`) and exit codes are real. Path mapping: each pod gets a private root
directory; every volumeMount path and every path under `path_prefixes` (default `/workspace`)
in the command, args and env values is rewritten to lie under that root. ConfigMap and Secret
volumes are written there as files; a PVC is one shared directory per claim (so all pods of a
job see the same files, as on a ReadWriteMany volume); emptyDir is a fresh directory.
A `torchrun` stand-in on PATH starts `--nproc-per-node` local copies of the program with torch's
rank env (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...). PET_MASTER_ADDR is 127.0.0.1 (the
real value is the rank-0 pod's DNS name) and PET_MASTER_PORT a free local port per TrainJob.

On a real API server (no `set_pod_log`) the simulator is also the kubelet of a Node of its own
(`_node.SimNode`): pods are bound to it, their logs are served from its `/containerLogs` (where
the API server reads `pods/log`), and a deleted pod's deletion is finished by the simulator.

Deviations, kept small on purpose: no JobSet or Job objects (pods are owned by the TrainJob, so
garbage collection still takes them with it), no pod restarts (the pods get JobSet's default
`restartPolicy: OnFailure`, and Trainer runtimes built by prefect-nemo set `backoffLimit: 0`:
the Job fails at its first failed container), and one replicatedJob (`node`) only.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

from prefect_nemo.local_ray import free_port
from prefect_nemo.testing.operators._controller import (
    PODS,
    Controller,
    Key,
    Kind,
    Obj,
    PodIPs,
    is_not_found,
    live,
    now_rfc3339,
    owner_keys,
    owner_reference,
    parse_rfc3339,
    quantities_as_strings,
    set_condition,
    set_pod_status,
)
from prefect_nemo.testing.operators._node import SimNode
from prefect_nemo.testing.operators._pod_files import PathMapper, env_value, mounted_volumes

log = logging.getLogger(__name__)

GROUP, VERSION = "trainer.kubeflow.org", "v1alpha1"
TRAINJOBS = Kind(GROUP, VERSION, "trainjobs")
NODE = "node"
TRAINER_PORT = 29500
JOBSET_NAME = "jobset.sigs.k8s.io/jobset-name"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
COMPLETED_MESSAGE = "jobset completed successfully"
FAILED_MESSAGE = "jobset failed due to one or more job failures"
_ALPHANUMS = "bcdfghjklmnpqrstvwxz2456789"  # k8s.io/apimachinery rand.String
SIM_NODE = "prefect-nemo-trainer-sim"  # the Node the simulator's pods run on (real API server)

TORCHRUN_SHIM = '''\
"""torchrun stand-in (TrainJob simulator): nproc_per_node local copies with torch's rank env."""
import argparse, os, subprocess, sys

env = os.environ
p = argparse.ArgumentParser(prog="torchrun")
p.add_argument("--nnodes", default=env.get("PET_NNODES", "1"))
p.add_argument("--nproc-per-node", "--nproc_per_node", dest="nproc",
               default=env.get("PET_NPROC_PER_NODE", "1"))
p.add_argument("--node-rank", "--node_rank", dest="node_rank",
               default=env.get("PET_NODE_RANK", "0"))
p.add_argument("--master-addr", "--master_addr", dest="addr",
               default=env.get("PET_MASTER_ADDR", "127.0.0.1"))
p.add_argument("--master-port", "--master_port", dest="port",
               default=env.get("PET_MASTER_PORT", "29500"))
p.add_argument("--standalone", action="store_true")
p.add_argument("-m", "--module", action="store_true")
p.add_argument("--no-python", "--no_python", dest="no_python", action="store_true")
p.add_argument("script")
p.add_argument("args", nargs=argparse.REMAINDER)
a = p.parse_args()
nnodes = int(str(a.nnodes).split(":")[-1])
nproc = 1 if a.nproc in ("auto", "cpu", "gpu") else int(a.nproc)
rank0 = int(a.node_rank) * nproc
if a.no_python:
    cmd = [a.script]
elif a.module:
    cmd = [sys.executable, "-u", "-m", a.script]
else:
    cmd = [sys.executable, "-u", a.script]
if nproc > 1:
    env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does
procs = []
for local in range(nproc):
    child = dict(env, RANK=str(rank0 + local), LOCAL_RANK=str(local), GROUP_RANK=str(a.node_rank),
                 WORLD_SIZE=str(nnodes * nproc), LOCAL_WORLD_SIZE=str(nproc),
                 MASTER_ADDR=a.addr, MASTER_PORT=str(a.port))
    procs.append(subprocess.Popen(cmd + a.args, env=child))
codes = [proc.wait() for proc in procs]
sys.exit(next((c for c in codes if c), 0))
'''


def rand_suffix(n: int = 5) -> str:
    """A random suffix as generateName makes it."""
    import random

    return "".join(random.choice(_ALPHANUMS) for _ in range(n))


@dataclass
class _Process:
    """One pod's local process and where its log goes."""

    popen: subprocess.Popen[bytes]
    log_path: Path
    root: Path
    key: Key
    exit_code: int | None = None
    killed: bool = False
    done: threading.Event = field(default_factory=threading.Event)


class TrainJobSimulator(Controller):
    """Acts like Kubeflow Trainer + JobSet against a LoopbackKubeServer or a real API server
    (see the module doc)."""

    def __init__(
        self,
        server: Any,
        *,
        namespace: str | None = None,
        run_locally: bool = True,
        path_prefixes: tuple[str, ...] = ("/workspace",),
        pending_s: float = 0.1,
        fake_duration_s: float | None = 0.5,
        workdir: str | Path | None = None,
    ) -> None:
        super().__init__(server.api_client(), namespace=namespace, name="trainer-sim")
        self.server = server
        self.run_locally = run_locally
        self.path_prefixes = tuple(path_prefixes)
        self.pending_s = pending_s
        self.fake_duration_s = fake_duration_s
        self._own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="trainjob-sim-"))
        self._core = client.CoreV1Api(self.api_client)
        self._custom = client.CustomObjectsApi(self.api_client)
        self._ips = PodIPs(subnet=7)
        # a real API server reads pods/log from the pod's kubelet: be it
        self.node = None if hasattr(server, "set_pod_log") else SimNode(self._core, SIM_NODE)
        self._procs: dict[tuple[str, str], _Process] = {}  # (namespace, pod) → process
        self._started: dict[tuple[str, str], float] = {}  # fake pods: monotonic start
        self._ports: dict[Key, int] = {}
        self._lock = threading.Lock()
        self._bin = self.workdir / "bin"
        self._bin.mkdir(parents=True, exist_ok=True)
        shim = self._bin / "torchrun"
        shim.write_text(f"#!{sys.executable}\n{TORCHRUN_SHIM}")
        shim.chmod(0o755)

        self.watch(TRAINJOBS)
        self.watch(
            PODS,
            label_selector=JOBSET_NAME,
            map_to=lambda p: owner_keys(p, "TrainJob", "trainjobs"),
        )

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> TrainJobSimulator:  # type: ignore[override]
        """Start watching and reconciling; returns self."""
        if self.node:
            self.node.register()
            self.node.serve_logs()
        super().start()
        return self

    def stop(self) -> None:
        """Stop the controller and every local process it started."""
        super().stop()
        with self._lock:
            procs = list(self._procs.values())
        for proc in procs:
            self._kill(proc)
        if self.node:
            self.node.close()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> TrainJobSimulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def local_pids(self, trainjob: str | None = None) -> list[int]:
        """Process ids of the live local processes (of one TrainJob), for tests."""
        with self._lock:
            return [
                p.popen.pid
                for p in self._procs.values()
                if p.popen.poll() is None and (trainjob is None or p.key[2] == trainjob)
            ]

    # -- events ---------------------------------------------------------------------------------

    def on_event(self, kind: Kind, old: Obj | None, new: Obj | None) -> None:
        obj = new if new is not None else old
        if (
            kind != PODS
            or obj is None
            or not (new is None or obj["metadata"].get("deletionTimestamp"))
        ):
            return
        meta = obj["metadata"]
        with self._lock:
            proc = self._procs.get((meta.get("namespace", ""), meta["name"]))
        if proc is not None:
            self._kill(proc)  # the kubelet stops a deleted pod's containers
        if self.node and new is None:
            self.node.forget(meta.get("namespace", ""), meta["name"])
        elif self.node and new["spec"].get("nodeName") == self.node.name:
            self.node.finish_deletion(new)  # also one left by a simulator before us

    # -- reconcile ------------------------------------------------------------------------------

    def reconcile(self, key: Key) -> float | None:
        _, ns, name = key
        tj = self._get_trainjob(ns, name)
        if tj is None or tj["metadata"].get("deletionTimestamp"):
            self._kill_job(key)
            return None
        spec = tj.get("spec") or {}
        if spec.get("managedBy") not in (None, "", "trainer.kubeflow.org/trainjob-controller"):
            return None
        status = tj.get("status") or {}
        conditions = list(status.get("conditions") or [])
        pods = live(self._list_pods(ns, name))
        if spec.get("suspend"):
            self._kill_job(key)
            for pod in pods:
                self._delete_pod(pod)
            conditions = set_condition(
                conditions, "Suspended", "True", "Suspended", "TrainJob is suspended"
            )
            self._write_status(tj, conditions, pods=[], suspended=True)
            return None
        if any(
            c.get("type") in ("Complete", "Failed") and c.get("status") == "True"
            for c in conditions
        ):
            return None
        if any(c.get("type") == "Suspended" and c.get("status") == "True" for c in conditions):
            conditions = set_condition(
                conditions, "Suspended", "False", "Resumed", "TrainJob is resumed"
            )
        template = self.pod_template(tj)
        if template is None:
            return 1.0  # runtime not there (yet): Trainer's webhook would have refused it
        num_nodes = self._num_nodes(tj)
        pods = self._ensure_pods(tj, template, pods, num_nodes)
        again: float | None = None
        for pod in pods:
            wait = self._advance_pod(tj, pod)
            if wait is not None:
                again = wait if again is None else min(again, wait)
        pods = live(self._list_pods(ns, name))
        phases = [(p.get("status") or {}).get("phase") for p in pods]
        if "Failed" in phases:
            self._kill_job(key)
            for pod in pods:
                if (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
                    self._finish_pod(pod, 137, "Error")
            conditions = set_condition(conditions, "Failed", "True", "FailedJobs", FAILED_MESSAGE)
            again = None
        elif len(pods) >= num_nodes and all(ph == "Succeeded" for ph in phases):
            conditions = set_condition(
                conditions, "Complete", "True", "AllJobsCompleted", COMPLETED_MESSAGE
            )
            again = None
        self._write_status(tj, conditions, pods=pods, suspended=False)
        return again

    # -- pods -----------------------------------------------------------------------------------

    def _num_nodes(self, tj: Obj) -> int:
        trainer = (tj.get("spec") or {}).get("trainer") or {}
        if trainer.get("numNodes"):
            return int(trainer["numNodes"])
        runtime = self._runtime(tj) or {}
        return int(((runtime.get("spec") or {}).get("mlPolicy") or {}).get("numNodes") or 1)

    def pod_template(self, tj: Obj) -> Obj | None:
        """The node pod template: runtime template + runtimePatches + trainer fields + PET env."""
        runtime = self._runtime(tj)
        if runtime is None:
            return None
        jobs = (((runtime.get("spec") or {}).get("template") or {}).get("spec") or {}).get(
            "replicatedJobs"
        ) or []
        node = next((j for j in jobs if j.get("name") == NODE), None)
        if node is None:
            return None
        template = copy.deepcopy(((node.get("template") or {}).get("spec") or {}).get("template"))
        template = template or {"spec": {"containers": [{"name": NODE}]}}
        pod = template.setdefault("spec", {})
        for patch in (tj.get("spec") or {}).get("runtimePatches") or []:
            rjobs = ((patch.get("trainingRuntimeSpec") or {}).get("template") or {}).get(
                "spec", {}
            ).get("replicatedJobs") or []
            for rjob in rjobs:
                if rjob.get("name") == NODE:
                    patch_pod = (
                        ((rjob.get("template") or {}).get("spec") or {}).get("template") or {}
                    ).get("spec") or {}
                    _merge_pod(pod, patch_pod)
        container = next((c for c in pod.get("containers") or [] if c.get("name") == NODE), None)
        if container is None:
            container = {"name": NODE}
            pod.setdefault("containers", []).append(container)
        trainer = (tj.get("spec") or {}).get("trainer") or {}
        if trainer.get("image"):
            container["image"] = trainer["image"]
        if trainer.get("command"):
            container["command"] = list(trainer["command"])
        if trainer.get("args"):
            container["args"] = list(trainer["args"])
        if trainer.get("resourcesPerNode"):
            container["resources"] = copy.deepcopy(trainer["resourcesPerNode"])
        _upsert_env(container, trainer.get("env") or [])
        policy = (runtime.get("spec") or {}).get("mlPolicy") or {}
        if "torch" in policy:
            name = tj["metadata"]["name"]
            nproc = trainer.get("numProcPerNode") or "auto"
            _upsert_env(container, [
                {"name": "PET_NNODES", "value": str(self._num_nodes(tj))},
                {"name": "PET_NPROC_PER_NODE", "value": str(nproc)},
                {"name": "PET_NODE_RANK", "valueFrom": {"fieldRef": {
                    "fieldPath": f"metadata.annotations['{COMPLETION_INDEX}']"}}},
                {"name": "PET_MASTER_ADDR", "value": f"{name}-{NODE}-0-0.{name}"},
                {"name": "PET_MASTER_PORT", "value": str(TRAINER_PORT)},
            ])  # fmt: skip
            ports = container.setdefault("ports", [])
            if not any(p.get("containerPort") == TRAINER_PORT for p in ports):
                ports.append({"containerPort": TRAINER_PORT, "protocol": "TCP"})
        # JobSet's defaulting webhook: "Default pod restart policy to OnFailure". With the
        # runtime's `backoffLimit: 0` the Job fails at the first failed container all the same.
        pod.setdefault("restartPolicy", "OnFailure")
        return template

    def _runtime(self, tj: Obj) -> Obj | None:
        ref = (tj.get("spec") or {}).get("runtimeRef") or {}
        try:
            if ref.get("kind") == "TrainingRuntime":
                return self._custom.get_namespaced_custom_object(
                    GROUP, VERSION, tj["metadata"]["namespace"], "trainingruntimes", ref["name"]
                )
            return self._custom.get_cluster_custom_object(
                GROUP, VERSION, "clustertrainingruntimes", ref.get("name", "")
            )
        except ApiException as exc:
            if is_not_found(exc):
                return None
            raise

    def _ensure_pods(self, tj: Obj, template: Obj, pods: list[Obj], num_nodes: int) -> list[Obj]:
        have = {_index(p) for p in pods}
        for index in range(num_nodes):
            if index not in have:
                pods.append(self._create_pod(tj, template, index, num_nodes))
        return sorted(pods, key=_index)

    def _create_pod(self, tj: Obj, template: Obj, index: int, num_nodes: int) -> Obj:
        ns, name = tj["metadata"]["namespace"], tj["metadata"]["name"]
        job_name = f"{name}-{NODE}-0"
        job_uid = hashlib.sha1(f"{tj['metadata']['uid']}/{job_name}".encode()).hexdigest()
        job_key = hashlib.sha1(f"{ns}/{job_name}".encode()).hexdigest()
        jobset = {
            JOBSET_NAME: name,
            "jobset.sigs.k8s.io/replicatedjob-name": NODE,
            "jobset.sigs.k8s.io/replicatedjob-replicas": "1",
            "jobset.sigs.k8s.io/job-index": "0",
            "jobset.sigs.k8s.io/job-global-index": "0",
            "jobset.sigs.k8s.io/job-key": job_key,
            "jobset.sigs.k8s.io/restart-attempt": "0",
            "jobset.sigs.k8s.io/jobset-uid": tj["metadata"]["uid"],
        }
        job = {
            COMPLETION_INDEX: str(index),
            "batch.kubernetes.io/job-name": job_name,
            "job-name": job_name,
            "batch.kubernetes.io/controller-uid": job_uid,
            "controller-uid": job_uid,
        }
        meta = template.get("metadata") or {}
        labels = {**(meta.get("labels") or {}), **jobset, **job}
        annotations = {
            **(meta.get("annotations") or {}),
            **{k: v for k, v in jobset.items() if k != "jobset.sigs.k8s.io/jobset-uid"},
            COMPLETION_INDEX: str(index),
        }
        spec = quantities_as_strings(copy.deepcopy(template.get("spec") or {}))
        if self.node:
            spec["nodeName"] = self.node.name  # bound: no scheduler runs here
        spec["hostname"] = f"{job_name}-{index}"
        spec["subdomain"] = name
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "generateName": f"{job_name}-{index}-",
                "namespace": ns,
                "labels": labels,
                "annotations": annotations,
                "ownerReferences": [owner_reference(tj)],
            },
            "spec": spec,
        }
        pod = json.loads(self._core.create_namespaced_pod(ns, body, _preload_content=False).data)
        scheduled = {"type": "PodScheduled", "status": "True", "lastTransitionTime": now_rfc3339()}
        set_pod_status(self._core, pod, {"phase": "Pending", "conditions": [scheduled]})
        return pod

    def _advance_pod(self, tj: Obj, pod: Obj) -> float | None:
        """Start a Pending pod, finish a Running one whose process ended; seconds to wait."""
        ns, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
        phase = (pod.get("status") or {}).get("phase") or "Pending"
        if phase in ("Succeeded", "Failed"):
            return None
        created = time.time() - _created_at(pod)
        if phase == "Pending":
            if created < self.pending_s:
                return self.pending_s - created
            if self.run_locally:
                try:
                    self._start_process(tj, pod)
                except Exception as exc:  # bad volume/env: the kubelet's CreateContainerError
                    log.warning("trainer-sim: cannot start pod %s: %s", name, exc)
                    self._set_log(ns, name, f"{exc}\n")
                    self._finish_pod(pod, 128, "StartError")
                    return None
            else:
                with self._lock:
                    self._started[(ns, name)] = time.monotonic()
            self._set_running(pod)
            return None if self.run_locally else self.fake_duration_s
        # Running
        if self.run_locally:
            with self._lock:
                proc = self._procs.get((ns, name))
            if proc is None:  # we restarted: the process is lost with us
                self._finish_pod(pod, 137, "Error")
                return None
            if proc.done.is_set():
                reason = "Completed" if proc.exit_code == 0 else "Error"
                self._finish_pod(pod, proc.exit_code or 0, reason)
            return None
        if self.fake_duration_s is None:
            return None
        with self._lock:
            started = self._started.get((ns, name), time.monotonic())
        left = started + self.fake_duration_s - time.monotonic()
        if left > 0:
            return left
        self._finish_pod(pod, 0, "Completed")
        return None

    def _set_running(self, pod: Obj) -> None:
        now = now_rfc3339()
        ip = self._ips.take()
        statuses = [
            {
                "name": c.get("name", NODE),
                "image": c.get("image", ""),
                "imageID": "",
                "ready": True,
                "started": True,
                "restartCount": 0,
                "state": {"running": {"startedAt": now}},
            }
            for c in pod["spec"].get("containers") or []
        ]
        set_pod_status(self._core, pod, {
            "phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}], "hostIP": "10.0.0.1",
            "startTime": now, "containerStatuses": statuses,
            "conditions": [{"type": t, "status": "True", "lastTransitionTime": now}
                           for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")],
        })  # fmt: skip

    def _finish_pod(self, pod: Obj, exit_code: int, reason: str) -> None:
        now = now_rfc3339()
        started = (pod.get("status") or {}).get("startTime") or now
        statuses = [
            {
                "name": c.get("name", NODE),
                "image": c.get("image", ""),
                "imageID": "",
                "ready": False,
                "started": False,
                "restartCount": 0,
                "state": {"terminated": {"exitCode": exit_code, "reason": reason,
                                         "startedAt": started, "finishedAt": now}},
            }
            for c in pod["spec"].get("containers") or []
        ]  # fmt: skip
        set_pod_status(self._core, pod, {
            "phase": "Succeeded" if exit_code == 0 else "Failed",
            "startTime": started, "containerStatuses": statuses,
            "conditions": [{"type": "Ready", "status": "False", "reason": "PodCompleted",
                            "lastTransitionTime": now}],
        })  # fmt: skip

    def _set_log(self, ns: str, pod: str, source: Any, container: str | None = None) -> None:
        if self.node:
            self.node.set_log(ns, pod, source, container)
        else:
            self.server.set_pod_log(ns, pod, source, container=container)

    def _delete_pod(self, pod: Obj) -> None:
        meta = pod["metadata"]
        with contextlib.suppress(ApiException):
            self._core.delete_namespaced_pod(meta["name"], meta["namespace"])

    # -- local processes ------------------------------------------------------------------------

    def _start_process(self, tj: Obj, pod: Obj) -> None:
        ns, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
        key: Key = ("trainjobs", ns, tj["metadata"]["name"])
        with self._lock:
            if (ns, name) in self._procs:
                return
        root = self.workdir / "pods" / ns / name
        root.mkdir(parents=True, exist_ok=True)
        spec = pod["spec"]
        container = next(c for c in spec.get("containers") or [] if c.get("name") == NODE)
        mounts = {m["name"]: m for m in container.get("volumeMounts") or []}
        mapper = PathMapper(root, [*self.path_prefixes, *(m["mountPath"] for m in mounts.values())])
        mounted_volumes(self._core, ns, spec, [container], mapper, pvc_root=self.workdir / "pvcs")
        with self._lock:
            port = self._ports.setdefault(key, free_port())
        env = {
            "PATH": f"{self._bin}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}"
            + os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(root),
            # a pod's `pip install` lands in the pod, never in the interpreter the tests run on
            "PIP_TARGET": str(root / "pip-packages"),
            "PYTHONPATH": str(root / "pip-packages"),
            "LANG": os.environ.get("LANG", "C.UTF-8"),
            "PYTHONUNBUFFERED": "1",
            "HOSTNAME": spec.get("hostname", name),
        }
        for item in container.get("env") or []:
            env[item["name"]] = mapper(env_value(self._core, ns, pod, item))
        if "PET_MASTER_ADDR" in env:
            env["PET_MASTER_ADDR"], env["PET_MASTER_PORT"] = "127.0.0.1", str(port)
        argv = [mapper(a) for a in [*(container.get("command") or []),
                                    *(container.get("args") or [])]]  # fmt: skip
        if not argv:
            raise RuntimeError(f"pod {name}: the node container has no command")
        log_path = root / "container.log"
        out = open(log_path, "wb")  # closed by the waiter thread
        popen = subprocess.Popen(
            argv, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        proc = _Process(popen=popen, log_path=log_path, root=root, key=key)
        with self._lock:
            self._procs[(ns, name)] = proc
        self._set_log(ns, name, lambda: log_path.read_bytes().decode(errors="replace"), NODE)

        def wait() -> None:
            proc.exit_code = popen.wait()
            out.close()
            proc.done.set()
            self.enqueue(key)

        threading.Thread(target=wait, daemon=True, name=f"trainer-sim-{name}").start()

    def _kill(self, proc: _Process) -> None:
        proc.killed = True
        if proc.popen.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.popen.pid, signal.SIGTERM)
        try:
            proc.popen.wait(3)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.popen.pid, signal.SIGKILL)
            proc.popen.wait(3)

    def _kill_job(self, key: Key) -> None:
        with self._lock:
            procs = [p for p in self._procs.values() if p.key == key]
        for proc in procs:
            self._kill(proc)

    # -- status ---------------------------------------------------------------------------------

    def _write_status(
        self, tj: Obj, conditions: list[Obj], *, pods: list[Obj], suspended: bool
    ) -> None:
        phases = [(p.get("status") or {}).get("phase") for p in pods]
        finished = "Failed" in phases or (phases and all(ph == "Succeeded" for ph in phases))
        job = {
            "name": NODE,
            "ready": sum(ph == "Running" for ph in phases),
            "active": 0 if finished or suspended or not pods else 1,
            "succeeded": 1 if phases and all(ph == "Succeeded" for ph in phases) else 0,
            "failed": 1 if "Failed" in phases else 0,
            "suspended": 1 if suspended else 0,
        }
        new = {"conditions": conditions, "jobsStatus": [job]}
        old = tj.get("status") or {}
        if {k: old.get(k) for k in new} == new:
            return
        meta = tj["metadata"]
        try:
            self._custom.patch_namespaced_custom_object_status(
                GROUP, VERSION, meta["namespace"], "trainjobs", meta["name"], {"status": new}
            )
        except ApiException as exc:
            if not is_not_found(exc):
                raise

    # -- API helpers ----------------------------------------------------------------------------

    def _get_trainjob(self, ns: str, name: str) -> Obj | None:
        try:
            return self._custom.get_namespaced_custom_object(GROUP, VERSION, ns, "trainjobs", name)
        except ApiException as exc:
            if is_not_found(exc):
                return None
            raise

    def _list_pods(self, ns: str, trainjob: str) -> list[Obj]:
        resp = self._core.list_namespaced_pod(
            ns, label_selector=f"{JOBSET_NAME}={trainjob}", _preload_content=False
        )
        return json.loads(resp.data).get("items") or []


def _merge_pod(pod: Obj, patch: Obj) -> None:
    """Apply a runtimePatches pod spec: lists keyed by name (volumes, containers, mounts, env)
    are upserted, anything else replaced, as the Trainer's server-side apply does."""
    for key, value in patch.items():
        if key in ("volumes", "imagePullSecrets", "initContainers", "containers"):
            items = pod.setdefault(key, [])
            for new in value:
                old = next((i for i in items if i.get("name") == new.get("name")), None)
                if old is None:
                    items.append(copy.deepcopy(new))
                elif key in ("containers", "initContainers"):
                    for field_, sub in new.items():
                        if field_ in ("volumeMounts", "env") and isinstance(sub, list):
                            ident = "mountPath" if field_ == "volumeMounts" else "name"
                            cur = old.setdefault(field_, [])
                            for entry in sub:
                                cur[:] = [c for c in cur if c.get(ident) != entry.get(ident)]
                                cur.append(copy.deepcopy(entry))
                        else:
                            old[field_] = copy.deepcopy(sub)
                else:
                    old.clear()
                    old.update(copy.deepcopy(new))
        else:
            pod[key] = copy.deepcopy(value)


def _upsert_env(container: Obj, env: list[Obj]) -> None:
    current = container.setdefault("env", [])
    for item in env:
        current[:] = [e for e in current if e.get("name") != item.get("name")]
        current.append(copy.deepcopy(item))


def _index(pod: Obj) -> int:
    try:
        return int((pod["metadata"].get("labels") or {}).get(COMPLETION_INDEX, 0))
    except ValueError:
        return 0


def _created_at(pod: Obj) -> float:
    return parse_rfc3339(pod["metadata"].get("creationTimestamp")) or time.time()


__all__ = ["TrainJobSimulator"]
