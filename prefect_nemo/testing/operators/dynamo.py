"""An NVIDIA Dynamo operator simulator for DynamoGraphDeployments (nvidia.com).

Per DGD it creates the component Pods (labelled as the real operator labels them) and the
frontend Service, makes the Pods Ready after a delay and sets `status.state` / the Ready
condition. The frontend answers through the API server's service proxy like a Dynamo frontend
(`/health`, `/v1/models`), or fails the way `configure()` asks (404, 503, 502, refused).

On the loopback server the frontend is a handler registered with its service proxy; on a real
API server (no `set_service_proxy`) the simulator acts as the kubelet of a Node of its own
(`_node.SimNode`): its pods are bound to it, each running pod gets an address of a `PodNetwork`
as its podIP, and the frontend pods listen there, so the real EndpointSlice controller and the
real service proxy route to them; a deleted pod's deletion is finished by the simulator.
"""

from __future__ import annotations

import copy
import json
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from kubernetes import client
from kubernetes.client.rest import ApiException

from prefect_nemo.testing.operators._controller import (
    PODS,
    STRICT,
    Controller,
    Key,
    Kind,
    Obj,
    PodIPs,
    is_not_found,
    live,
    owner_reference,
    pod_is_ready,
    pod_is_running,
    quantities_as_strings,
    running_pod_status,
    set_condition,
    set_pod_status,
)
from prefect_nemo.testing.operators._node import SimNode

GROUP = "nvidia.com"
PLURAL = "dynamographdeployments"
DGD_LABEL = "nvidia.com/dynamo-graph-deployment-name"
COMPONENT_LABEL = "nvidia.com/dynamo-component"
COMPONENT_TYPE_LABEL = "nvidia.com/dynamo-component-type"
NAMESPACE_LABEL = "nvidia.com/dynamo-namespace"
SELECTOR_LABEL = "nvidia.com/selector"
FRONTEND_PORT = 8000
SIM_NODE = "prefect-nemo-dynamo-sim"  # the Node the simulator's pods run on (real API server)

Frontend = Literal["ok", "404", "503", "502", "refused"]


@dataclass(frozen=True)
class DgdBehavior:
    """How the simulated operator treats one DGD."""

    fail: bool = False
    fail_message: str = "simulated failure: a component could not be deployed"
    pods_ready: bool = True
    frontend: Frontend = "ok"
    start_delay_s: float | None = None  # None: the simulator's start_delay_s
    models: tuple[str, ...] = field(default=())  # empty: one model named after the DGD
    unschedulable: str = ""  # set: the pods stay Pending, Unschedulable with this message


def components(dgd: Obj) -> list[tuple[str, str, int]]:
    """(name, componentType, replicas) of each component: v1alpha1 `spec.services` (a map) or
    v1beta1 `spec.components` (a list with `name`)."""
    spec = dgd.get("spec") or {}
    if isinstance(spec.get("services"), dict):
        items = list(spec["services"].items())
    else:
        items = [(c.get("name", ""), c) for c in spec.get("components") or []]
    return [
        (name, (svc or {}).get("componentType") or "", (svc or {}).get("replicas", 1) or 0)
        for name, svc in items
        if name
    ]


def frontend_port(dgd: Obj, comp: str) -> int:
    """Where a frontend component listens: "dynamo.frontend accepts either --http-port flag or
    DYN_HTTP_PORT env var (defaults to 8000)" (Dynamo's launch scripts)."""
    spec = dgd.get("spec") or {}
    if isinstance(spec.get("services"), dict):
        svc = spec["services"].get(comp) or {}
        main = (svc.get("extraPodSpec") or {}).get("mainContainer") or {}
    else:
        svc = next((c for c in spec.get("components") or [] if c.get("name") == comp), {})
        pod = (svc.get("podTemplate") or {}).get("spec") or {}
        main = next((c for c in pod.get("containers") or [] if c.get("name") == "main"), {})
    args = [str(a) for a in [*(main.get("command") or []), *(main.get("args") or [])]]
    for i, arg in enumerate(args[:-1]):
        if arg == "--http-port":
            return int(args[i + 1])
    for env in (main.get("env"), svc.get("envs"), spec.get("envs")):
        for item in env or []:
            if item.get("name") == "DYN_HTTP_PORT":
                return int(item["value"])
    return FRONTEND_PORT


def _closed_port() -> int:
    """A local port nothing listens on (a proxy to it is refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class DynamoSimulator(Controller):
    """Acts like the Dynamo operator against a LoopbackKubeServer or a real API server."""

    def __init__(
        self,
        server: Any,
        *,
        namespace: str | None = None,
        version: str = "v1alpha1",
        start_delay_s: float = 0.3,
    ) -> None:
        super().__init__(server.api_client(), namespace=namespace, name="dynamo-sim")
        self.server = server
        self.version = version
        self.start_delay_s = start_delay_s
        self._kind = Kind(GROUP, version, PLURAL)
        self._core = client.CoreV1Api(self.api_client)
        self._custom = client.CustomObjectsApi(self.api_client)
        self._ips = PodIPs(subnet=2)
        # a real API server routes its service proxy to pod addresses: be their kubelet
        self.node = None if hasattr(server, "set_service_proxy") else SimNode(self._core, SIM_NODE)
        self._default = DgdBehavior()
        self._behaviors: dict[str, DgdBehavior] = {}
        self._seen: dict[tuple[str, str], tuple[str, float]] = {}  # DGD → (uid, first seen)
        self._proxied: dict[tuple[str, str], list[tuple[str, int | str]]] = {}
        self._lock = threading.Lock()
        self.watch(self._kind)
        self.watch(
            PODS,
            label_selector=DGD_LABEL,
            map_to=lambda pod: [
                (PLURAL, pod["metadata"]["namespace"], pod["metadata"]["labels"][DGD_LABEL])
            ],
        )

    # -- knobs ----------------------------------------------------------------------------------

    def configure(
        self,
        dgd_name: str | None,
        *,
        fail: bool = False,
        fail_message: str = DgdBehavior.fail_message,
        pods_ready: bool = True,
        frontend: Frontend = "ok",
        start_delay_s: float | None = None,
        models: Sequence[str] = (),
        unschedulable: str = "",
    ) -> None:
        """Set how the DGD named dgd_name (in any namespace) behaves, or with None every DGD
        not configured by name; applies at once. `unschedulable` holds its pods Pending as the
        scheduler leaves pods that fit no node (PodScheduled False, reason Unschedulable, this
        message, e.g. "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.")."""
        self._set(
            dgd_name,
            DgdBehavior(
                fail, fail_message, pods_ready, frontend, start_delay_s, tuple(models),
                unschedulable,
            ),
        )  # fmt: skip

    def _set(self, name: str | None, behavior: DgdBehavior) -> None:
        with self._lock:
            if name is None:
                self._default = behavior
            else:
                self._behaviors[name] = behavior
        for dgd in self.cached_all(PLURAL):
            meta = dgd["metadata"]
            if name is None or meta["name"] == name:
                self._unproxy(meta["namespace"], meta["name"])  # re-registered per the new knob
                for pod in self.cached_all(PODS.plural) if self.node else []:
                    if pod["metadata"]["labels"].get(DGD_LABEL) == meta["name"]:
                        self.node.unserve(pod)  # listens again (or not: refused) per the knob
                self.enqueue((PLURAL, meta["namespace"], meta["name"]))

    def behavior(self, dgd_name: str) -> DgdBehavior:
        """The behaviour that applies to dgd_name."""
        with self._lock:
            chosen = self._behaviors.get(dgd_name, self._default)
        if chosen.start_delay_s is None:
            chosen = replace(chosen, start_delay_s=self.start_delay_s)
        return chosen

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> DynamoSimulator:  # type: ignore[override]
        """Start watching and reconciling; returns self."""
        if self.node:
            self.node.register()
        super().start()
        return self

    def stop(self) -> None:
        """Stop the threads and remove the service proxies registered (or the frontends'
        listeners and pod addresses)."""
        super().stop()
        for ns, name in list(self._proxied):
            self._unproxy(ns, name)
        if self.node:
            self.node.close()

    def on_event(self, kind: Kind, old: Obj | None, new: Obj | None) -> None:
        """As the kubelet of our Node: a pod asked to go is stopped and deleted for good."""
        if self.node is None or kind != PODS:
            return
        if new is None and old is not None:
            self.node.forget(old["metadata"]["namespace"], old["metadata"]["name"])
        elif new is not None and new["metadata"].get("deletionTimestamp"):
            if (new.get("spec") or {}).get("nodeName") == self.node.name:
                self.node.finish_deletion(new)

    def __enter__(self) -> DynamoSimulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- reconcile ------------------------------------------------------------------------------

    def reconcile(self, key: Key) -> float | None:
        _, ns, name = key
        dgd = self._get(ns, name)
        if dgd is None or dgd["metadata"].get("deletionTimestamp"):
            self._unproxy(ns, name)  # pods and services go with it (ownerReferences)
            self._seen.pop((ns, name), None)
            return None
        uid = dgd["metadata"]["uid"]
        if self._seen.get((ns, name), ("",))[0] != uid:
            self._seen[(ns, name)] = (uid, time.monotonic())
        behavior = self.behavior(name)
        delay = behavior.start_delay_s or 0.0
        left = self._seen[(ns, name)][1] + delay - time.monotonic()

        pods = live(self._list_pods(ns, f"{DGD_LABEL}={name}"))
        wanted = components(dgd)
        for comp, comp_type, replicas in wanted:
            mine = [p for p in pods if p["metadata"]["labels"].get(COMPONENT_LABEL) == comp]
            for pod in mine[replicas:]:
                self._delete(pod)
            for _ in range(replicas - len(mine)):
                pods.append(self._create_pod(dgd, comp, comp_type))
            if comp_type == "frontend":
                self._ensure_frontend(dgd, comp, behavior)
        names = {c for c, _, _ in wanted}
        for pod in [p for p in pods if p["metadata"]["labels"].get(COMPONENT_LABEL) not in names]:
            self._delete(pod)
            pods.remove(pod)

        if left <= 0 and behavior.unschedulable:
            for pod in pods:
                status = unschedulable_pod_status(behavior.unschedulable)
                if (pod.get("status") or {}).get("conditions") != status["conditions"]:
                    set_pod_status(self._core, pod, status)
                    pod["status"] = status
        elif left <= 0:
            for pod in pods:
                if not pod_is_running(pod) or pod_is_ready(pod) != behavior.pods_ready:
                    ip = (pod.get("status") or {}).get("podIP") or self._pod_ip(pod)
                    status = running_pod_status(pod, ip, ready=behavior.pods_ready)
                    set_pod_status(self._core, pod, status)
                    pod["status"] = status
                self._listen(dgd, pod, behavior)
        self._write_status(dgd, pods, behavior, started=left <= 0)
        return left if left > 0 else None

    def _pod_ip(self, pod: Obj) -> str:
        return self.node.address(pod) if self.node else self._ips.take()

    def _listen(self, dgd: Obj, pod: Obj, behavior: DgdBehavior) -> None:
        """On a real API server: a running frontend pod answers on its own address."""
        labels = pod["metadata"]["labels"]
        if self.node is None or labels.get(COMPONENT_TYPE_LABEL) != "frontend":
            return
        if behavior.frontend == "refused":
            self.node.unserve(pod)
            return
        name = dgd["metadata"]["name"]
        port = frontend_port(dgd, labels[COMPONENT_LABEL])

        def handler(method: str, path: str, headers: Any, body: bytes) -> Any:
            now = self.behavior(name)  # the knob as it is now
            return _frontend_handler(now.frontend, list(now.models) or [name])(
                method, path, headers, body
            )

        self.node.serve(pod, port, handler)

    def _write_status(
        self, dgd: Obj, pods: list[Obj], behavior: DgdBehavior, started: bool
    ) -> None:
        old = dgd.get("status") or {}
        conditions = list(old.get("conditions") or [])
        not_ready = sorted(p["metadata"]["name"] for p in pods if not pod_is_ready(p))
        if started and behavior.fail:
            state = "failed"
            conditions = set_condition(
                conditions, "Ready", "False", "failed", behavior.fail_message
            )
        elif started and pods and not not_ready:
            state = "successful"
            conditions = set_condition(
                conditions, "Ready", "True", "all_resources_are_ready", "All resources are ready"
            )
        else:
            state = "pending"
            waiting = not_ready or ["pods"]
            conditions = set_condition(
                conditions,
                "Ready",
                "False",
                "some_resources_are_not_ready",
                f"Resources not ready: {', '.join(waiting)}",
            )
        status = {"state": state, "conditions": conditions}
        if status == {"state": old.get("state"), "conditions": old.get("conditions")}:
            return  # write only on change: our own watch would loop otherwise
        meta = dgd["metadata"]
        try:
            self._custom.patch_namespaced_custom_object_status(
                GROUP, self.version, meta["namespace"], PLURAL, meta["name"], {"status": status},
                field_validation=STRICT,
            )  # fmt: skip
        except ApiException as exc:
            if not is_not_found(exc):
                raise

    def _create_pod(self, dgd: Obj, comp: str, comp_type: str) -> Obj:
        ns, name = dgd["metadata"]["namespace"], dgd["metadata"]["name"]
        spec = dgd.get("spec") or {}
        svc = (
            (spec.get("services") or {}).get(comp)
            if isinstance(spec.get("services"), dict)
            else next((c for c in spec.get("components") or [] if c.get("name") == comp), None)
        )
        extra = (svc or {}).get("extraPodSpec") or {}
        main = copy.deepcopy(extra.get("mainContainer") or {})
        main.setdefault("image", "nvcr.io/nvidia/ai-dynamo/dynamo-runtime")
        main["name"] = "main"
        env = [
            *(spec.get("envs") or []),
            *((svc or {}).get("envs") or []),
            *(main.get("env") or []),
        ]
        if env:
            main["env"] = env
        pod_spec = {k: v for k, v in extra.items() if k != "mainContainer"}
        pod_spec["containers"] = [
            main,
            *[c for c in extra.get("containers") or [] if c.get("name") != "main"],
        ]
        quantities_as_strings(pod_spec)
        pod_spec.setdefault("serviceAccountName", f"{name}-sa")  # the operator's per-DGD SA
        if self.node:
            pod_spec["nodeName"] = self.node.name  # bound: no scheduler runs here
        selector = f"{name}-{comp.lower()}"
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "generateName": f"{selector}-",
                "namespace": ns,
                "labels": {
                    **((svc or {}).get("labels") or {}),
                    DGD_LABEL: name,
                    COMPONENT_LABEL: comp,
                    COMPONENT_TYPE_LABEL: comp_type,
                    NAMESPACE_LABEL: f"{ns}-{name}",
                    SELECTOR_LABEL: selector,
                },
                "annotations": (svc or {}).get("annotations") or {},
                "ownerReferences": [owner_reference(dgd)],
            },
            "spec": pod_spec,
        }
        created = self._core.create_namespaced_pod(
            ns, body, field_validation=STRICT, _preload_content=False
        )
        return json.loads(created.data)

    def _ensure_frontend(self, dgd: Obj, comp: str, behavior: DgdBehavior) -> None:
        ns, name = dgd["metadata"]["namespace"], dgd["metadata"]["name"]
        svc_name = f"{name}-{comp.lower()}"
        port = frontend_port(dgd, comp)
        body = {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {
                "name": svc_name,
                "namespace": ns,
                "labels": {
                    DGD_LABEL: name,
                    COMPONENT_LABEL: comp,
                    COMPONENT_TYPE_LABEL: "frontend",
                },
                "ownerReferences": [owner_reference(dgd)],
            },
            "spec": {
                "type": "ClusterIP",
                "selector": {SELECTOR_LABEL: svc_name},
                "ports": [
                    {
                        "name": "http",
                        "port": port,
                        "targetPort": port,
                        "protocol": "TCP",
                    }
                ],
            },
        }
        try:
            self._core.create_namespaced_service(ns, body, field_validation=STRICT)
        except ApiException as exc:
            if exc.status != 409:
                raise
        if self.node:
            return  # the pods listen themselves (`_listen`)
        with self._lock:
            registered = (ns, name) in self._proxied
        if registered:
            return
        target: Any
        if behavior.frontend == "refused":
            target = f"http://127.0.0.1:{_closed_port()}"
        else:
            target = _frontend_handler(behavior.frontend, list(behavior.models) or [name])
        ports: list[tuple[str, int | str]] = [(svc_name, port), (svc_name, "http")]
        for svc, port in ports:
            self.server.set_service_proxy(ns, svc, port, target)
        with self._lock:
            self._proxied[(ns, name)] = ports

    def _unproxy(self, ns: str, name: str) -> None:
        with self._lock:
            ports = self._proxied.pop((ns, name), [])
        for svc, port in ports:
            try:
                self.server.remove_service_proxy(ns, svc, port)
            except Exception:  # already gone
                pass

    # -- API helpers ----------------------------------------------------------------------------

    def _get(self, ns: str, name: str) -> Obj | None:
        try:
            return self._custom.get_namespaced_custom_object(GROUP, self.version, ns, PLURAL, name)
        except ApiException as exc:
            if is_not_found(exc):
                return None
            raise

    def _list_pods(self, ns: str, selector: str) -> list[Obj]:
        resp = self._core.list_namespaced_pod(ns, label_selector=selector, _preload_content=False)
        return json.loads(resp.data).get("items") or []

    def _delete(self, pod: Obj) -> None:
        try:
            self._core.delete_namespaced_pod(pod["metadata"]["name"], pod["metadata"]["namespace"])
        except ApiException as exc:
            if not is_not_found(exc):
                raise


def unschedulable_pod_status(message: str) -> Obj:
    """The status the scheduler leaves on a pod that fits no node."""
    condition = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                 "message": message}  # fmt: skip
    return {"phase": "Pending", "conditions": [condition]}


def _frontend_handler(mode: Frontend, models: list[str]) -> Any:
    """A handler(method, path, headers, body) that answers like a Dynamo frontend, or fails."""

    def reply(status: int, payload: Obj) -> tuple[int, dict[str, str], bytes]:
        return status, {"Content-Type": "application/json"}, json.dumps(payload).encode()

    def handler(method: str, path: str, headers: Any, body: bytes) -> tuple[int, dict, bytes]:
        path = "/" + path.split("?", 1)[0].lstrip("/")
        if mode == "503":
            return reply(503, {"error": "service unavailable: no ready workers"})
        if mode == "502":
            return reply(502, {"error": "bad gateway"})
        if mode == "404":
            return reply(404, {"error": f"no route for {path}"})
        if method == "GET" and path == "/health":
            return reply(200, {"status": "healthy", "endpoints": ["/v1/models"]})
        if method == "GET" and path == "/v1/models":
            created = int(time.time())
            return reply(
                200,
                {
                    "object": "list",
                    "data": [
                        {"id": m, "object": "model", "created": created, "owned_by": "nvidia"}
                        for m in models
                    ],
                },
            )
        return reply(404, {"error": f"no route for {path}"})

    return handler
