"""A KubeRay 1.7 (ray.io/v1) operator simulator that runs RayJobs on a real local Ray.

It talks to the API server only through the kubernetes client, as the real operator does:
RayClusters get head/worker Pods (made Running/Ready through /status after a delay) and the
head Service, whose dashboard port the loopback server proxies to the real Ray dashboard;
RayJobs walk KubeRay's state machine (Initializing → Running → Complete/Failed, Suspending →
Suspended, ValidationFailed) and their entrypoints run as real Ray jobs. Every simulated
cluster shares the one Ray behind it, so "deleting a cluster" stops the Ray jobs it ran. A
K8sJobMode RayJob's `submitterPodTemplate` is honoured (its volumes and init containers run
locally before the submit, its local working_dir is uploaded), and the driver gets the head
container's env (`_kuberay_pods`).

On a real API server (no `set_service_proxy`) the simulator is also the kubelet of a Node of its
own (`_node.SimNode`): pods are bound to it, each running pod gets a pod address, the head pod
answers the dashboard port there (forwarding to the real Ray, so the API server's service proxy
reaches Ray through the real EndpointSlice controller), `pods/log` reads come from the Node's
kubelet endpoint, and a deleted pod's deletion is finished by it.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import random
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import requests
import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException
from ray.job_submission import JobDetails, JobStatus

from prefect_nemo.backends.ray_jobs import TimedJobClient
from prefect_nemo.testing.operators._controller import (
    PODS,
    STRICT,
    Controller,
    Key,
    Kind,
    Obj,
    PodIndex,
    PodIPs,
    is_not_found,
    live,
    now_rfc3339,
    owner_keys,
    owner_reference,
    parse_rfc3339,
    pod_is_ready,
    pod_is_running,
    quantities_as_strings,
    running_pod_status,
    set_condition,
    set_pod_status,
)
from prefect_nemo.testing.operators._kuberay_pods import (
    SubmitterFailed,
    map_runtime_env,
    run_submitter_pod,
    with_head_env,
)
from prefect_nemo.testing.operators._node import SimNode
from prefect_nemo.testing.operators.fake_ray import FakeRay

log = logging.getLogger(__name__)

GROUP, VERSION = "ray.io", "v1"
RAYCLUSTERS = Kind(GROUP, VERSION, "rayclusters")
RAYJOBS = Kind(GROUP, VERSION, "rayjobs")
FINALIZER = "ray.io/rayjob-finalizer"
CLUSTER_SELECTOR_KEY = "ray.io/cluster"
MAX_RAYJOB_NAME = 47
DEFAULT_PORTS = {"client": 10001, "gcs-server": 6379, "dashboard": 8265, "metrics": 8080}
TERMINAL_JOB = {"SUCCEEDED", "FAILED", "STOPPED"}
TERMINAL_DEPLOYMENT = {"Complete", "Failed"}
POLL_S = 0.2
REQUEUE_S = 3.0  # KubeRay's RayJobDefaultRequeueDuration
SIM_NODE = "prefect-nemo-kuberay-sim"  # the Node the simulator's pods run on (real API server)
_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "upgrade", "host",
                "content-length", "content-encoding"}  # fmt: skip

# k8s.io/apimachinery rand.String's alphabet (no vowels, no confusable digits)
_ALPHANUMS = "bcdfghjklmnpqrstvwxz2456789"


def rand_suffix(n: int = 5) -> str:
    """A random suffix as KubeRay's utils.GenerateRayClusterName/GenerateRayJobId make it."""
    return "".join(random.choice(_ALPHANUMS) for _ in range(n))


class _Invalid(Exception):
    """A RayJob spec KubeRay rejects (→ ValidationFailed)."""


def validate_rayjob(rj: Obj) -> None:
    """KubeRay 1.7's ValidateRayJobMetadata + ValidateRayJobSpec (the checks that apply here)."""
    name = rj["metadata"]["name"]
    spec = rj.get("spec") or {}
    if len(name) > MAX_RAYJOB_NAME:
        raise _Invalid(
            "The RayJob metadata is invalid: RayJob name should be no more than "
            f"{MAX_RAYJOB_NAME} characters"
        )
    shutdown = bool(spec.get("shutdownAfterJobFinishes"))
    selector = spec.get("clusterSelector") or {}
    mode = spec.get("submissionMode") or "K8sJobMode"
    if spec.get("suspend") and not shutdown:
        raise _Invalid(
            "The RayJob spec is invalid: a RayJob with shutdownAfterJobFinishes set to false "
            "is not allowed to be suspended"
        )
    ttl = spec.get("ttlSecondsAfterFinished") or 0
    if ttl < 0:
        raise _Invalid(
            "The RayJob spec is invalid: TTLSecondsAfterFinished must be a non-negative integer"
        )
    if not shutdown and ttl > 0:
        raise _Invalid(
            "The RayJob spec is invalid: a RayJob with shutdownAfterJobFinishes set to false "
            "cannot have TTLSecondsAfterFinished"
        )
    if spec.get("suspend") and selector:
        raise _Invalid(
            "The RayJob spec is invalid: the ClusterSelector mode doesn't support the suspend "
            "operation"
        )
    if not spec.get("rayClusterSpec") and not selector:
        raise _Invalid(
            "The RayJob spec is invalid: one of RayClusterSpec or ClusterSelector must be set"
        )
    if selector:
        if not selector.get(CLUSTER_SELECTOR_KEY):
            raise _Invalid("cluster name in ClusterSelector should not be empty")
        if mode == "SidecarMode":
            raise _Invalid("ClusterSelector is not supported in SidecarMode")
        if (spec.get("backoffLimit") or 0) > 0:
            raise _Invalid(
                "The RayJob spec is invalid: BackoffLimit is incompatible with ClusterSelector mode"
            )
    if mode == "SidecarMode" and spec.get("submitterPodTemplate"):
        raise _Invalid("Currently, SidecarMode doesn't support SubmitterPodTemplate")
    try:
        runtime_env = yaml.safe_load(spec.get("runtimeEnvYAML") or "") or {}
        if not isinstance(runtime_env, dict):
            raise ValueError("not a mapping")
    except (yaml.YAMLError, ValueError) as exc:
        raise _Invalid(f"failed to unmarshal RuntimeEnvYAML: {exc}") from None
    deadline = spec.get("activeDeadlineSeconds")
    if deadline is not None and deadline <= 0:
        raise _Invalid(
            "The RayJob spec is invalid: activeDeadlineSeconds must be a positive integer"
        )
    if (spec.get("backoffLimit") or 0) < 0:
        raise _Invalid("The RayJob spec is invalid: backoffLimit must be a positive integer")


def _desired_workers(group: Obj) -> int:
    """GetWorkerGroupDesiredReplicas: replicas clamped to [min, max], times numOfHosts."""
    if group.get("suspend"):
        return 0
    lo = group.get("minReplicas") or 0
    hi = group.get("maxReplicas", 2**31 - 1)
    replicas = group.get("replicas")
    replicas = lo if replicas is None or replicas < lo else min(replicas, hi)
    return replicas * (group.get("numOfHosts") or 1)


def _pod_labels(cluster: str, node_type: str, group: str, extra: dict[str, str]) -> dict[str, str]:
    """KubeRay's labelPod: its own labels win for node-type, group and cluster."""
    labels = {
        "ray.io/is-ray-node": "yes",
        "ray.io/cluster": cluster,
        "ray.io/node-type": node_type,
        "ray.io/group": group,
        "ray.io/identifier": f"{cluster}-{node_type}",
        "app.kubernetes.io/name": "kuberay",
        "app.kubernetes.io/created-by": "kuberay-operator",
    }
    for key, value in extra.items():
        if key not in ("ray.io/node-type", "ray.io/group", "ray.io/cluster"):
            labels[key] = value
    return labels


class KubeRaySimulator(Controller):
    """Acts like the KubeRay operator against a LoopbackKubeServer, running jobs on a real Ray."""

    def __init__(
        self,
        server: Any,
        ray_dashboard_url: str | FakeRay,
        ray_token: str | None,
        *,
        namespace: str | None = None,
        head_ready_delay_s: float = 0.2,
    ) -> None:
        super().__init__(server.api_client(), namespace=namespace, name="kuberay-sim")
        self.server = server
        # a FakeRay runs jobs on a clock (scale tests): no Ray, no process per job
        self.fake_ray = ray_dashboard_url if isinstance(ray_dashboard_url, FakeRay) else None
        self.ray_dashboard_url = "" if self.fake_ray else str(ray_dashboard_url).rstrip("/")
        self.head_ready_delay_s = head_ready_delay_s
        self._ray_headers = {"Authorization": f"Bearer {ray_token}"} if ray_token else {}
        self._ray: TimedJobClient | None = None
        self._ray_lock = threading.Lock()
        self._core = client.CoreV1Api(self.api_client)
        self._custom = client.CustomObjectsApi(self.api_client)
        self._ips = PodIPs(subnet=1)
        # a real API server routes its service proxy to pod addresses: be their kubelet
        self.node = None if hasattr(server, "set_service_proxy") else SimNode(self._core, SIM_NODE)
        self._created: dict[tuple[str, str], float] = {}  # pod → monotonic creation time
        self._proxied: set[tuple[str, str]] = set()  # (namespace, head service)
        self._pods = PodIndex("ray.io/cluster")
        self._logged_pods: set[tuple[str, str]] = set()
        self._cluster_jobs: dict[tuple[str, str], list[str]] = {}  # cluster → Ray job ids
        self._live_jobs: dict[str, Key] = {}  # Ray job id → RayJob key, while not terminal
        self._snapshot: dict[str, JobDetails] = {}
        self._state_lock = threading.Lock()
        self._wake = threading.Event()
        self._poller = threading.Thread(target=self._poll, daemon=True, name="kuberay-sim-poll")
        # submitter pods' files and heads' env files (0700: the env may hold Secret values)
        self.workdir = Path(tempfile.mkdtemp(prefix="kuberay-sim-"))

        self.watch(RAYJOBS)
        self.watch(RAYCLUSTERS, map_to=self._cluster_event_keys)
        self.watch(
            PODS,
            label_selector="app.kubernetes.io/created-by=kuberay-operator",
            map_to=lambda pod: [
                ("rayclusters", pod["metadata"]["namespace"], pod["metadata"]["labels"][key])
                for key in ["ray.io/cluster"]
                if key in (pod["metadata"].get("labels") or {})
            ],
        )

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> KubeRaySimulator:  # type: ignore[override]
        """Start watching and reconciling; returns self."""
        if self.node:
            self.node.register()
            self.node.serve_logs()
        super().start()
        self._poller.start()
        return self

    def stop(self) -> None:
        """Stop the threads and remove the service proxies registered (or the pods' listeners
        and addresses)."""
        super().stop()
        self._wake.set()
        self._poller.join(5)
        for ns, svc in list(self._proxied):
            self._unproxy(ns, svc)
        if self.node:
            self.node.close()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> KubeRaySimulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- Ray ------------------------------------------------------------------------------------

    @property
    def ray(self) -> Any:
        """The Jobs API client of the real Ray (created once: creating it asks Ray's version),
        or the FakeRay."""
        if self.fake_ray is not None:
            return self.fake_ray
        with self._ray_lock:
            if self._ray is None:
                self._ray = TimedJobClient(
                    self.ray_dashboard_url, timeout_s=30, headers=self._ray_headers
                )
            return self._ray

    def _poll(self) -> None:
        """One list_jobs per tick while any job is live; wakes the RayJobs whose job changed."""
        while not self.stopping.is_set():
            with self._state_lock:
                watching = dict(self._live_jobs)
            if not watching:
                self._wake.wait(1.0)
                self._wake.clear()
                continue
            try:
                jobs = {j.submission_id: j for j in self.ray.list_jobs() if j.submission_id}
            except Exception as exc:
                log.debug("kuberay-sim: list_jobs failed: %r", exc)
                self.stopping.wait(POLL_S)
                continue
            with self._state_lock:
                old, self._snapshot = self._snapshot, jobs
            for job_id, key in watching.items():
                new = jobs.get(job_id)
                before = old.get(job_id)
                if new is not None and (
                    before is None
                    or (before.status, before.message, before.end_time)
                    != (new.status, new.message, new.end_time)
                ):
                    self.enqueue(key)
            self.stopping.wait(POLL_S)

    def _watch_job(self, job_id: str, key: Key, cluster: tuple[str, str]) -> None:
        with self._state_lock:
            self._live_jobs[job_id] = key
            jobs = self._cluster_jobs.setdefault(cluster, [])
            if job_id not in jobs:
                jobs.append(job_id)
        self._wake.set()

    def _job(self, job_id: str) -> JobDetails | None:
        with self._state_lock:
            return self._snapshot.get(job_id)

    def _stop_ray_job(self, job_id: str) -> None:
        """Stop a Ray job unless it already ended (what deleting its cluster would do)."""
        if not job_id:
            return
        try:
            if not self.ray.get_job_status(job_id).is_terminal():
                self.ray.stop_job(job_id)
        except Exception as exc:  # unknown id or Ray gone: nothing left to stop
            log.debug("kuberay-sim: stop of %s: %r", job_id, exc)

    def _cluster_logs(self, ns: str, cluster: str) -> str:
        with self._state_lock:
            job_ids = list(self._cluster_jobs.get((ns, cluster), []))
        parts = []
        for job_id in job_ids:
            with contextlib.suppress(Exception):
                parts.append(self.ray.get_job_logs(job_id))
        return "".join(parts)

    # -- event mapping --------------------------------------------------------------------------

    def _cluster_event_keys(self, rc: Obj) -> list[Key]:
        """A RayCluster change reconciles the cluster and the RayJobs that use it."""
        ns, name = rc["metadata"].get("namespace", ""), rc["metadata"]["name"]
        keys: list[Key] = [("rayclusters", ns, name), *owner_keys(rc, "RayJob", "rayjobs")]
        for rj in self.cached_all("rayjobs"):
            selector = (rj.get("spec") or {}).get("clusterSelector") or {}
            if rj["metadata"].get("namespace") == ns and selector.get(CLUSTER_SELECTOR_KEY) == name:
                keys.append(("rayjobs", ns, rj["metadata"]["name"]))
        return keys

    def on_event(self, kind: Kind, old: Obj | None, new: Obj | None) -> None:
        if kind == PODS:
            self._pods.seen(old, new)
        if self.node is not None and kind == PODS:  # as the kubelet of our Node
            if new is None and old is not None:
                self.node.forget(old["metadata"]["namespace"], old["metadata"]["name"])
            elif new is not None and new["metadata"].get("deletionTimestamp"):
                if (new.get("spec") or {}).get("nodeName") == self.node.name:
                    self.node.finish_deletion(new)
        if (
            kind == RAYCLUSTERS
            and old is not None
            and (new is None or new["metadata"].get("deletionTimestamp"))
        ):
            # A deleted cluster takes its Ray jobs with it; the Ray here is shared, so stop them.
            ns, name = old["metadata"].get("namespace", ""), old["metadata"]["name"]
            with self._state_lock:
                job_ids = list(self._cluster_jobs.get((ns, name), []))
            for job_id in job_ids:
                self._stop_ray_job(job_id)
            self._unproxy(ns, f"{name}-head-svc")
            self._head_env_file(ns, name).unlink(missing_ok=True)

    def _head_env_file(self, ns: str, cluster: str) -> Path:
        return self.workdir / "heads" / ns / f"{cluster}.env"

    def _unproxy(self, ns: str, svc: str) -> None:
        if (ns, svc) in self._proxied:
            self._proxied.discard((ns, svc))
            for port in (DEFAULT_PORTS["dashboard"], "dashboard"):
                with contextlib.suppress(Exception):
                    self.server.remove_service_proxy(ns, svc, port)

    # -- reconcile ------------------------------------------------------------------------------

    def reconcile(self, key: Key) -> float | None:
        plural, ns, name = key
        if plural == "rayclusters":
            return self._reconcile_cluster(ns, name)
        return self._reconcile_job(ns, name)

    # RayCluster

    def _reconcile_cluster(self, ns: str, name: str) -> float | None:
        rc = self._get("rayclusters", ns, name)
        if rc is None or rc["metadata"].get("deletionTimestamp"):
            self._unproxy(ns, f"{name}-head-svc")
            return None  # pods and service go with it (ownerReferences)
        spec = rc.get("spec") or {}
        svc = self._ensure_head_service(rc)
        if self.node is None and (ns, svc["metadata"]["name"]) not in self._proxied:
            for port in (DEFAULT_PORTS["dashboard"], "dashboard"):
                self.server.set_service_proxy(
                    ns,
                    svc["metadata"]["name"],
                    port,
                    self.fake_ray.handle if self.fake_ray else self.ray_dashboard_url,
                )
            self._proxied.add((ns, svc["metadata"]["name"]))

        pods = live(self._pods.pods(ns, name))
        suspended = bool(spec.get("suspend"))
        again: float | None = None
        if suspended:
            for pod in pods:
                self._delete_pod(pod)
            pods = []
        else:
            pods = self._scale(rc, pods)
            again = self._start_pods(pods, self.head_ready_delay_s)

        head = next(
            (p for p in pods if p["metadata"]["labels"].get("ray.io/node-type") == "head"), None
        )
        if head is not None and (ns, head["metadata"]["name"]) not in self._logged_pods:
            logs = lambda: self._cluster_logs(ns, name)  # noqa: E731
            if self.node:
                self.node.set_log(ns, head["metadata"]["name"], logs, None)
            else:
                self.server.set_pod_log(ns, head["metadata"]["name"], logs)
            self._logged_pods.add((ns, head["metadata"]["name"]))
        self._write_cluster_status(rc, pods, head, svc, suspended)
        return again

    def _ensure_head_service(self, rc: Obj) -> Obj:
        ns, name = rc["metadata"]["namespace"], rc["metadata"]["name"]
        head_spec = rc["spec"]["headGroupSpec"]
        svc_name = ((head_spec.get("headService") or {}).get("metadata") or {}).get("name") or (
            f"{name}-head-svc"
        )
        existing = self._read_service(ns, svc_name)
        if existing is not None:
            return existing
        containers = (head_spec.get("template", {}).get("spec") or {}).get("containers") or [{}]
        ports = {
            p["name"]: p["containerPort"] for p in containers[0].get("ports") or [] if p.get("name")
        }
        ports = ports or dict(DEFAULT_PORTS)
        ports.setdefault("dashboard", DEFAULT_PORTS["dashboard"])
        labels = {
            "ray.io/cluster": name,
            "ray.io/node-type": "head",
            "ray.io/identifier": f"{name}-head",
            "app.kubernetes.io/name": "kuberay",
            "app.kubernetes.io/created-by": "kuberay-operator",
        }
        body = {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {
                "name": svc_name,
                "namespace": ns,
                "labels": labels,
                "annotations": rc["spec"].get("headServiceAnnotations") or {},
                "ownerReferences": [owner_reference(rc)],
            },
            "spec": {
                # KubeRay makes the head service headless unless told otherwise.
                "clusterIP": "None",
                "publishNotReadyAddresses": True,
                "type": head_spec.get("serviceType") or "ClusterIP",
                "selector": dict(labels),
                "ports": [
                    {"name": n, "port": p, "targetPort": p, "protocol": "TCP", "appProtocol": "tcp"}
                    for n, p in sorted(ports.items())
                ],
            },
        }
        try:
            self._core.create_namespaced_service(ns, body, field_validation=STRICT)
        except ApiException as exc:
            if exc.status != 409:
                raise
        return self._read_service(ns, svc_name) or body

    def _read_service(self, ns: str, name: str) -> Obj | None:
        try:
            return json.loads(
                self._core.read_namespaced_service(name, ns, _preload_content=False).data
            )
        except ApiException as exc:
            if is_not_found(exc):
                return None
            raise

    def _scale(self, rc: Obj, pods: list[Obj]) -> list[Obj]:
        """Create missing head/worker pods and delete surplus ones; returns the pods now."""
        name = rc["metadata"]["name"]
        spec = rc["spec"]
        groups = [("head", "headgroup", spec["headGroupSpec"], 1)] + [
            ("worker", g["groupName"], g, _desired_workers(g))
            for g in spec.get("workerGroupSpecs") or []
        ]
        result = []
        for node_type, group_name, group, want in groups:
            mine = [
                p
                for p in pods
                if p["metadata"]["labels"].get("ray.io/node-type") == node_type
                and p["metadata"]["labels"].get("ray.io/group") == group_name
            ]
            for pod in mine[want:]:
                self._delete_pod(pod)
            result += mine[:want]
            prefix = f"{name}-head-" if node_type == "head" else f"{name}-{group_name}-worker-"
            for _ in range(want - len(mine)):
                result.append(self._create_pod(rc, node_type, group_name, group, prefix.lower()))
        return result

    def _create_pod(self, rc: Obj, node_type: str, group_name: str, group: Obj, prefix: str) -> Obj:
        ns, name = rc["metadata"]["namespace"], rc["metadata"]["name"]
        template = group.get("template") or {}
        meta = template.get("metadata") or {}
        extra = {**(meta.get("labels") or {}), **(group.get("labels") or {})}
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "generateName": prefix,
                "namespace": ns,
                "labels": _pod_labels(name, node_type, group_name, extra),
                "annotations": meta.get("annotations") or {},
                "ownerReferences": [owner_reference(rc)],
            },
            # the CRD keeps `nvidia.com/gpu: 8` an integer; the operator's typed Pod says "8"
            "spec": quantities_as_strings(copy.deepcopy(template.get("spec") or {}))
            or {"containers": [{"name": "ray", "image": "ray"}]},
        }
        if self.node:
            body["spec"] = {**body["spec"], "nodeName": self.node.name}  # bound: no scheduler
        created = self._core.create_namespaced_pod(
            ns, body, field_validation=STRICT, _preload_content=False
        )
        pod = json.loads(created.data)
        self._created[(ns, pod["metadata"]["name"])] = time.monotonic()
        self._pods.seen(None, pod)
        return pod

    def _delete_pod(self, pod: Obj) -> None:
        meta = pod["metadata"]
        self._created.pop((meta["namespace"], meta["name"]), None)
        self._pods.deleting(pod)
        with contextlib.suppress(ApiException):
            self._core.delete_namespaced_pod(meta["name"], meta["namespace"])

    def _start_pods(self, pods: list[Obj], delay_s: float, ready: bool = True) -> float | None:
        """Mark pods Running (and Ready) once delay_s passed since we created them."""
        again = None
        for pod in pods:
            if pod_is_running(pod) and (pod_is_ready(pod) or not ready):
                continue
            key = (pod["metadata"]["namespace"], pod["metadata"]["name"])
            left = self._created.get(key, 0.0) + delay_s - time.monotonic()
            if left > 0:
                again = left if again is None else min(again, left)
                continue
            ip = (pod.get("status") or {}).get("podIP") or (
                self.node.address(pod) if self.node else self._ips.take()
            )
            status = running_pod_status(pod, ip, ready=ready)
            set_pod_status(self._core, pod, status)
            pod["status"] = status
            self._pods.seen(None, pod)
            if self.node and pod["metadata"]["labels"].get("ray.io/node-type") == "head":
                self.node.serve(pod, DEFAULT_PORTS["dashboard"], self._dashboard)
        return again

    def _dashboard(self, method: str, path: str, headers: Any, body: bytes) -> Any:
        """The head pod's dashboard port (real API server): the FakeRay, or the real Ray."""
        if self.fake_ray is not None:
            return self.fake_ray.handle(method, path, headers, body)
        try:
            upstream = requests.request(
                method, self.ray_dashboard_url + path, data=body, allow_redirects=False,
                headers={k: v for k, v in dict(headers).items() if k.lower() not in _HOP_HEADERS},
                timeout=60,
            )  # fmt: skip
        except requests.RequestException as exc:
            return 502, {}, f"the simulated head cannot reach Ray: {exc}".encode()
        out = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_HEADERS}
        return upstream.status_code, out, upstream.content

    def _write_cluster_status(
        self, rc: Obj, pods: list[Obj], head: Obj | None, svc: Obj, suspended: bool
    ) -> None:
        old = rc.get("status") or {}
        spec = rc["spec"]
        groups = spec.get("workerGroupSpecs") or []
        desired = sum(_desired_workers(g) for g in groups)
        workers = [p for p in pods if p["metadata"]["labels"].get("ray.io/node-type") == "worker"]
        status: Obj = {
            "observedGeneration": rc["metadata"].get("generation", 1),
            "desiredWorkerReplicas": desired,
            "readyWorkerReplicas": sum(pod_is_ready(p) for p in workers),
            "availableWorkerReplicas": sum(pod_is_running(p) for p in workers),
            "minWorkerReplicas": sum(
                (g.get("minReplicas") or 0) * (g.get("numOfHosts") or 1) for g in groups
            ),
            "maxWorkerReplicas": sum(
                g.get("maxReplicas", 0) * (g.get("numOfHosts") or 1) for g in groups
            ),
        }
        state = old.get("state")
        all_ready = bool(pods) and all(pod_is_ready(p) for p in pods)
        if len(pods) == desired + 1 and all_ready:
            state = "ready"
        if suspended and not pods:
            state = "suspended"
        if state:
            status["state"] = state
        conditions = list(old.get("conditions") or [])
        if head is None:
            conditions = set_condition(
                conditions, "HeadPodReady", "False", "HeadPodNotFound", "Head Pod not found"
            )
        elif pod_is_ready(head):
            conditions = set_condition(conditions, "HeadPodReady", "True", "HeadPodRunningAndReady")
        else:
            conditions = set_condition(conditions, "HeadPodReady", "False", "Unknown")
        provisioned = any(
            c["type"] == "RayClusterProvisioned" and c["status"] == "True" for c in conditions
        )
        if not provisioned and not (suspended and not pods):
            conditions = (
                set_condition(
                    conditions,
                    "RayClusterProvisioned",
                    "True",
                    "AllPodRunningAndReadyFirstTime",
                    "All Ray Pods are ready for the first time",
                )
                if all_ready and len(pods) == desired + 1
                else set_condition(
                    conditions,
                    "RayClusterProvisioned",
                    "False",
                    "RayClusterPodsProvisioning",
                    "RayCluster Pods are being provisioned for first time",
                )
            )
        if suspended:
            done = not pods
            conditions = set_condition(
                conditions,
                "RayClusterSuspending",
                "False" if done else "True",
                "RayClusterSuspending",
            )
            conditions = set_condition(
                conditions,
                "RayClusterSuspended",
                "True" if done else "False",
                "RayClusterSuspended",
            )
            if done:
                conditions = set_condition(
                    conditions,
                    "RayClusterProvisioned",
                    "False",
                    "RayClusterPodsProvisioning",
                    "RayCluster has been suspended",
                )
        else:
            conditions = set_condition(
                conditions, "RayClusterSuspending", "False", "RayClusterSuspending"
            )
            conditions = set_condition(
                conditions, "RayClusterSuspended", "False", "RayClusterSuspended"
            )
        status["conditions"] = conditions
        status["endpoints"] = {
            p["name"]: str(p.get("targetPort") or p["port"])
            for p in svc["spec"].get("ports") or []
            if p.get("name")
        }
        head_ip = ((head or {}).get("status") or {}).get("podIP", "")
        status["head"] = {
            "podIP": head_ip,
            "podName": head["metadata"]["name"] if head else "",
            # A headless service has no IP: KubeRay reports the head pod's.
            "serviceIP": head_ip
            if svc["spec"].get("clusterIP") in (None, "None")
            else svc["spec"]["clusterIP"],
            "serviceName": svc["metadata"]["name"],
        }
        comparable = {
            k: v for k, v in old.items() if k not in ("lastUpdateTime", "stateTransitionTimes")
        }
        if comparable == status:
            return  # writing only on change keeps our own watch from looping
        now = now_rfc3339()
        status["lastUpdateTime"] = now
        times = dict(old.get("stateTransitionTimes") or {})
        if state and state != old.get("state"):
            times[state] = now
        if times:
            status["stateTransitionTimes"] = times
        self._patch_status("rayclusters", rc, status)

    # RayJob

    def _reconcile_job(self, ns: str, name: str) -> float | None:
        key: Key = ("rayjobs", ns, name)
        rj = self._get("rayjobs", ns, name)
        if rj is None:
            self._forget_job(key, stop=True)
            return None
        meta, spec = rj["metadata"], rj.get("spec") or {}
        status = dict(rj.get("status") or {})
        if meta.get("deletionTimestamp"):
            if status.get("jobStatus") not in TERMINAL_JOB:
                self._stop_ray_job(status.get("jobId", ""))
            self._forget_job(key, stop=False)
            if FINALIZER in (meta.get("finalizers") or []):
                self._patch_meta(
                    rj, {"finalizers": [f for f in meta["finalizers"] if f != FINALIZER]}
                )
            return None
        if spec.get("managedBy") not in (None, "", "ray.io/kuberay-operator"):
            return None
        try:
            validate_rayjob(rj)
        except _Invalid as exc:
            if status.get("jobDeploymentStatus") != "ValidationFailed":
                self._patch_status(
                    "rayjobs",
                    rj,
                    {
                        "jobDeploymentStatus": "ValidationFailed",
                        "reason": "ValidationFailed",
                        "message": str(exc),
                    },
                )
            return None

        phase = status.get("jobDeploymentStatus") or ""
        new = dict(status)
        again: float | None = REQUEUE_S
        if phase == "":
            if FINALIZER not in (meta.get("finalizers") or []):
                self._patch_meta(rj, {"finalizers": [*(meta.get("finalizers") or []), FINALIZER]})
            mode = spec.get("submissionMode") or "K8sJobMode"
            if mode != "InteractiveMode" and not new.get("jobId"):
                new["jobId"] = spec.get("jobId") or f"{name}-{rand_suffix()}"
            if not new.get("rayClusterName"):
                selected = (spec.get("clusterSelector") or {}).get(CLUSTER_SELECTOR_KEY)
                new["rayClusterName"] = selected or f"{name}-{rand_suffix()}"
            new["jobDeploymentStatus"] = "Initializing"
            new["startTime"] = now_rfc3339()
            again = 0.0
        elif phase in ("Initializing", "Running") and spec.get("suspend"):
            new["jobDeploymentStatus"] = "Suspending"
            again = 0.0
        elif phase in ("Initializing", "Running") and self._deadline_passed(spec, status):
            self._stop_ray_job(status.get("jobId", ""))
            new.update(
                jobDeploymentStatus="Failed",
                reason="DeadlineExceeded",
                message=(
                    "The RayJob has passed the activeDeadlineSeconds. StartTime: "
                    f"{status.get('startTime')}. ActiveDeadlineSeconds: "
                    f"{spec['activeDeadlineSeconds']}"
                ),
            )
        elif phase == "Initializing":
            again = self._initializing(rj, new)
        elif phase == "Waiting":
            if spec.get("jobId"):
                new.update(jobId=spec["jobId"], jobDeploymentStatus="Running")
        elif phase == "Running":
            again = self._running(rj, new)
        elif phase == "Suspending":
            again = self._suspending(rj, new)
        elif phase == "Suspended":
            if not spec.get("suspend"):
                new.update(jobStatus=None, jobDeploymentStatus=None)
                again = 0.0
            else:
                again = None
        elif phase in TERMINAL_DEPLOYMENT:
            self._forget_job(key, stop=False)
            again = self._finished(rj)

        if phase in ("Initializing", "Running") and new.get("jobDeploymentStatus") == phase:
            deadline = self._deadline_left(spec, status)
            if deadline is not None and (again is None or deadline < again):
                again = max(deadline, 0.0)
        self._write_job_status(rj, status, new)
        return again

    def _deadline_left(self, spec: Obj, status: Obj) -> float | None:
        started = parse_rfc3339(status.get("startTime"))
        if spec.get("activeDeadlineSeconds") is None or started is None:
            return None
        return started + spec["activeDeadlineSeconds"] - time.time()

    def _deadline_passed(self, spec: Obj, status: Obj) -> bool:
        left = self._deadline_left(spec, status)
        return left is not None and left <= 0

    def _initializing(self, rj: Obj, new: Obj) -> float | None:
        ns = rj["metadata"]["namespace"]
        spec = rj["spec"]
        cluster_name = new["rayClusterName"]
        rc = self._get("rayclusters", ns, cluster_name)
        if rc is None:
            if spec.get("clusterSelector"):
                return REQUEUE_S  # KubeRay waits for a selected cluster to appear
            rc = self._create_cluster(rj, cluster_name)
        rc_status = rc.get("status") or {}
        if rc_status.get("state") != "ready":
            new["rayClusterStatus"] = rc_status
            return None  # the cluster's own changes wake us
        new["rayClusterStatus"] = rc_status
        svc = rc_status.get("head", {}).get("serviceName") or f"{cluster_name}-head-svc"
        new["dashboardURL"] = f"{svc}.{ns}.svc.cluster.local:{DEFAULT_PORTS['dashboard']}"
        mode = spec.get("submissionMode") or "K8sJobMode"
        if mode == "InteractiveMode":
            new["jobDeploymentStatus"] = "Waiting"
            return 0.0
        error = self._submit(rj, new["jobId"], (ns, cluster_name), rc)
        if error is not None:
            new.update(jobDeploymentStatus="Failed", reason="SubmissionFailed", message=error)
            return 0.0
        new["jobDeploymentStatus"] = "Running"
        return 0.0

    def _create_cluster(self, rj: Obj, cluster_name: str) -> Obj:
        ns, spec = rj["metadata"]["namespace"], rj["spec"]
        labels = dict(rj["metadata"].get("labels") or {})
        labels.update(
            {
                "ray.io/originated-from-cr-name": rj["metadata"]["name"],
                "ray.io/originated-from-crd": "RayJob",
                "ray.io/job-submission-mode": spec.get("submissionMode") or "K8sJobMode",
            }
        )
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "RayCluster",
            "metadata": {
                "name": cluster_name,
                "namespace": ns,
                "labels": labels,
                "annotations": dict(rj["metadata"].get("annotations") or {}),
                "ownerReferences": [owner_reference(rj)],
            },
            "spec": spec["rayClusterSpec"],
        }
        try:
            return self._custom.create_namespaced_custom_object(
                GROUP, VERSION, ns, "rayclusters", body, field_validation=STRICT
            )
        except ApiException as exc:
            if exc.status != 409:
                raise
            return self._get("rayclusters", ns, cluster_name) or body

    def _submit(
        self, rj: Obj, job_id: str, cluster: tuple[str, str], rc: Obj | None = None
    ) -> str | None:
        """Submit the entrypoint as Ray job job_id, or attach if it exists; an error text if
        the submitter would have failed. K8sJobMode: the submitterPodTemplate's init
        containers run first, and its local working_dir is what Ray's client uploads."""
        key: Key = ("rayjobs", rj["metadata"]["namespace"], rj["metadata"]["name"])
        spec = rj["spec"]
        try:
            self.ray.get_job_info(job_id)
            self._watch_job(job_id, key, cluster)  # already there (we restarted): attach
            return None
        except RuntimeError as exc:
            if "404" not in str(exc) and "does not exist" not in str(exc):
                raise
        entrypoint = (spec.get("entrypoint") or "").strip()
        if not entrypoint:
            # The K8sJobMode submitter runs `ray job submit -- <entrypoint>`, which fails.
            return "Failed to submit the Ray job: the entrypoint is empty"
        runtime_env = yaml.safe_load(spec.get("runtimeEnvYAML") or "") or None
        template = spec.get("submitterPodTemplate")
        pod_root = self.workdir / "submitters" / cluster[0] / job_id
        if template and (spec.get("submissionMode") or "K8sJobMode") == "K8sJobMode":
            try:
                mapper = run_submitter_pod(self._core, cluster[0], template, pod_root,
                                           pvc_root=self.workdir / "pvcs")  # fmt: skip
            except SubmitterFailed as exc:
                shutil.rmtree(pod_root, ignore_errors=True)
                return str(exc)
            runtime_env = map_runtime_env(runtime_env, mapper)
        if self.fake_ray is None:
            entrypoint = with_head_env(self._core, cluster[0], rc, entrypoint,
                                       self._head_env_file(*cluster))  # fmt: skip
        kwargs: dict[str, Any] = {
            "entrypoint": entrypoint,
            "submission_id": job_id,
            "runtime_env": runtime_env,
            "metadata": spec.get("metadata") or None,
        }
        if spec.get("entrypointNumCpus"):
            kwargs["entrypoint_num_cpus"] = spec["entrypointNumCpus"]
        if spec.get("entrypointNumGpus"):
            kwargs["entrypoint_num_gpus"] = spec["entrypointNumGpus"]
        if spec.get("entrypointResources"):
            kwargs["entrypoint_resources"] = json.loads(spec["entrypointResources"])
        try:
            self.ray.submit_job(**kwargs)
        except RuntimeError as exc:
            text = str(exc)
            if "already exists" not in text:
                if "status code 4" in text:
                    return f"Failed to submit the Ray job: {text.splitlines()[0][:500]}"
                raise  # Ray unreachable or erroring: retry like the submitter's backoff
        finally:  # uploaded (or to be unpacked again by the next try, as a new pod would)
            shutil.rmtree(pod_root, ignore_errors=True)
        self._watch_job(job_id, key, cluster)
        return None

    def _running(self, rj: Obj, new: Obj) -> float | None:
        ns = rj["metadata"]["namespace"]
        job_id = new.get("jobId", "")
        key: Key = ("rayjobs", ns, rj["metadata"]["name"])
        cluster = (ns, new.get("rayClusterName", ""))
        if job_id not in self._live_jobs:
            self._watch_job(job_id, key, cluster)  # after a restart of the simulator
        rc = self._get("rayclusters", ns, new.get("rayClusterName", ""))
        if rc is not None:
            new["rayClusterStatus"] = rc.get("status") or {}
        info = self._job(job_id)
        if info is None:
            return REQUEUE_S  # not in the poller's snapshot yet
        state = info.status.value if isinstance(info.status, JobStatus) else str(info.status)
        deployment, reason = "Running", None
        if state in TERMINAL_JOB:
            deployment = "Failed" if state == "FAILED" else "Complete"
            reason = "AppFailed" if state == "FAILED" else None
            with self._state_lock:
                self._live_jobs.pop(job_id, None)
        new.update(
            jobStatus=state,
            jobDeploymentStatus=deployment,
            reason=reason,
            message=info.message or None,
        )
        times = {}
        if info.start_time:
            times["startTime"] = _ms_rfc3339(info.start_time)
        if info.end_time:
            times["endTime"] = _ms_rfc3339(info.end_time)
        if times:
            new["rayJobInfo"] = times
        return REQUEUE_S if deployment == "Running" else 0.0

    def _suspending(self, rj: Obj, new: Obj) -> float | None:
        ns, spec = rj["metadata"]["namespace"], rj["spec"]
        self._stop_ray_job(new.get("jobId", ""))
        if not spec.get("clusterSelector"):
            rc = self._get("rayclusters", ns, new.get("rayClusterName", ""))
            if rc is not None:
                if not rc["metadata"].get("deletionTimestamp"):
                    self._delete_cluster(ns, rc["metadata"]["name"])
                return 0.5  # wait until it is gone, as KubeRay does
        self._forget_job(("rayjobs", ns, rj["metadata"]["name"]), stop=False)
        for field in (
            "rayClusterStatus",
            "rayClusterName",
            "dashboardURL",
            "jobId",
            "message",
            "reason",
            "rayJobInfo",
            "jobStatus",
        ):
            new[field] = None
        new["jobDeploymentStatus"] = "Suspended"
        return None

    def _finished(self, rj: Obj) -> float | None:
        spec, status = rj["spec"], rj.get("status") or {}
        if spec.get("clusterSelector") or not spec.get("shutdownAfterJobFinishes"):
            return None
        ended = parse_rfc3339(status.get("endTime"))
        if ended is None:
            return 0.5
        left = ended + (spec.get("ttlSecondsAfterFinished") or 0) - time.time()
        if left > 0:
            return left
        ns = rj["metadata"]["namespace"]
        if self._get("rayclusters", ns, status.get("rayClusterName", "")) is not None:
            self._delete_cluster(ns, status["rayClusterName"])
        return None

    def _write_job_status(self, rj: Obj, old: Obj, new: Obj) -> None:
        new = {k: v for k, v in new.items() if v is not None or k in old}
        terminal_now = new.get("jobDeploymentStatus") in TERMINAL_DEPLOYMENT
        if terminal_now and old.get("jobDeploymentStatus") not in TERMINAL_DEPLOYMENT:
            new["endTime"] = now_rfc3339()
        changed = {k: v for k, v in new.items() if old.get(k) != v}
        if changed:
            new_obs = rj["metadata"].get("generation")
            if new_obs is not None:
                changed["observedGeneration"] = new_obs
            self._patch_status("rayjobs", rj, changed)

    def _forget_job(self, key: Key, *, stop: bool) -> None:
        with self._state_lock:
            ids = [j for j, k in self._live_jobs.items() if k == key]
            for job_id in ids:
                self._live_jobs.pop(job_id, None)
        if stop:
            for job_id in ids:
                self._stop_ray_job(job_id)

    # -- API helpers ----------------------------------------------------------------------------

    def _get(self, plural: str, ns: str, name: str) -> Obj | None:
        """A fresh read (the cache may lag behind our own writes)."""
        if not name:
            return None
        try:
            return self._custom.get_namespaced_custom_object(GROUP, VERSION, ns, plural, name)
        except ApiException as exc:
            if is_not_found(exc):
                return None
            raise

    def _patch_status(self, plural: str, obj: Obj, status: Obj) -> None:
        meta = obj["metadata"]
        try:
            self._custom.patch_namespaced_custom_object_status(
                GROUP, VERSION, meta["namespace"], plural, meta["name"], {"status": status},
                field_validation=STRICT,
            )  # fmt: skip
        except ApiException as exc:
            if not is_not_found(exc):
                raise

    def _patch_meta(self, obj: Obj, meta: Obj) -> None:
        m = obj["metadata"]
        try:
            self._custom.patch_namespaced_custom_object(
                GROUP,
                VERSION,
                m["namespace"],
                obj["kind"].lower() + "s",
                m["name"],
                {"metadata": meta},
                field_validation=STRICT,
            )
        except ApiException as exc:
            if not is_not_found(exc):
                raise

    def _delete_cluster(self, ns: str, name: str) -> None:
        with contextlib.suppress(ApiException):
            self._custom.delete_namespaced_custom_object(
                GROUP, VERSION, ns, "rayclusters", name, propagation_policy="Background"
            )


def _ms_rfc3339(ms: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ms / 1000))
