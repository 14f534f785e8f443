"""Waiting on Kubernetes objects by watching them: one list, then a watch resumed from the last
resourceVersion seen (listing again only on 410 Gone), never a sleep-and-get loop."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from kubernetes import watch as k8s_watch

from prefect_nemo.errors import AuthenticationFailed, BackendUnavailable, PrefectNemoError
from prefect_nemo.kube.api import Expired, KubeApi
from prefect_nemo.kube.kinds import Kind

log = logging.getLogger(__name__)

WATCH_TIMEOUT_S = 30  # the server ends each watch after this; we resume at once
_BACKOFF_MAX_S = 5.0


class KubeTimeout(PrefectNemoError, TimeoutError):
    """An object did not reach the awaited condition in time."""


def _list_watch(
    api: KubeApi,
    kind: Kind,
    namespace: str | None,
    *,
    label_selector: str | None = None,
    field_selector: str | None = None,
    stopped: threading.Event,
    deadline: float | None = None,
    on_error: Callable[[Exception | None], None] = lambda exc: None,
    new_watch: Callable[[], k8s_watch.Watch] = k8s_watch.Watch,
) -> Iterator[tuple[str, dict[str, Any] | list[dict[str, Any]]]]:
    """Yield ("LIST", items) and then watch events ("ADDED"/"MODIFIED"/"DELETED", obj) until
    `stopped` is set or the deadline. Dropped streams resume from the last resourceVersion seen;
    410 lists again; transport errors are retried with backoff (reported through on_error)."""
    until = stopped.is_set
    version: str | None = None
    failures = 0
    while not until():
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            return
        try:
            if version is None:
                items, version = api.list(
                    kind, namespace, label_selector=label_selector, field_selector=field_selector
                )
                yield "LIST", items
            timeout = WATCH_TIMEOUT_S if remaining is None else min(WATCH_TIMEOUT_S, remaining)
            if until():
                return
            for event, obj in api.watch(
                kind,
                namespace,
                resource_version=version,
                timeout_s=max(1, round(timeout)),
                label_selector=label_selector,
                field_selector=field_selector,
                watcher=new_watch(),
            ):
                version = obj.get("metadata", {}).get("resourceVersion") or version
                failures = 0
                on_error(None)
                yield event, obj
                if until():
                    return
            failures = 0
            on_error(None)
        except Expired:
            version = None  # too old to resume: list again
        except AuthenticationFailed:
            raise
        except BackendUnavailable as exc:
            if until():  # stopped from another thread: the stream was cut on purpose
                return
            failures += 1
            on_error(exc)
            log.debug("watch of %s failed (%s); retrying", kind.describe(), exc)
            pause = min(0.2 * 2**failures, _BACKOFF_MAX_S)
            if deadline is not None:
                pause = min(pause, max(0.0, deadline - time.monotonic()))
            stopped.wait(pause)  # a stop ends the backoff at once


def wait_for(
    api: KubeApi,
    kind: Kind,
    name: str,
    predicate: Callable[[dict[str, Any] | None], bool],
    *,
    namespace: str | None = None,
    timeout_s: float,
    what: str = "",
) -> dict[str, Any] | None:
    """Wait until predicate(object) is true, the object being None while it does not exist.

    Driven by a watch on that one object. The predicate may raise to stop waiting at once
    (e.g. when the object reports a failure). Raises KubeTimeout naming `what` and the last
    state seen.
    """
    deadline = time.monotonic() + timeout_s
    last: dict[str, Any] | None = None
    for event, payload in _list_watch(
        api, kind, namespace, field_selector=f"metadata.name={name}",
        stopped=threading.Event(), deadline=deadline,
    ):  # fmt: skip
        if isinstance(payload, list):  # the "LIST" event: every object (here: at most one)
            last = next(iter(payload), None)
        else:
            last = None if event == "DELETED" else payload
        if predicate(last):
            return last
    raise KubeTimeout(
        f"timed out after {timeout_s:.0f}s waiting for {what or kind.describe(name, namespace)}; "
        f"last seen: {_summary(last)}"
    )


def _summary(obj: dict[str, Any] | None) -> str:
    if obj is None:
        return "absent"
    status = obj.get("status")
    return json.dumps(status, sort_keys=True)[:400] if status else "no status yet"


class _Stopper:
    """Stops a list+watch loop from another thread: cuts the watch stream in flight at once
    (the client shuts its socket) instead of waiting for the server to end it."""

    def __init__(self) -> None:
        self.stopped = threading.Event()
        self._current: k8s_watch.Watch | None = None
        self._lock = threading.Lock()

    def new_watch(self) -> k8s_watch.Watch:
        with self._lock:
            self._current = k8s_watch.Watch()
            return self._current

    def stop(self) -> None:
        self.stopped.set()
        with self._lock:
            current = self._current
        if current is not None:
            current.stop()


class Informer:
    """A live cache of the objects of one kind (in one namespace, matching a selector), kept by
    one list+watch in a daemon thread, with a callback on every change and on every error (a
    watch that fails, credentials rejected, the thread ending). Reading it makes no request, so
    many waiters cost one watch."""

    def __init__(
        self,
        api: KubeApi,
        kind: Kind,
        namespace: str | None = None,
        *,
        label_selector: str | None = None,
        on_change: Callable[[str, dict[str, Any]], None] | None = None,
        on_error: Callable[[Exception | None], None] | None = None,
    ) -> None:
        self.api = api
        self.kind = kind
        self.namespace = namespace
        self.label_selector = label_selector
        self.on_change = on_change or (lambda event, obj: None)
        self.on_error = on_error or (lambda exc: None)
        self.synced = threading.Event()
        self.error: Exception | None = None
        self._objects: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._stopper = _Stopper()
        # time.monotonic() when the thread ended on an error (not by stop()); None while alive
        self.died_at: float | None = None
        self._thread = threading.Thread(
            target=self._run, name=f"prefect-nemo-informer {kind.plural}", daemon=True
        )

    def start(self) -> Informer:
        """Start listing and watching (once; a dead informer is replaced, not restarted)."""
        if self._thread.ident is None:
            self._thread.start()
        return self

    def stop(self, wait_s: float = 0.0) -> None:
        """Stop now: the watch request in flight is cut; wait up to wait_s for the thread."""
        self._stopper.stop()
        if self._thread.ident is None or self._thread is threading.current_thread():
            return
        deadline = time.monotonic() + wait_s
        while self._thread.is_alive() and time.monotonic() < deadline:
            self._thread.join(0.05)
            # a stop that came while a watch request was being sent found no response to cut
            # (the client starts each stream by clearing its stop flag): cut it now
            self._stopper.stop()

    @property
    def dead(self) -> bool:
        """True once the thread has given up on an error (see .error), not ended by stop()."""
        return self.died_at is not None and not self._stopper.stopped.is_set()

    def raise_rejected(self) -> None:
        """Raise the AuthenticationFailed (401/403) that ended this informer, if one did:
        waiting cannot heal rejected credentials."""
        if isinstance(self.error, AuthenticationFailed):
            raise type(self.error)(str(self.error))

    def get(self, name: str) -> dict[str, Any] | None:
        """The cached object, or None if the cache does not have it."""
        with self._lock:
            return self._objects.get(name)

    def items(self) -> list[dict[str, Any]]:
        """A snapshot of every cached object."""
        with self._lock:
            return list(self._objects.values())

    def _set_error(self, exc: Exception | None) -> None:
        changed = (exc is None) != (self.error is None)
        self.error = exc
        if changed or exc is not None:
            self.on_error(exc)

    def _run(self) -> None:
        try:
            for event, payload in _list_watch(
                self.api, self.kind, self.namespace, label_selector=self.label_selector,
                stopped=self._stopper.stopped, on_error=self._set_error,
                new_watch=self._stopper.new_watch,
            ):  # fmt: skip
                self._apply(event, payload)
        except Exception as exc:  # rejected credentials, or a failure we cannot retry
            log.warning(
                "informer for %s stopped: %s: %s", self.kind.describe(), type(exc).__name__, exc
            )
            self.died_at = time.monotonic()
            self._set_error(exc)

    def _apply(self, event: str, payload: dict[str, Any] | list[dict[str, Any]]) -> None:
        changes: list[tuple[str, dict[str, Any]]] = []
        with self._lock:
            if isinstance(payload, list):  # the "LIST" event: every object
                fresh = {o["metadata"]["name"]: o for o in payload}
                changes += [("DELETED", o) for n, o in self._objects.items() if n not in fresh]
                changes += [("ADDED", o) for o in fresh.values()]
                self._objects = fresh
            else:
                obj = payload
                name = obj["metadata"]["name"]
                if event == "DELETED":
                    self._objects.pop(name, None)
                else:
                    self._objects[name] = obj
                changes.append((event, obj))
        self.synced.set()
        for change in changes:
            self.on_change(*change)
