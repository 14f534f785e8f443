"""A tiny controller runtime: list+watch informers feeding a delayed work queue, one worker.

Like controller-runtime, but small: each watched kind keeps a cache of the latest objects; an
event enqueues the key of the object (or of the objects it maps to, e.g. a pod's owner); the
worker calls `reconcile(key)`, which may ask to run again after a delay. Watches resume from
the last resourceVersion when the stream drops and relist on 410 Gone.
"""

from __future__ import annotations

import contextlib
import heapq
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException
from kubernetes.watch.watch import iter_resp_lines

log = logging.getLogger(__name__)

Obj = dict[str, Any]
Key = tuple[str, str, str]  # (plural, namespace, name)

WATCH_TIMEOUT_S = 30  # the server ends each watch after this; we resume from the last version
# Every write of a simulator says fieldValidation=Strict: an operator writes typed objects, so a
# field it does not know is our typo, refused loudly (by default an API server drops it with
# only a Warning header).
STRICT = "Strict"


@dataclass(frozen=True)
class Kind:
    """A resource type: group "" is the core API."""

    group: str
    version: str
    plural: str


PODS = Kind("", "v1", "pods")


def now_rfc3339() -> str:
    """The current time as Kubernetes writes it (metav1.Time: seconds, UTC)."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_rfc3339(value: str | None) -> float | None:
    """Epoch seconds of a Kubernetes timestamp, or None."""
    if not value:
        return None
    return datetime.strptime(value[:19], "%Y-%m-%dT%H:%M:%S").replace(tzinfo=UTC).timestamp()


def owner_keys(obj: Obj, kind: str, plural: str) -> list[Key]:
    """Keys of obj's controlling owners of the given kind (to map child events to parents)."""
    ns = obj["metadata"].get("namespace", "")
    return [
        (plural, ns, ref["name"])
        for ref in obj["metadata"].get("ownerReferences") or []
        if ref.get("kind") == kind
    ]


def owner_reference(owner: Obj) -> Obj:
    """A controller owner reference to owner, as controllers set them (GC deletes the child)."""
    return {
        "apiVersion": owner["apiVersion"],
        "kind": owner["kind"],
        "name": owner["metadata"]["name"],
        "uid": owner["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def is_not_found(exc: BaseException) -> bool:
    return isinstance(exc, ApiException) and exc.status == 404


def is_conflict(exc: BaseException) -> bool:
    return isinstance(exc, ApiException) and exc.status == 409


def _shutdown(resp: Any) -> None:
    """End a streaming response so that a thread blocked reading it returns at once. urllib3
    >= 2.3 has `shutdown()`; 1.26 (the nemo-run set's) does not, so shut its socket down."""
    if hasattr(resp, "shutdown"):
        resp.shutdown()
    elif (sock := getattr(getattr(resp, "_connection", None), "sock", None)) is not None:
        sock.shutdown(socket.SHUT_RDWR)


class _Informer:
    """List+watch one kind in a thread; updates a cache and reports each change."""

    def __init__(
        self,
        controller: Controller,
        kind: Kind,
        label_selector: str | None,
        on_change: Callable[[Obj | None, Obj | None], None],
    ) -> None:
        self.kind = kind
        self.label_selector = label_selector
        self.cache: dict[tuple[str, str], Obj] = {}
        self._ctl = controller
        self._on_change = on_change
        self._resp: Any = None
        self._thread = threading.Thread(
            target=self._run, daemon=True, name=f"{controller.name}-{kind.plural}"
        )
        self.synced = threading.Event()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Unblock the reading thread (stopping is already set) without waiting for the
        stream's next line; join it only once every informer of the controller was told."""
        if (resp := self._resp) is not None:
            with contextlib.suppress(Exception):
                _shutdown(resp)

    def join(self) -> None:
        self._thread.join(5)

    def _call(self, **kwargs: Any) -> Any:
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        kwargs["_preload_content"] = False
        ns, kind, api = self._ctl.namespace, self.kind, self._ctl.api_client
        if kind.group == "":
            core = client.CoreV1Api(api)
            if ns:
                return getattr(core, f"list_namespaced_{kind.plural[:-1]}")(ns, **kwargs)
            return getattr(core, f"list_{kind.plural[:-1]}_for_all_namespaces")(**kwargs)
        custom = client.CustomObjectsApi(api)
        if ns:
            return custom.list_namespaced_custom_object(
                kind.group, kind.version, ns, kind.plural, **kwargs
            )
        return custom.list_cluster_custom_object(kind.group, kind.version, kind.plural, **kwargs)

    @staticmethod
    def _check(resp: Any) -> None:
        if not 200 <= resp.status <= 299:
            raise ApiException(status=resp.status, reason=resp.reason)

    def _relist(self) -> str:
        resp = self._call(label_selector=self.label_selector, _request_timeout=30)
        self._check(resp)
        body = json.loads(resp.data)
        fresh = {}
        for item in body.get("items") or []:
            item.setdefault("apiVersion", _api_version(self.kind))
            meta = item["metadata"]
            fresh[(meta.get("namespace", ""), meta["name"])] = item
        old, self.cache = self.cache, fresh
        for key, obj in fresh.items():
            self._on_change(old.get(key), obj)
        for key, obj in old.items():
            if key not in fresh:
                self._on_change(obj, None)  # deleted while we were not watching
        self.synced.set()
        return body["metadata"].get("resourceVersion", "")

    def _run(self) -> None:
        rv: str | None = None
        while not self._ctl.stopping.is_set():
            try:
                if rv is None:
                    rv = self._relist()
                rv = self._watch(rv)
            except _Gone:
                rv = None
            except Exception as exc:
                if self._ctl.stopping.is_set():
                    return
                if isinstance(exc, ApiException) and exc.status == 410:
                    rv = None
                    continue
                log.debug("%s watch of %s broke: %r", self._ctl.name, self.kind.plural, exc)
                self._ctl.stopping.wait(0.2)  # drop or server restart: reconnect and resume

    def _watch(self, rv: str) -> str:
        resp = self._call(
            label_selector=self.label_selector,
            watch=True,
            resource_version=rv,
            allow_watch_bookmarks=True,
            timeout_seconds=WATCH_TIMEOUT_S,
            _request_timeout=(10, WATCH_TIMEOUT_S + 10),
        )
        self._resp = resp
        try:
            self._check(resp)
            for line in iter_resp_lines(resp):
                if self._ctl.stopping.is_set():
                    break
                if not line:
                    continue
                event = json.loads(line)
                obj = event.get("object") or {}
                kind = event.get("type")
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise _Gone
                    raise ApiException(status=obj.get("code"), reason=obj.get("message"))
                rv = obj.get("metadata", {}).get("resourceVersion") or rv
                if kind == "BOOKMARK":
                    continue
                obj.setdefault("apiVersion", _api_version(self.kind))
                meta = obj["metadata"]
                key = (meta.get("namespace", ""), meta["name"])
                old = self.cache.get(key)
                if kind == "DELETED":
                    self.cache.pop(key, None)
                    self._on_change(old or obj, None)
                else:
                    self.cache[key] = obj
                    self._on_change(old, obj)
        finally:
            self._resp = None
            with contextlib.suppress(Exception):
                resp.release_conn()
        return rv


class _Gone(Exception):
    """The watch's resourceVersion is too old: relist."""


def _api_version(kind: Kind) -> str:
    return f"{kind.group}/{kind.version}" if kind.group else kind.version


class Controller:
    """Informers + a delayed work queue + one worker thread calling `reconcile(key)`."""

    def __init__(self, api_client: client.ApiClient, *, namespace: str | None, name: str) -> None:
        self.api_client = api_client
        self.namespace = namespace
        self.name = name
        self.stopping = threading.Event()
        self._informers: dict[str, _Informer] = {}
        self._queue: list[tuple[float, Key]] = []
        self._due: dict[Key, float] = {}
        self._cv = threading.Condition()
        self._worker = threading.Thread(target=self._work, daemon=True, name=f"{name}-worker")

    # -- wiring ---------------------------------------------------------------------------------

    def watch(
        self,
        kind: Kind,
        *,
        label_selector: str | None = None,
        map_to: Callable[[Obj], Iterable[Key]] | None = None,
    ) -> None:
        """Watch kind; its changes enqueue the object itself, or the keys map_to gives."""

        def on_change(old: Obj | None, new: Obj | None) -> None:
            obj = new if new is not None else old
            assert obj is not None
            keys: Iterable[Key]
            if map_to is None:
                meta = obj["metadata"]
                keys = [(kind.plural, meta.get("namespace", ""), meta["name"])]
            else:
                keys = map_to(obj)
            self.on_event(kind, old, new)  # first: a reconcile must find what the event told
            for key in keys:
                self.enqueue(key)

        self._informers[kind.plural] = _Informer(self, kind, label_selector, on_change)

    def start(self, timeout_s: float = 10.0) -> None:
        for informer in self._informers.values():
            informer.start()
        for informer in self._informers.values():
            if not informer.synced.wait(timeout_s):
                raise TimeoutError(f"{self.name}: could not list {informer.kind.plural}")
        self._worker.start()

    def stop(self) -> None:
        self.stopping.set()
        with self._cv:
            self._cv.notify_all()
        for informer in self._informers.values():
            informer.stop()
        for informer in self._informers.values():
            informer.join()
        self._worker.join(10)

    # -- cache and queue ------------------------------------------------------------------------

    def cached(self, plural: str, namespace: str, name: str) -> Obj | None:
        """The latest object seen by the watch, or None."""
        return self._informers[plural].cache.get((namespace, name))

    def cached_all(self, plural: str) -> list[Obj]:
        return list(self._informers[plural].cache.values())

    def enqueue(self, key: Key, delay_s: float = 0.0) -> None:
        """Reconcile key after delay_s (an earlier request wins over a later one)."""
        due = time.monotonic() + max(0.0, delay_s)
        with self._cv:
            if key in self._due and self._due[key] <= due:
                return
            self._due[key] = due
            heapq.heappush(self._queue, (due, key))
            self._cv.notify()

    def _next(self) -> Key | None:
        with self._cv:
            while not self.stopping.is_set():
                now = time.monotonic()
                while self._queue and self._due.get(self._queue[0][1]) != self._queue[0][0]:
                    heapq.heappop(self._queue)  # superseded by an earlier request
                if self._queue and self._queue[0][0] <= now:
                    _, key = heapq.heappop(self._queue)
                    del self._due[key]
                    return key
                self._cv.wait(self._queue[0][0] - now if self._queue else None)
            return None

    def _work(self) -> None:
        while (key := self._next()) is not None:
            try:
                again = self.reconcile(key)
            except Exception:
                if self.stopping.is_set():
                    return
                log.warning("%s: reconcile of %s failed", self.name, key, exc_info=True)
                again = 0.5
            if again is not None:
                self.enqueue(key, again)

    # -- to implement ---------------------------------------------------------------------------

    def reconcile(self, key: Key) -> float | None:
        """Bring the world in line with the object under key; return seconds to run again."""
        raise NotImplementedError

    def on_event(self, kind: Kind, old: Obj | None, new: Obj | None) -> None:
        """Hook for every change seen by a watch (new None: deleted)."""


def set_condition(
    conditions: list[Obj], type_: str, status: str, reason: str, message: str = ""
) -> list[Obj]:
    """conditions with type_ set (metav1.Condition: the transition time moves only on change)."""
    old = next((c for c in conditions if c.get("type") == type_), None)
    when = old["lastTransitionTime"] if old and old.get("status") == status else now_rfc3339()
    new = {
        "type": type_,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": when,
    }
    if old is None:
        return [*conditions, new]
    return [new if c is old else c for c in conditions]  # in place: a stable order compares equal


class PodIndex:
    """Pods grouped by one label's value, kept from the informer's events plus this controller's
    own writes its cache has not seen yet (controller-runtime reads its cache the same way, with
    "expectations" for its own creates and deletes). A list per reconcile instead costs the API
    server a scan of every pod: quadratic with 1,000 clusters."""

    def __init__(self, label: str) -> None:
        self.label = label
        self._groups: dict[tuple[str, str], dict[str, Obj]] = {}  # (namespace, value) → pods
        self._deleting: set[tuple[str, str]] = set()  # deleted by us, still in the cache
        self._lock = threading.Lock()

    def seen(self, old: Obj | None, new: Obj | None) -> None:
        """An informer event (or our own write: `seen(None, pod)`)."""
        obj = new if new is not None else old
        assert obj is not None
        meta = obj["metadata"]
        value = (meta.get("labels") or {}).get(self.label)
        if value is None:
            return
        ns, name = meta.get("namespace", ""), meta["name"]
        with self._lock:
            group = self._groups.setdefault((ns, value), {})
            if new is None:
                group.pop(name, None)
                self._deleting.discard((ns, name))
                if not group:
                    del self._groups[(ns, value)]
            elif not _older(new, group.get(name)):
                group[name] = new

    def deleting(self, pod: Obj) -> None:
        """We asked to delete pod: leave it out until the informer sees it gone."""
        with self._lock:
            self._deleting.add((pod["metadata"]["namespace"], pod["metadata"]["name"]))

    def pods(self, namespace: str, value: str) -> list[Obj]:
        """Copies of the group's pods (a caller may set their status without touching the
        cache)."""
        with self._lock:
            group = self._groups.get((namespace, value)) or {}
            return [dict(p) for n, p in group.items() if (namespace, n) not in self._deleting]


def _older(new: Obj, known: Obj | None) -> bool:
    """True when new is an older version than known (a late event after our own write)."""
    if known is None:
        return False
    a, b = new["metadata"].get("resourceVersion", ""), known["metadata"].get("resourceVersion", "")
    return a.isdigit() and b.isdigit() and int(a) < int(b)


class PodIPs:
    """Fake pod IPs, unique per simulator (10.244.<n>.<m>)."""

    def __init__(self, subnet: int) -> None:
        self._subnet = subnet
        self._next = 0
        self._lock = threading.Lock()

    def take(self) -> str:
        with self._lock:
            self._next += 1
            return f"10.244.{self._subnet}.{self._next % 250 + 2}"


def running_pod_status(pod: Obj, ip: str, *, ready: bool) -> Obj:
    """The status a kubelet reports for a started pod (Ready or not)."""
    now = now_rfc3339()
    flag = "True" if ready else "False"
    conditions = [
        {"type": "PodScheduled", "status": "True", "lastTransitionTime": now},
        {"type": "Initialized", "status": "True", "lastTransitionTime": now},
        {"type": "ContainersReady", "status": flag, "lastTransitionTime": now},
        {"type": "Ready", "status": flag, "lastTransitionTime": now},
    ]
    if not ready:
        for cond in conditions[2:]:
            cond["reason"] = "ContainersNotReady"
    statuses = [
        {
            "name": c.get("name", "main"),
            "image": c.get("image", ""),
            "imageID": "",
            "ready": ready,
            "started": True,
            "restartCount": 0,
            "state": {"running": {"startedAt": now}},
        }
        for c in pod.get("spec", {}).get("containers") or []
    ]
    return {
        "phase": "Running",
        "podIP": ip,
        "podIPs": [{"ip": ip}],
        "hostIP": "10.0.0.1",
        "startTime": now,
        "conditions": conditions,
        "containerStatuses": statuses,
    }


def pod_is_ready(pod: Obj) -> bool:
    status = pod.get("status") or {}
    return status.get("phase") == "Running" and any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )


def pod_is_running(pod: Obj) -> bool:
    return (pod.get("status") or {}).get("phase") == "Running"


def set_pod_status(core: client.CoreV1Api, pod: Obj, status: Obj) -> None:
    """Write a pod's status through the /status subresource, as a kubelet does."""
    meta = pod["metadata"]
    try:
        core.patch_namespaced_pod_status(
            meta["name"],
            meta["namespace"],
            {"status": status},
            _content_type="application/merge-patch+json",
            field_validation=STRICT,
        )
    except ApiException as exc:
        if exc.status != 404:  # gone meanwhile: nothing to report
            raise


def quantities_as_strings(pod_spec: Obj) -> Obj:
    """`pod_spec` with every container resource quantity as a string, as a controller writing
    typed objects sends it (a Go `resource.Quantity` serializes as "2", and the kubernetes
    client's typed Pod refuses 2): custom resources may hold int-or-string quantities."""
    for key in ("containers", "initContainers"):
        for container in pod_spec.get(key) or []:
            resources = container.get("resources") or {}
            for part in ("limits", "requests"):
                if isinstance(resources.get(part), dict):
                    resources[part] = {k: str(v) for k, v in resources[part].items()}
    return pod_spec


def live(items: Iterable[Obj]) -> list[Obj]:
    """The objects not being deleted."""
    return [o for o in items if not o["metadata"].get("deletionTimestamp")]
