"""The one way our reports reach the Prefect API: events, log lines and artifact writes, each kind
sent in the order its items were made and each item delivered once, by one thread, through API
outages. The oldest items (up to BATCH, for one API) go together: their log lines in one
request, their events in one, then their artifact writes in order; a thousand jobs interleave
logs, events and writes, and one request per item would not keep up.

Prefect's own event and log workers drop what they cannot send after a few retries, so an API
outage of a minute loses the events that deployment triggers wait for and the log lines of that
window. Here an item that cannot be delivered is kept and sent again (with backoff) until the
API answers; the outbox says once that it is waiting and once that it answers again. How long
the API has been unreachable (`unreachable_for`: since the start of the first send that failed,
until one succeeds) is what the run context's outage budget reads. The retries are ours alone:
Prefect's client, once it has connected, retries a refused connection by itself for about a
minute (PREFECT_CLIENT_MAX_RETRIES, 2**n s apart), which hid a shorter outage from the budget.

Events keep their id across retries (the API stores an event id once). A heartbeat (`beat`)
skips the queue: it proves a run is alive now, so it goes before whatever waits (a backlog of
log lines must not make a live run look dead to the sweeper), and only the newest of each
resource is kept. A write made with `after_s` (an artifact rewritten in place, at most every
second or two) waits apart until it is due and then joins the queue; `flush` sends it at once,
`settle` does not wait for it. Log lines go with
`send_to_api` off through the run logger (the console shows them at once) and through here to
the API. The thread runs while items wait and ends a second (LINGER_S) after the outbox
empties; at interpreter exit a last flush is tried for a few seconds.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import contextvars
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from prefect.client.orchestration import get_client
from prefect.context import FlowRunContext, SettingsContext, TaskRunContext, get_settings_context
from prefect.events import Event
from prefect.events.related import (
    object_as_related_resource,
    related_resources_from_run_context,
    tags_as_related_resources,
)
from prefect.logging import get_logger
from prefect.settings import PREFECT_CLIENT_MAX_RETRIES

MAX_ITEMS = 200_000  # beyond this the oldest items go (and we say how many)
# Per request. The server validates a request's whole body on its one event loop before it
# answers anything else: 500 events or log lines held it ~0.35 s each, and the UI's flow-run page
# (6 requests) took up to 2.7 s during a 1,000-job run; at 100 it took at most 1.7 s, the flow's
# wall time unchanged (bench/scale.py).
BATCH = 100
BACKOFF_S = (0.5, 1.0, 2.0, 5.0)
# The sending thread waits this long for more before it ends: a flow's reports come in bursts,
# and each new thread's client cost ~25 ms of CPU (an SSL context) beside the settings it sends
# under (~25 ms, kept on the outbox: they do not change).
LINGER_S = 1.0

Kind = Literal["event", "log", "call"]


@dataclass
class _Item:
    kind: Kind
    value: Any  # an Event, a log dict, or a callable(client)
    settings: SettingsContext | None
    context: contextvars.Context | None = None  # the run context, for an event's related resources
    related_done: bool = field(default=False)
    sent: bool = field(default=False)  # delivered while others of its batch were not (retry)
    due: float = 0.0  # monotonic time before which it waits apart (call(after_s=...))


class Outbox:
    """Ordered, at-least-until-the-API-answers delivery of events, logs and artifact writes."""

    def __init__(self, max_items: int = MAX_ITEMS) -> None:
        self._items: deque[_Item] = deque()
        self._beats: dict[str, _Item] = {}  # resource id -> the newest heartbeat not sent yet
        self._later: list[_Item] = []  # writes not due yet (call(after_s=...))
        self._related: dict[str, list[Any]] = {}  # flow run -> its related resources
        self._settings: dict[tuple[str, Any], SettingsContext] = {}  # API -> settings to send under
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._max_items = max_items
        self._failing_since: float | None = None
        self._dropped = 0
        self.delivered = 0  # items the API accepted; read by tests and benchmarks

    # -- putting things in --------------------------------------------------------------------

    def event(self, event: Event) -> None:
        """Send an event; its related resources are the calling run's (flow run, deployment,
        flow, tags), as Prefect's own emit_event attaches them."""
        self._put(_Item("event", event, SettingsContext.get(), contextvars.copy_context()))

    def log(self, record: dict[str, Any]) -> None:
        """Send a log line (a LogCreate as a JSON dict: name, level, message, timestamp,
        flow_run_id, task_run_id)."""
        self._put(_Item("log", record, SettingsContext.get()))

    def call(self, write: Callable[[Any], None], after_s: float = 0.0) -> None:
        """Run `write(sync_client)` in order with the rest (an artifact write); retried until
        it succeeds, so it must be safe to repeat. With `after_s`, it joins the queue only
        that much later (or at the next flush)."""
        item = _Item("call", write, SettingsContext.get())
        if after_s <= 0:
            self._put(item)
            return
        item.due = time.monotonic() + after_s
        with self._cond:
            self._later.append(item)
            self._wake()

    def beat(self, event: Event) -> None:
        """Send a heartbeat ahead of everything queued, replacing an unsent older one of the
        same resource (no related resources are added)."""
        with self._cond:
            self._beats[event.resource.id] = _Item("event", event, SettingsContext.get())
            self._wake()

    def _put(self, item: _Item) -> None:
        with self._cond:
            self._items.append(item)
            while len(self._items) > self._max_items:
                self._items.popleft()
                self._dropped += 1
            self._wake()

    def _wake(self) -> None:
        """Start the sending thread if it is not running (the caller holds the lock)."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="prefect-nemo-outbox", daemon=True
            )
            self._thread.start()
        self._cond.notify_all()  # the sender may wait for a held write, beside flush waiters

    # -- state --------------------------------------------------------------------------------

    def unreachable_for(self) -> float:
        """Seconds the API has been failing to take what waits here (0 while it answers)."""
        since = self._failing_since
        return 0.0 if since is None else time.monotonic() - since

    def pending(self) -> int:
        """Items not delivered yet."""
        with self._cond:
            return len(self._items) + len(self._beats) + len(self._later)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until everything put so far (writes not due yet too: they go now) was
        delivered; False on timeout."""
        with self._cond:
            self._promote(everything=True)
        return self._drained(timeout_s)

    def _drained(self, timeout_s: float) -> bool:
        """Wait until the queue and the heartbeats are delivered; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._items or self._beats:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(min(remaining, 0.1))
        return True

    def _promote(self, *, everything: bool = False) -> float | None:
        """Move the writes that are due (or all) into the queue; the next due time of those
        left, if any. Call with the lock held."""
        now = time.monotonic()
        if any(everything or item.due <= now for item in self._later):
            self._items.extend(item for item in self._later if everything or item.due <= now)
            self._later = [item for item in self._later if not everything and item.due > now]
            self._cond.notify_all()
        return min((item.due for item in self._later), default=None)

    def settle(self, outage_budget_s: float, quick_s: float = 2.0) -> None:
        """Wait until what was put so far is delivered: for up to `quick_s` while the API
        answers; while it is unreachable, until it answers again, unless it has been away for
        more than `outage_budget_s`."""
        quick_until = time.monotonic() + quick_s
        while not self._drained(timeout_s=0.5):
            down = self.unreachable_for()
            if down > outage_budget_s or (not down and time.monotonic() > quick_until):
                return

    # -- the sending thread -------------------------------------------------------------------

    def _run(self) -> None:
        failures = 0
        clients = _Clients(self._settings)  # one client per API for the thread, not per batch
        idle_since: float | None = None
        try:
            while True:
                with self._cond:
                    next_due = self._promote()
                    if not self._items and not self._beats:
                        now = time.monotonic()
                        idle_since = idle_since or now
                        if next_due is not None:  # only writes not due yet: wait for them
                            self._cond.wait(next_due - now)
                            continue
                        if now < idle_since + LINGER_S:  # more may come (a put notifies)
                            self._cond.wait(idle_since + LINGER_S - now)
                            continue
                        self._thread = None
                        self._cond.notify_all()
                        return
                    idle_since = None
                    beats = list(self._beats.values())
                    beats = [b for b in beats if _api(b.settings) == _api(beats[0].settings)]
                    batch = beats or self._batch()
                started = time.monotonic()
                try:
                    self._send(batch, clients)
                except Exception as exc:
                    failures += 1
                    clients.close()  # a fresh connection for the next try
                    self._failed(exc, started)
                    time.sleep(BACKOFF_S[min(failures, len(BACKOFF_S)) - 1])
                    continue
                failures = 0
                with self._cond:
                    if beats:  # sent: forget them unless a newer one replaced them
                        for item in batch:
                            key = item.value.resource.id
                            if self._beats.get(key) is item:
                                del self._beats[key]
                    else:  # by identity: past MAX_ITEMS, _put may have dropped some meanwhile
                        for item in batch:
                            if self._items and self._items[0] is item:
                                self._items.popleft()
                    self.delivered += len(batch)
                    self._cond.notify_all()
                self._caught_up()
        finally:
            clients.close()

    def _batch(self) -> list[_Item]:
        """The oldest items for one API, up to BATCH."""
        first = self._items[0]
        batch = []
        for item in self._items:
            if _api(item.settings) != _api(first.settings):
                break
            batch.append(item)
            if len(batch) == BATCH:
                break
        return batch

    def _send(self, batch: list[_Item], clients: _Clients) -> None:
        """The batch's log lines in one request, its events in one, then its calls in order;
        each marked sent once delivered, so a retry after a failure sends only the rest."""
        # the settings the items were made under (the API URL), as the thread's own copy
        settings = batch[0].settings
        with clients.settings(settings):
            client = clients.get(settings)
            logs = [item for item in batch if item.kind == "log" and not item.sent]
            if logs:
                client.create_logs([item.value for item in logs])
                _mark_sent(logs)
            events = [item for item in batch if item.kind == "event" and not item.sent]
            if events:
                self._attach_related([item for item in events if not item.related_done])
                payload = [item.value.model_dump(mode="json") for item in events]
                client.request("POST", "/events", json=payload)
                _mark_sent(events)
            for item in batch:
                if item.kind == "call" and not item.sent:
                    item.value(client)
                    item.sent = True

    def _attach_related(self, items: list[_Item]) -> None:
        """Add each event's run's related resources, as Prefect's emit_event does in its worker
        from the run context captured when the event was made: the flow run's (flow run, flow,
        deployment, work queue and pool: API lookups) once per flow run, then each event's task
        run and its tags added here. Looked up per task run, a thousand jobs cost a thousand
        lookups, each a fresh loop and client: 12 ms of the flow's CPU per job."""
        items = [item for item in items if item.context is not None]
        runs = [item.context.run(_run_of) for item in items if item.context is not None]
        todo = {flow: item for (flow, _), item in zip(runs, items, strict=True)
                if flow not in self._related}  # fmt: skip

        async def lookups() -> list[list[Any]]:
            from prefect.client.orchestration import get_client as get_async_client

            async with get_async_client() as client:
                return await asyncio.gather(*[
                    asyncio.create_task(related_resources_from_run_context(client),
                                        context=_flow_level(item.context))
                    for item in todo.values() if item.context is not None
                ])  # fmt: skip

        if todo:
            if len(self._related) > 1000:
                self._related.clear()
            self._related.update(zip(todo, asyncio.run(lookups()), strict=True))
        for (flow, task_run), item in zip(runs, items, strict=True):
            event: Event = item.value
            involved = {r.id for r in event.involved_resources}
            found = [r for r in _with_task_run(self._related[flow], task_run)
                     if r.id not in involved]  # fmt: skip
            event.related = [*event.related, *found]
            item.related_done = True

    def _failed(self, exc: Exception, started: float) -> None:
        if self._failing_since is None:
            self._failing_since = started  # a send that hung until it failed counts whole
            get_logger("prefect_nemo").warning(
                f"the Prefect API does not take our events and logs ({type(exc).__name__}: "
                f"{exc}); {self.pending()} kept, sent again when it answers"
            )

    def _caught_up(self) -> None:
        """A send succeeded: the API answers (what is still kept follows; a held write waits
        by our choice, not for the API)."""
        if self._failing_since is not None:
            down = time.monotonic() - self._failing_since
            self._failing_since = None
            dropped, self._dropped = self._dropped, 0
            lost = f"; {dropped} oldest dropped past {self._max_items} kept" if dropped else ""
            get_logger("prefect_nemo").info(
                f"the Prefect API answers again after {down:.0f}s: sending what was kept{lost}"
            )


def _mark_sent(items: list[_Item]) -> None:
    for item in items:
        item.sent = True


class _Clients:
    """The outbox thread's sync clients, one per API (URL and key), kept for the thread's life,
    and the settings each is made and used under."""

    def __init__(self, settings: dict[tuple[str, Any], SettingsContext]) -> None:
        self._open: dict[tuple[str, Any], Any] = {}
        self._settings = settings  # the outbox's, kept across threads

    def settings(self, settings: SettingsContext | None) -> SettingsContext:
        """The settings to send under: these (the API URL), with the client's own retries off
        (the outbox retries; the client's would hide an outage for a minute). A copy of our
        own: the original may be entered in the caller's thread right now."""
        key = _api(settings)
        if key not in self._settings:
            base = settings or get_settings_context()
            quiet = base.settings.copy_with_update(updates={PREFECT_CLIENT_MAX_RETRIES: 0})
            self._settings[key] = SettingsContext(profile=base.profile, settings=quiet)
        return self._settings[key]

    def get(self, settings: SettingsContext | None) -> Any:
        """The open client of these settings (made under them: the caller entered them)."""
        key = _api(settings)
        if key not in self._open:
            client = get_client(sync_client=True)
            client.__enter__()
            self._open[key] = client
        return self._open[key]

    def close(self) -> None:
        clients, self._open = list(self._open.values()), {}
        for client in clients:
            with contextlib.suppress(Exception):
                client.__exit__(None, None, None)


def _api(settings: SettingsContext | None) -> tuple[str, Any]:
    """The API that items made under these settings go to: its URL and key (a SecretStr, which
    compares and hashes by value but never prints it). Every task run has its own settings
    object, so comparing objects made a client (an SSL context: 10 ms of CPU) and a batch per
    task run at a thousand jobs."""
    if settings is None:
        return ("", None)
    api = settings.settings.api
    return (str(api.url or ""), api.key)


def _run_of() -> tuple[str, Any]:
    """(the flow run's key, the task run or None) of the current run context. The key is the
    flow run id, or the task run's id where a task runs without its flow run's context (Prefect
    then looks the flow run up through the task run: per task run, as Prefect does)."""
    flow_ctx, task_ctx = FlowRunContext.get(), TaskRunContext.get()
    flow_run = getattr(flow_ctx, "flow_run", None)
    task_run = getattr(task_ctx, "task_run", None)
    if flow_run is None:
        return (f"task-run:{getattr(task_run, 'id', '')}", None)
    return (str(flow_run.id), task_run)


def _flow_level(context: contextvars.Context) -> contextvars.Context:
    """A copy of the run context without its task run (the flow run's own resources), where
    the flow run's context is there to look them up from."""
    copied = context.copy()
    if copied.run(FlowRunContext.get) is not None:
        # Prefect types the var as holding a TaskRunContext; None is what .get() reads outside
        # a task run
        copied.run(TaskRunContext.__var__.set, None)  # type: ignore[arg-type]
    return copied


def _with_task_run(flow_level: list[Any], task_run: Any) -> list[Any]:
    """The flow run's related resources plus the task run and its tags, in Prefect's order:
    flow run, task run, flow, deployment, work queue, work pool, then every tag sorted."""
    if task_run is None:
        return flow_level
    resource = object_as_related_resource(kind="task-run", role="task-run", object=task_run)
    objects = [r for r in flow_level if r.role != "tag"]
    tags = {r.id.removeprefix("prefect.tag.") for r in flow_level if r.role == "tag"}
    tags |= set(task_run.tags or [])
    return [*objects[:1], resource, *objects[1:], *tags_as_related_resources(tags)]


outbox = Outbox()


@atexit.register
def _last_flush() -> None:
    if outbox.pending():
        outbox.flush(timeout_s=5.0)
