"""A node agent for the real control plane: the kubelet and the scheduler, for local processes.

It registers NODES Nodes, binds each unbound pod of the namespaces it serves to the one running
the fewest pods (there is no kube-scheduler), and runs each container of a bound pod as a local
process in its own session: `command` + `args` with the container's env, the image ignored
(this venv's `ray`/`python` come first on PATH). Init containers run first, one after another,
each to a clean exit (a failed one is restarted, or with `restartPolicy: Never` fails the pod).
Volumes are files under the pod's own root: configMap, secret and projected ones written as the
kubelet writes them, emptyDir a fresh directory, and every mount path in a container's command,
args and env values is mapped there (`operators/_pod_files`), so the pods' processes share no
path by accident. Each pod gets its own address on `lo` (PodNetwork); Services of the served
namespaces resolve to the address of a Ready pod their selector matches. Pod status goes
Pending (init containers running) -> Running (podIP, Ready once its readiness probe passes) ->
Succeeded/Failed with exit codes; a deleted pod's processes are killed and its address
released, and the pod is removed (the kubelet's final delete). Each container's output is its
log, served to `pods/log` from the Node's kubelet endpoint (SimNode.serve_logs, as the
simulators' nodes serve theirs). Only the served namespaces: other tests' simulators write pods
on the same API server and set their status themselves.

A node can be lost (`lose_node`: a test's power cut, asked through the Node's LOST_ANNOTATION):
the agent SIGKILLs its pods' processes and stops being its kubelet (no status, no final delete,
no new pod: its pods read what they last read), and writes what kube-controller-manager's node
lifecycle controller writes once a kubelet stops posting (node-monitor-grace-period): Ready
Unknown, "NodeStatusUnknown", "Kubelet stopped posting node status.", and the
`node.kubernetes.io/unreachable` NoSchedule and NoExecute taints. That controller does not run
here: it would do the same to every node whose kubelet posts no heartbeat, and neither this
agent nor the simulators' nodes post one. The rest is the real kube-controller-manager's: the
taint-eviction-controller deletes the node's pods once their toleration of `unreachable` runs
out (ControlPlane's API server gives every pod run.UNREACHABLE_TOLERATION_S, not 300 s), with
DisruptionTarget "DeletionByTaintManager"; they stay Terminating (no kubelet finishes them). The
Job controller counts them failed but, while a pod of a Job is terminating, gives the Job only
FailureTarget, not Failed ("Delaying marking the Job as finished, because there are still
terminating pod(s)": job_controller.go), so a JobSet (which reads Failed) waits. What ends the
wait on a real cluster is the Node deleted (the pod GC's orphans, after 40 s) or, as Kubernetes
documents for a non-graceful node shutdown, the out-of-service taint an administrator adds
(`out_of_service`): the pod GC then marks the node's terminating pods Failed and deletes them.
`restore_node` brings the node back: its kubelet finishes the deletions and it takes pods again.

`python -m prefect_nemo.testing.control_plane.node_agent KUBECONFIG NAMESPACE... [NAME=IP...]`
runs one until SIGTERM (how ControlPlane starts it, so `make control-plane up` keeps it); each
NAME=IP is one more name its pods resolve (NAME=local: an address of its own on `lo`, for the
Trainer's status server, a local process listening on every address).
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client, config

from prefect_nemo.testing.control_plane.pod_network import PodNetwork, PoolExhausted, service_names
from prefect_nemo.testing.operators._node import SimNode
from prefect_nemo.testing.operators._pod_files import PathMapper, mounted_volumes

NODE_NAME = "prefect-nemo-node"  # the first node; the others add "-2", "-3"
NODES = 3  # a two-node job still has two nodes to run on once one is lost
LOST_ANNOTATION = "prefect-nemo.io/lost"  # lose_node's switch: the agent cuts the node's power
UNREACHABLE_TAINT = "node.kubernetes.io/unreachable"
OUT_OF_SERVICE_TAINT = "node.kubernetes.io/out-of-service"
# every process of a pod carries its uid in its environment (our stand-in for a cgroup): what
# a kill finds, descendants that left the session included
POD_MARKER = "PREFECT_NEMO_POD_UID"
AGENT_MARKER = "PREFECT_NEMO_NODE_AGENT_PID"  # and the agent's pid: what a new agent sweeps
TICK_S = 0.25
KILL_GRACE_S = 3.0  # then SIGKILL; ControlPlane's stop waits 10 s for the agent
log = logging.getLogger("prefect_nemo.node_agent")


# a NAME=LOCAL_ADDRESS argument: NAME resolves to an address of the agent's own on `lo`, which
# reaches a local process listening on every address (the Trainer's status server)
LOCAL_ADDRESS = "local"


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class _Container:
    spec: dict[str, Any]
    proc: subprocess.Popen[bytes] | None = None
    exit_code: int | None = None
    started_at: str = ""
    finished_at: str = ""
    restarts: int = 0
    ready: bool = False
    next_probe: float = 0.0
    failures: int = 0  # readiness probe failures in a row


@dataclass
class _Pod:
    namespace: str
    name: str
    uid: str
    ip: str
    dir: Path
    labels: dict[str, str]
    restart_policy: str
    mapper: PathMapper
    node: str
    containers: list[_Container] = field(default_factory=list)
    init: list[_Container] = field(default_factory=list)  # run in order before `containers`
    reported: tuple[Any, ...] = ()
    released: bool = False  # its address is back in the pool (a later pod may hold it now)

    def initialized(self) -> bool:
        return all(c.exit_code == 0 for c in self.init)

    def init_failed(self) -> bool:
        """An init container failed and will not run again: the pod fails, nothing else runs."""
        return self.restart_policy == "Never" and any(
            c.exit_code not in (None, 0) and c.proc is None for c in self.init
        )

    def done(self) -> bool:
        if self.init_failed():
            return True
        return all(c.exit_code is not None for c in self.containers) and not any(
            c.proc for c in self.containers
        )


class NodeAgent:
    """One Node whose pods are local processes; `start()` its thread, `stop()` ends everything."""

    def __init__(
        self,
        api_client: client.ApiClient,
        namespaces: tuple[str, ...],
        nodes: int = NODES,
        hosts: dict[str, str] | None = None,
    ) -> None:
        self.core = client.CoreV1Api(api_client)
        # short: Ray's unix sockets live under a pod's TMPDIR, and their paths must stay < 108
        self.workdir = Path(tempfile.mkdtemp(prefix="pnpods-", dir="/tmp"))
        self.namespaces = namespaces
        self.network = PodNetwork()
        # the Node objects and a pod's final delete, as the simulators' nodes do them
        names = [NODE_NAME, *(f"{NODE_NAME}-{i}" for i in range(2, nodes + 1))]
        self.nodes = {name: SimNode(self.core, name, self.network) for name in names}
        self.lost: set[str] = set()  # nodes whose power lose_node cut
        # node -> the addresses of the pods that died with it: held, as a CNI would, until the
        # node is back (the pod objects still name them; a new pod must not answer at one)
        self._held: dict[str, list[_Pod]] = {}
        self._load: dict[str, int] = {}  # unfinished pods per node, counted each tick
        self.pods: dict[str, _Pod] = {}  # by uid
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._hosts: dict[str, str] = {}
        # names of what runs outside pods (name -> address); LOCAL_ADDRESS: one address of our
        # own on `lo` (not 127.0.0.1: a reverse lookup of it would find these names; with them
        # there, Ray's "Running entrypoint" line cut into a KubeRay job's output, 3 runs of 3)
        self.static_hosts = dict(hosts or {})
        if LOCAL_ADDRESS in self.static_hosts.values():
            local = self.network.allocate()
            self.static_hosts = {name: local if ip == LOCAL_ADDRESS else ip
                                 for name, ip in self.static_hosts.items()}  # fmt: skip

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> NodeAgent:
        """Register the Node and start the agent's thread; returns self."""
        for pid in _orphans():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        self._register_node()
        self._thread = threading.Thread(target=self._run, name="prefect-nemo-node-agent",
                                        daemon=True)  # fmt: skip
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread, kill every pod's processes, remove addresses and host names."""
        self._stop.set()
        if self._thread:
            self._thread.join(30)
        _kill(list(self.pods.values()))
        self.pods.clear()
        for name, node in self.nodes.items():
            node.close()
            with contextlib.suppress(Exception):
                self.core.delete_node(name)
        self.network.close()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._tick()
            except Exception:  # the API server restarting, a pod racing its deletion
                log.exception("node agent tick")
            self._stop.wait(TICK_S)

    # -- the node --------------------------------------------------------------------------------

    def _register_node(self) -> None:
        capacity = {"cpu": str(os.cpu_count() or 1), "memory": f"{_memory_kib()}Ki",
                    "pods": "110"}  # fmt: skip
        for name, node in self.nodes.items():
            node.register()
            # a node left lost by an agent that died: taken back whole
            self.core.patch_node(name, {"metadata": {"annotations": {LOST_ANNOTATION: None}},
                                        "spec": {"taints": None}})  # fmt: skip
            self.core.patch_node_status(name, {"status": {
                "capacity": capacity, "allocatable": capacity,
                "addresses": [{"type": "Hostname", "address": name}],
                "conditions": [_ready("True", "KubeletReady", "prefect-nemo node agent")],
            }})  # fmt: skip
            node.serve_logs()  # the Node's InternalIP and kubelet port: where pods/log goes

    def _check_lost(self) -> None:
        """Cut the power of a node lose_node marked; bring back one restore_node unmarked."""
        for obj in _items(self.core.list_node):
            name = obj["metadata"]["name"]
            if name not in self.nodes:
                continue
            marked = LOST_ANNOTATION in (obj["metadata"].get("annotations") or {})
            if marked and name not in self.lost:
                self._lose(name)
            elif not marked and name in self.lost:
                self._restore(name)

    def _lose(self, name: str) -> None:
        """The node's power is cut: its processes die at once (SIGKILL, nothing runs after),
        its kubelet says nothing more; then what the node lifecycle controller writes."""
        self.lost.add(name)
        gone = [pod for pod in self.pods.values() if pod.node == name]
        _kill(gone, signals=(signal.SIGKILL,))
        self._held.setdefault(name, []).extend(gone)
        for pod in gone:
            self.nodes[name].forget(pod.namespace, pod.name)
            self.pods.pop(pod.uid, None)
        # node_lifecycle_controller.go (tryUpdateNodeHealth): every condition Unknown,
        # "NodeStatusUnknown", "Kubelet stopped posting node status."; then the unreachable
        # taints (NoSchedule: doNoScheduleTaintingPass; NoExecute: doNoExecuteTaintingPass)
        unknown = _ready("Unknown", "NodeStatusUnknown", "Kubelet stopped posting node status.")
        self.core.patch_node_status(name, {"status": {"conditions": [unknown]}})
        taints = [{"key": UNREACHABLE_TAINT, "effect": effect, "timeAdded": _now()}
                  for effect in ("NoSchedule", "NoExecute")]  # fmt: skip
        self.core.patch_node(name, {"spec": {"taints": taints}})
        log.info("node %s lost: %d pod(s) killed", name, len(gone))

    def _restore(self, name: str) -> None:
        """The node is back: Ready, untainted; its kubelet finishes the deletions (next tick)."""
        self.core.patch_node(name, {"spec": {"taints": None}})
        self.core.patch_node_status(name, {"status": {"conditions": [
            _ready("True", "KubeletReady", "prefect-nemo node agent")]}})  # fmt: skip
        self.lost.discard(name)
        for pod in self._held.pop(name, []):
            self._release(pod)
        log.info("node %s back", name)

    # -- one pass over the served namespaces -----------------------------------------------------

    def _tick(self) -> None:
        self._check_lost()
        seen: set[str] = set()
        listed = [o for ns in self.namespaces for o in _items(self.core.list_namespaced_pod, ns)]
        self._load = dict.fromkeys(self.nodes, 0)
        for obj in listed:
            bound = obj["spec"].get("nodeName")
            unfinished = (obj.get("status") or {}).get("phase") in ("Pending", "Running", None)
            if bound in self._load and unfinished:
                self._load[bound] += 1
        for obj in listed:
            seen.add(obj["metadata"]["uid"])
            try:
                self._reconcile(obj)
            except Exception:  # one pod's trouble must not stop the others being watched
                log.exception("pod %s/%s", obj["metadata"]["namespace"], obj["metadata"]["name"])
        for uid in [uid for uid in self.pods if uid not in seen]:  # deleted at once (grace 0)
            self._forget(self.pods[uid])
        for pod in list(self.pods.values()):
            self._watch_containers(pod)
            self._report(pod)
        self._sync_services()

    def _reconcile(self, obj: dict[str, Any]) -> None:
        meta, spec = obj["metadata"], obj["spec"]
        uid, phase = meta["uid"], (obj.get("status") or {}).get("phase")
        bound = spec.get("nodeName")
        if bound in self.lost:
            return  # its kubelet is gone: nothing happens to the pod on the node itself
        if meta.get("deletionTimestamp"):
            if bound in self.nodes:
                if uid in self.pods:
                    self._forget(self.pods[uid])
                # the kubelet's final delete, of this uid only
                self.nodes[bound].finish_deletion(obj)
            return
        if not bound:
            self._bind(meta)
        elif bound in self.nodes and uid not in self.pods and phase == "Pending":
            self._start_pod(obj)

    def _bind(self, meta: dict[str, Any]) -> None:
        live = [name for name in self.nodes if name not in self.lost]
        if not live:
            return  # Pending, unschedulable, as with no node at all
        target = min(live, key=lambda name: self._load.get(name, 0))
        self._load[target] = self._load.get(target, 0) + 1
        body = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": meta["name"]},
                "target": {"apiVersion": "v1", "kind": "Node", "name": target}}  # fmt: skip
        with contextlib.suppress(client.ApiException):  # bound already, or deleted meanwhile
            # the client cannot read a Binding back (its model wants a target): raw response
            self.core.create_namespaced_pod_binding(meta["name"], meta["namespace"], body,
                                                    _preload_content=False)  # fmt: skip

    # -- pods ------------------------------------------------------------------------------------

    def _start_pod(self, obj: dict[str, Any]) -> None:
        meta, spec = obj["metadata"], obj["spec"]
        folder = self.workdir / meta["uid"][:8]
        (folder / "tmp").mkdir(parents=True, exist_ok=True)
        init, containers = spec.get("initContainers") or [], spec["containers"]
        mapper = PathMapper(folder / "fs", [m["mountPath"] for c in [*init, *containers]
                                            for m in c.get("volumeMounts") or []])  # fmt: skip
        try:
            mounted_volumes(self.core, meta["namespace"], spec, [*init, *containers], mapper,
                            pvc_root=self.workdir / "pvcs", pod=obj)  # fmt: skip
        except (client.ApiException, RuntimeError) as exc:
            # as the kubelet: the pod stays Pending (ContainerCreating) and is tried again
            log.warning("pod %s/%s volumes: %s", meta["namespace"], meta["name"], exc)
            return
        try:
            ip = self.network.allocate()
        except PoolExhausted as exc:  # as a CNI out of addresses: Pending, tried again
            log.warning("pod %s/%s network: %s", meta["namespace"], meta["name"], exc)
            return
        pod = _Pod(meta["namespace"], meta["name"], meta["uid"], ip, folder,
                   meta.get("labels") or {}, spec.get("restartPolicy", "Always"), mapper,
                   spec["nodeName"], [_Container(c) for c in containers],
                   [_Container(c) for c in init])  # fmt: skip
        self.pods[pod.uid] = pod
        obj.setdefault("status", {}).update(podIP=ip, hostIP="127.0.0.1")
        for container in pod.init[:1] or pod.containers:
            self._spawn(pod, container, obj)
        log.info("pod %s/%s on %s", pod.namespace, pod.name, ip)

    def _spawn(self, pod: _Pod, container: _Container, obj: dict[str, Any]) -> None:
        spec = container.spec
        try:
            env = {k: pod.mapper(v) for k, v in self._env(pod, spec, obj).items()}
            argv = [pod.mapper(_expand(a, env))
                    for a in [*spec.get("command", []), *spec.get("args", [])]]  # fmt: skip
            if not argv:
                raise ValueError("no command: the agent cannot run an image's entrypoint")
            # A pod has its own network namespace, so two pods may bind the same fixed port on
            # all interfaces; here they share one, so "all interfaces" becomes the pod's address.
            argv = [a.replace("0.0.0.0", pod.ip) for a in argv]
            # In a pod the address Ray finds by its default route is the pod's own; here it
            # would be the machine's, so `ray start` is told the pod's address.
            argv = [_ray_node_ip(a, pod.ip) for a in argv]
            path = pod.dir / f"{spec['name']}.log"
            with open(path, "ab") as out:
                container.proc = subprocess.Popen(
                    argv, env=env, cwd=pod.dir, stdout=out, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, start_new_session=True,
                )  # fmt: skip
            self.nodes[pod.node].set_log(pod.namespace, pod.name,
                                         lambda: path.read_text(errors="replace"),
                                         spec["name"])  # fmt: skip
            container.started_at, container.exit_code = _now(), None
        except (OSError, ValueError, client.ApiException, KeyError) as exc:
            log.warning("pod %s/%s container %s: %s", pod.namespace, pod.name, spec["name"], exc)
            container.proc, container.exit_code, container.finished_at = None, 128, _now()

    def _env(self, pod: _Pod, spec: dict[str, Any], obj: dict[str, Any]) -> dict[str, str]:
        """The container's environment: a clean base (not this process's: a container gets
        only what its image and spec give it), then `envFrom`, then `env` in order."""
        venv_bin = str(Path(sys.executable).parent)
        env = {
            "PATH": f"{venv_bin}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": str(pod.dir), "TMPDIR": str(pod.dir / "tmp"), "LANG": "C.UTF-8",
            "HOSTNAME": pod.name, "RAY_USAGE_STATS_ENABLED": "0",  # no network to report to
            POD_MARKER: pod.uid, AGENT_MARKER: str(os.getpid()),
        }  # fmt: skip
        for source in spec.get("envFrom") or []:
            for key, value in self._ref_data(pod.namespace, source).items():
                env[(source.get("prefix") or "") + key] = value
        for var in spec.get("env") or []:
            if "value" in var or "valueFrom" not in var:
                env[var["name"]] = _expand(var.get("value") or "", env)
                continue
            ref = var["valueFrom"]
            if "fieldRef" in ref:
                env[var["name"]] = _field(obj, ref["fieldRef"]["fieldPath"])
            elif "resourceFieldRef" in ref:
                env[var["name"]] = _resource(spec, ref["resourceFieldRef"])
            else:
                kind = "secretKeyRef" if "secretKeyRef" in ref else "configMapKeyRef"
                key_ref = ref[kind]
                data = self._ref_data(pod.namespace, {kind.replace("KeyRef", "Ref"): key_ref})
                if key_ref["key"] in data:
                    env[var["name"]] = data[key_ref["key"]]
                elif not key_ref.get("optional"):
                    raise KeyError(f"{kind} {key_ref.get('name')}/{key_ref['key']} not found")
        env[POD_MARKER], env[AGENT_MARKER] = pod.uid, str(os.getpid())
        return env

    def _ref_data(self, namespace: str, source: dict[str, Any]) -> dict[str, str]:
        if ref := source.get("secretRef"):
            try:
                secret = self.core.read_namespaced_secret(ref["name"], namespace)
            except client.ApiException:
                return {}
            return {k: base64.b64decode(v).decode() for k, v in (secret.data or {}).items()}
        ref = source.get("configMapRef") or {}
        try:
            return dict(self.core.read_namespaced_config_map(ref["name"], namespace).data or {})
        except client.ApiException:
            return {}

    def _watch_containers(self, pod: _Pod) -> None:
        if not pod.initialized():
            self._watch_init(pod)
            return
        for container in pod.containers:
            if container.proc is not None and (code := container.proc.poll()) is not None:
                container.proc, container.exit_code = None, code
                container.finished_at, container.ready = _now(), False
                restart = pod.restart_policy == "Always" or (
                    pod.restart_policy == "OnFailure" and code != 0
                )
                if restart:
                    container.restarts += 1
                    self._spawn(pod, container, self._pod_object(pod))
            elif container.proc is not None and time.monotonic() >= container.next_probe:
                probe = container.spec.get("readinessProbe") or {}
                ok = _probe(probe, pod.ip)
                container.failures = 0 if ok else container.failures + 1
                # as the kubelet: ready on a success, unready after failureThreshold failures
                if ok or container.failures >= probe.get("failureThreshold", 3):
                    container.ready = ok
                # initialDelaySeconds is left out (it allows for image pulls, we have none),
                # and a period over 1 s only slows the tests down
                container.next_probe = time.monotonic() + min(probe.get("periodSeconds", 1), 1)

    def _watch_init(self, pod: _Pod) -> None:
        """Run the init containers in order: the next once one exits 0, the pod's containers
        after the last; a failed one again (restartPolicy OnFailure/Always) or never."""
        current = next(c for c in pod.init if c.exit_code != 0 or c.proc is not None)
        if current.proc is None or (code := current.proc.poll()) is None:
            return
        current.proc, current.exit_code, current.finished_at = None, code, _now()
        if code != 0:
            if pod.restart_policy != "Never":
                current.restarts += 1
                self._spawn(pod, current, self._pod_object(pod))
            return
        obj = self._pod_object(pod)
        following = next((c for c in pod.init if c.exit_code is None), None)
        for container in [following] if following else pod.containers:
            self._spawn(pod, container, obj)

    def _pod_object(self, pod: _Pod) -> dict[str, Any]:
        obj = self.core.read_namespaced_pod(pod.name, pod.namespace)
        return self.core.api_client.sanitize_for_serialization(obj)  # type: ignore[no-any-return]

    def _report(self, pod: _Pod) -> None:
        """Patch the pod's status when it changed since the last report."""
        initialized = pod.initialized()
        statuses = [_container_status(c, started=initialized) for c in pod.containers]
        ready = initialized and all(c.ready for c in pod.containers)
        phase = "Running" if initialized else "Pending"
        if pod.done():
            failed = pod.init_failed() or any(c.exit_code != 0 for c in pod.containers)
            phase = "Failed" if failed else "Succeeded"
        key = (phase, ready, tuple((c.exit_code, c.restarts, c.ready)
                                   for c in [*pod.init, *pod.containers]))  # fmt: skip
        if key == pod.reported:
            return
        flag = "True" if ready and phase == "Running" else "False"
        conditions = [{"type": t, "status": s, "lastTransitionTime": _now()} for t, s in [
            ("PodScheduled", "True"), ("Initialized", "True" if initialized else "False"),
            ("ContainersReady", flag), ("Ready", flag)]]  # fmt: skip
        status = {"phase": phase, "podIP": pod.ip, "podIPs": [{"ip": pod.ip}],
                  "hostIP": "127.0.0.1", "hostIPs": [{"ip": "127.0.0.1"}],
                  "conditions": conditions, "containerStatuses": statuses}  # fmt: skip
        if pod.init:
            status["initContainerStatuses"] = [_container_status(c) for c in pod.init]
        if not pod.reported:
            status["startTime"] = _now()
        try:
            self.core.patch_namespaced_pod_status(pod.name, pod.namespace, {"status": status})
        except client.ApiException as exc:
            if exc.status != 404:
                raise
        pod.reported = key
        if phase != "Running":  # a finished pod's sandbox is gone: so is its address
            self._release(pod)

    def _forget(self, pod: _Pod) -> None:
        _kill([pod])
        self._release(pod)
        self.nodes[pod.node].forget(pod.namespace, pod.name)  # its log
        self.pods.pop(pod.uid, None)
        log.info("pod %s/%s gone", pod.namespace, pod.name)

    def _release(self, pod: _Pod) -> None:
        """Give the pod's address back, once: released at its end, it may be a newer pod's by
        the time the finished pod is deleted."""
        if not pod.released:
            pod.released = True
            self.network.release(pod.ip)

    # -- Service names ---------------------------------------------------------------------------

    def _sync_services(self) -> None:
        names: dict[str, str] = dict(self.static_hosts)
        ready = [p for p in self.pods.values()
                 if all(c.ready for c in p.containers) and not p.done()]  # fmt: skip
        for ns in self.namespaces:
            for svc in _items(self.core.list_namespaced_service, ns):
                selector = svc["spec"].get("selector") or {}
                match = next((p for p in ready if p.namespace == ns and selector
                              and selector.items() <= p.labels.items()), None)  # fmt: skip
                if match:
                    name = svc["metadata"]["name"]
                    names.update(dict.fromkeys(service_names(name, ns), match.ip))
        if names != self._hosts:
            self.network.set_hosts(names)
            self._hosts = names


# -- helpers -----------------------------------------------------------------------------------


def _items(list_call: Any, *args: str) -> list[dict[str, Any]]:
    """A list call's items as the API server sent them (JSON): the agent lists pods, Services
    and Nodes 4 times a second, and the client's models cost ~4x the request itself to build
    (CI run 49: the agent took 62 CPU-s of the 2 cores' 23 minutes)."""
    response = list_call(*args, _preload_content=False)
    return json.loads(response.data)["items"]  # type: ignore[no-any-return]


def _container_status(c: _Container, *, started: bool = True) -> dict[str, Any]:
    if not started:  # behind the init containers
        state: dict[str, Any] = {"running": None, "terminated": None,
                                 "waiting": {"reason": "PodInitializing"}}  # fmt: skip
    elif c.proc is not None:
        state = {"running": {"startedAt": c.started_at}, "terminated": None, "waiting": None}
    else:
        state = {"running": None, "waiting": None, "terminated": {
            "exitCode": c.exit_code, "reason": "Completed" if c.exit_code == 0 else "Error",
            "startedAt": c.started_at or None, "finishedAt": c.finished_at}}  # fmt: skip
    return {"name": c.spec["name"], "image": c.spec.get("image", ""), "imageID": "",
            "ready": c.ready, "started": c.proc is not None, "restartCount": c.restarts,
            "state": state}  # fmt: skip


def _ready(status: str, reason: str, message: str) -> dict[str, Any]:
    """A Node's Ready condition, as the kubelet (or the node lifecycle controller) writes it."""
    return {"type": "Ready", "status": status, "reason": reason, "message": message,
            "lastHeartbeatTime": _now(), "lastTransitionTime": _now()}  # fmt: skip


def lose_node(core: client.CoreV1Api, name: str, timeout_s: float = 30.0) -> None:
    """Cut a node's power (the agent serving it kills its pods' processes and marks it
    unreachable: the module docstring); returns once the Node reads Ready Unknown."""
    core.patch_node(name, {"metadata": {"annotations": {LOST_ANNOTATION: "true"}}})
    _wait_ready(core, name, "Unknown", timeout_s)


def out_of_service(core: client.CoreV1Api, name: str) -> None:
    """Taint a lost node `node.kubernetes.io/out-of-service=nodeshutdown:NoExecute`, the
    administrator's step of Kubernetes' non-graceful node shutdown ("the pods will be forcefully
    deleted if there are no matching tolerations on it": Kubernetes docs, Node Shutdowns); the
    pod GC (gcTerminating: a node not Ready with that taint) then finishes its pods."""
    taints = core.read_node(name).spec.taints or []
    body = [core.api_client.sanitize_for_serialization(t) for t in taints]
    body.append({"key": OUT_OF_SERVICE_TAINT, "value": "nodeshutdown", "effect": "NoExecute",
                 "timeAdded": _now()})  # fmt: skip
    core.patch_node(name, {"spec": {"taints": body}})


def restore_node(core: client.CoreV1Api, name: str, timeout_s: float = 30.0) -> None:
    """Bring a lost node back; returns once it reads Ready True."""
    core.patch_node(name, {"metadata": {"annotations": {LOST_ANNOTATION: None}}})
    _wait_ready(core, name, "True", timeout_s)


def _wait_ready(core: client.CoreV1Api, name: str, status: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        conditions = core.read_node(name).status.conditions or []
        if any(c.type == "Ready" and c.status == status for c in conditions):
            return
        time.sleep(TICK_S)
    raise TimeoutError(f"node {name} did not read Ready {status} within {timeout_s} s")


def _probe(probe: dict[str, Any] | None, ip: str) -> bool:
    """A readiness probe against the pod's address, as the kubelet runs it; no probe: ready."""
    if not probe:
        return True
    timeout = min(probe.get("timeoutSeconds", 1), 5)  # capped: the agent's one thread waits
    try:
        if get := probe.get("httpGet"):
            scheme, host = get.get("scheme", "HTTP").lower(), get.get("host") or ip
            url = f"{scheme}://{host}:{get['port']}{get.get('path', '/')}"
            with urllib.request.urlopen(url, timeout=timeout) as resp:
                return 200 <= resp.status < 400
        if tcp := probe.get("tcpSocket"):
            with socket.create_connection((tcp.get("host") or ip, int(tcp["port"])), timeout):
                return True
        if run := probe.get("exec"):
            done = subprocess.run(run["command"], capture_output=True, timeout=timeout)
            return done.returncode == 0
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return False
    return True


def _kill(
    pods: list[_Pod], signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGKILL)
) -> None:
    """Each of `signals` to every process of the pods, in turn, until none is left (SIGTERM
    then SIGKILL after a grace period; a lost node's power: SIGKILL alone)."""
    uids = {pod.uid for pod in pods}
    procs = [c for pod in pods for c in [*pod.init, *pod.containers] if c.proc is not None]
    for sig in signals:
        wait_s = KILL_GRACE_S if sig == signal.SIGTERM else 2.0
        for c in procs:
            if c.proc is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(c.proc.pid, sig)
        for pid in pod_processes(uids):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            for c in procs:
                if c.proc is not None and c.proc.poll() is not None:
                    c.exit_code, c.proc = c.proc.returncode, None
            if not pod_processes(uids) and all(c.proc is None for c in procs):
                return
            time.sleep(0.1)


def pod_processes(uids: set[str], name: str = POD_MARKER) -> list[int]:
    """The live processes of the pods `uids` (their environment sets `name` to the uid)."""
    wanted = {f"{name}={uid}".encode() for uid in uids}
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if wanted & set(Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")):
                state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    pids.append(int(entry))
        except OSError:
            continue
    return pids


def _orphans() -> list[int]:
    """Processes of pods whose agent is gone (killed with -9: it could not stop them)."""
    agents: set[str] = set()
    for entry in os.listdir("/proc"):
        with contextlib.suppress(OSError):
            for var in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                if var.startswith(f"{AGENT_MARKER}=".encode()):
                    agents.add(var.split(b"=", 1)[1].decode())
    dead = {pid for pid in agents if not Path(f"/proc/{pid}").exists()}
    return pod_processes(dead, AGENT_MARKER) if dead else []


def _ray_node_ip(arg: str, ip: str) -> str:
    if "ray start" not in arg or "--node-ip-address" in arg:
        return arg
    return arg.replace("ray start", f"ray start --node-ip-address={ip}")


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion ($$(VAR) stays literal; an unknown name stays as is)."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
                  text)  # fmt: skip


def _field(obj: dict[str, Any], path: str) -> str:
    """A downward-API fieldRef: metadata.name/namespace/uid, labels['k'], annotations['k'],
    spec.nodeName/serviceAccountName, status.podIP/hostIP."""
    if m := re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path):
        return str((obj["metadata"].get(m.group(1)) or {}).get(m.group(2), ""))
    if path == "status.podIPs":
        return obj.get("status", {}).get("podIP", "")
    section, _, name = path.partition(".")
    return str((obj.get(section) or {}).get(name) or "")


def _resource(spec: dict[str, Any], ref: dict[str, Any]) -> str:
    """A resourceFieldRef (limits.cpu, requests.memory, ...): the value, or the node's."""
    kind, _, name = ref["resource"].partition(".")
    value = ((spec.get("resources") or {}).get(kind) or {}).get(name)
    if value is None:
        return str(os.cpu_count() or 1) if name == "cpu" else str(_memory_kib() * 1024)
    return str(value)


def _memory_kib() -> int:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1])
    return 8 * 1024 * 1024


def main(argv: list[str]) -> int:
    """Run an agent for the cluster of `argv[0]` (a kubeconfig) until SIGTERM or SIGINT."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    kubeconfig, rest = argv[0], argv[1:]
    namespaces = tuple(a for a in rest if "=" not in a)
    hosts = dict(a.split("=", 1) for a in rest if "=" in a)  # NAME=ADDRESS: an /etc/hosts entry
    agent = NodeAgent(config.new_client_from_config(kubeconfig), namespaces, hosts=hosts).start()
    log.info("node %s serving %s; pods under %s", NODE_NAME, namespaces, agent.workdir)
    stopped = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopped.set())
    while not stopped.wait(1):
        pass
    agent.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
