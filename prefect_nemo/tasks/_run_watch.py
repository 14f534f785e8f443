"""The run watch: one thread per process that sees runs cancelled through the API (and stops
their work) and says the others are alive (heartbeats the sweeper reads)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator

from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterId,
    FlowRunFilterState,
    FlowRunFilterStateType,
)
from prefect.client.schemas.objects import StateType
from prefect.context import SettingsContext
from prefect.events import Event
from prefect.states import Cancelled

from prefect_nemo.jobs import JobHandle
from prefect_nemo.tasks._live import fallback_logger, live_work, run_jobs, stop_run_work
from prefect_nemo.tasks._outbox import outbox

HEARTBEAT_EVENT = "prefect-nemo.run.heartbeat"
HEARTBEAT_ENV = "PREFECT_NEMO_HEARTBEAT_S"


class _RunWatch:
    """Watches the runs of this process that have live work: sees the ones cancelled through
    the API and stops their work, and says the others are alive.

    One thread per process, alive while any run has live work here (or a wait asked for it).
    Every `interval_s`, one API request asks whether any of those runs is CANCELLING or
    CANCELLED: such a run is noted (`RunContext.interrupted` reads it), its work is stopped (so
    waiting tasks end with JobStopped) and, a run no runner supervises (a script, a notebook)
    being left CANCELLING by Prefect, its state is set to Cancelled, naming what was stopped.
    Every `heartbeat_s` ($PREFECT_NEMO_HEARTBEAT_S, default 15 s), each run with jobs emits
    `prefect-nemo.run.heartbeat` naming them and the lease it grants itself (two heartbeats): the
    sweeper reads them (a run that stops renewing its lease died without a word).
    """

    interval_s = 2.0

    @property
    def heartbeat_s(self) -> float:
        return float(os.environ.get(HEARTBEAT_ENV, "15"))

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running = False
        self._cancelled: set[str] = set()
        self._watched: Counter[str] = Counter()  # runs asked about without live work
        self._stopped: dict[str, list[str]] = {}  # what we stopped for a cancelled run
        self._last_beat = 0.0

    def saw_cancelled(self, flow_run_id: str, *, ask_now: bool = False) -> bool:
        """True once this watch has seen the run cancelled (`ask_now`: ask the API first)."""
        if ask_now:
            try:
                for run_id in self._cancelled_among([flow_run_id]):
                    with self._lock:
                        self._cancelled.add(run_id)
            except Exception as exc:
                fallback_logger().debug(f"run watch: {exc}")
        with self._lock:
            return flow_run_id in self._cancelled

    @contextlib.contextmanager
    def watching(self, flow_run_id: str) -> Iterator[None]:
        """Ask about this run while the block runs, live work or not."""
        with self._lock:
            self._watched[flow_run_id] += 1
        self.ensure_running()
        try:
            yield
        finally:
            with self._lock:
                self._watched[flow_run_id] -= 1
                if self._watched[flow_run_id] <= 0:
                    del self._watched[flow_run_id]

    def ensure_running(self) -> None:
        """Start the thread if it is not running (it ends when no work is live)."""
        with self._lock:
            if self._running:
                return
            self._running = True
            self._last_beat = 0.0  # a new watch says at once who is alive
        # Carry Prefect's settings (API URL, ...) over, but not the run context of whichever task
        # started us: its client closes when that run ends.
        settings = SettingsContext.get()
        threading.Thread(
            target=self._run,
            args=(settings.model_copy() if settings else None,),
            daemon=True,
            name="prefect-nemo-run-watch",
        ).start()

    def _run(self, settings: SettingsContext | None) -> None:
        try:
            with settings or contextlib.nullcontext():
                # one client for the thread's life (a client per round cost an SSL context)
                with get_client(sync_client=True) as client:
                    self._loop(client)
        finally:
            with self._lock:
                self._running = False

    def _loop(self, client: SyncPrefectClient) -> None:
        first = True
        while True:
            if not first:
                time.sleep(min(self.interval_s, self.heartbeat_s))
            first = False
            with self._lock:
                owned = run_jobs.snapshot()
                run_ids = sorted({*live_work.flow_run_ids(), *self._watched, *owned})
                if not run_ids:
                    self._running = False
                    return
            beat_s = self.heartbeat_s
            if owned and time.monotonic() - self._last_beat >= beat_s:
                self._last_beat = time.monotonic()
                _heartbeats(owned, lease_s=2 * beat_s)
            try:
                cancelled = self._cancelled_among(run_ids, client)
            except Exception as exc:  # the API may be briefly away: try again next round
                fallback_logger().debug(f"run watch: {exc}")
                continue
            for run_id in cancelled:
                stopped = [key for key, _ in live_work.peek(run_id)]
                with self._lock:
                    self._cancelled.add(run_id)
                    self._stopped.setdefault(run_id, []).extend(stopped)
                stop_run_work(run_id, f"flow run {run_id} was cancelled")

    def stopped_for_cancel(self, flow_run_id: str) -> list[str] | None:
        """What this watch stopped because the run was cancelled through the API (None: it
        did not see the run cancelled)."""
        with self._lock:
            if flow_run_id not in self._cancelled:
                return None
            return list(self._stopped.get(flow_run_id, []))

    @staticmethod
    def _cancelled_among(run_ids: list[str], client: SyncPrefectClient | None = None) -> list[str]:
        cancelled = FlowRunFilter(
            id=FlowRunFilterId(any_=[uuid.UUID(r) for r in run_ids]),
            state=FlowRunFilterState(
                type=FlowRunFilterStateType(any_=[StateType.CANCELLING, StateType.CANCELLED])
            ),
        )
        if client is not None:
            return [str(run.id) for run in client.read_flow_runs(flow_run_filter=cancelled)]
        with get_client(sync_client=True) as own:
            return [str(run.id) for run in own.read_flow_runs(flow_run_filter=cancelled)]


cancel_watch = _RunWatch()


def _heartbeats(jobs: dict[str, list[JobHandle]], lease_s: float) -> None:
    """`prefect-nemo.run.heartbeat` for each run with jobs: the run is alive, and vouches for
    these jobs, for `lease_s` (the sweeper reads them)."""
    for run_id, handles in jobs.items():
        outbox.beat(
            Event(
                event=HEARTBEAT_EVENT,
                resource={
                    "prefect.resource.id": f"prefect-nemo.run.{run_id}",
                    "prefect-nemo.flow-run-id": run_id,
                },
                related=[
                    {
                        "prefect.resource.id": f"prefect.flow-run.{run_id}",
                        "prefect.resource.role": "flow-run",
                    }
                ],
                payload={
                    "lease_s": lease_s,
                    "jobs": [
                        {"job_id": h.job_id, "cluster": h.cluster, "backend": h.backend}
                        for h in handles
                    ],
                },
            )
        )


def end_cancelled(flow_run_id: str) -> None:
    """A run cancelled through the API, whose work the watch stopped, ends Cancelled, naming
    what was stopped. Prefect leaves a run no runner supervises in CANCELLING, or its engine
    ends it FAILED with the JobStopped our stop caused; the flow's hooks call this once the
    engine has settled the run (a served run's runner ends it Cancelled itself)."""
    stopped = cancel_watch.stopped_for_cancel(flow_run_id)
    if stopped is None:
        return
    try:
        with get_client(sync_client=True) as client:
            run = client.read_flow_run(uuid.UUID(flow_run_id))
            if run.state is not None and run.state.type is StateType.CANCELLED:
                return
            what = ", ".join(stopped) if stopped else "no remote work was running"
            client.set_flow_run_state(
                uuid.UUID(flow_run_id),
                Cancelled(message=f"Cancelled through the API; prefect-nemo stopped: {what}"),
                force=True,
            )
    except Exception as exc:  # the run stays CANCELLING; Prefect's server ends it later
        fallback_logger().warning(f"could not end cancelled flow run {flow_run_id}: {exc}")
