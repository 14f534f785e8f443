"""The one run context: which flow run (and experiment) we are in, how its jobs are named, and the
guarantee that remote work a run started is stopped whenever the run ends another way than
success.

Every piece of remote work (a job being waited on, a replica set, an inference graph) is tracked
with the callable that stops it. Three things call those: the flow hooks installed on any flow
that uses our tasks (cancellation, crash, failure: Prefect runs them in the flow's process, e.g.
on SIGTERM), the cancel watch (a run cancelled through the API that no runner supervises, one
started from a script or a notebook, gets no signal: one thread asks the API every few seconds),
and nothing else. A run killed with SIGKILL re-attaches to its jobs when it runs again
(deterministic ids).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from prefect import get_run_logger
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterId,
    FlowRunFilterState,
    FlowRunFilterStateType,
)
from prefect.client.schemas.objects import StateType
from prefect.context import FlowRunContext, SettingsContext, TaskRunContext
from prefect.events import Event
from prefect.logging import get_logger
from prefect.states import Cancelled

from prefect_nemo.jobs import JobHandle
from prefect_nemo.tasks._outbox import outbox

LOGGER_NAME = "prefect_nemo"
HEARTBEAT_EVENT = "prefect-nemo.run.heartbeat"
#: How long the Prefect API may be unreachable while a run waits on jobs before the run gives
#: up, stops its jobs and fails (nobody could see, cancel or sweep it meanwhile).
OUTAGE_BUDGET_ENV = "PREFECT_NEMO_API_OUTAGE_BUDGET_S"
#: A run key for every flow run of the process (a script run again attaches to its jobs).
RUN_KEY_ENV = "PREFECT_NEMO_RUN_KEY"
HEARTBEAT_ENV = "PREFECT_NEMO_HEARTBEAT_S"
FLUSH_AT_END_S = 30.0  # how long a run's end waits for its reports to reach the API


def api_outage_budget_s() -> float:
    """The Prefect API outage budget ($PREFECT_NEMO_API_OUTAGE_BUDGET_S, default 600 s)."""
    return float(os.environ.get(OUTAGE_BUDGET_ENV, "600"))


def fallback_logger() -> Any:
    """The logger for code that runs outside a task or flow (hooks, the cancel watch)."""
    return get_logger(LOGGER_NAME)


# ---------------------------------------------------------------------------------------------
# Where we are


@dataclass(frozen=True)
class RunContext:
    """The flow run (and task run, and experiment) a call is made in."""

    flow_run_id: str | None
    flow_run_name: str
    task_run_id: str | None
    task_key: str | None  # "<task name>-<dynamic key>": the default job name of a task call
    experiment: str | None
    run_key: str | None
    logger: Any
    cancel_event: threading.Event | None = None

    @property
    def scope(self) -> str:
        """What job ids are stable within: the experiment, else the run key, else the flow run,
        else the task."""
        if self.experiment:
            return f"experiment:{self.experiment}"
        if self.run_key:
            return f"run-key:{self.run_key}"
        if self.flow_run_id:
            return f"flow-run:{self.flow_run_id}"
        return f"task-run:{self.task_run_id or 'none'}"

    @property
    def readable(self) -> str:
        """The readable head of job ids: the experiment, the run key or the flow run name."""
        return self.experiment or self.run_key or (self.flow_run_name if self.flow_run_id else "")

    def interrupted(self, *, ask_now: bool = False) -> str | None:
        """Why this run must stop waiting, or None: its task runner cancelled the task (SIGTERM
        to a served run), the cancel watch saw the run CANCELLING in the API (`ask_now`: ask
        the API at once instead of waiting for the watch's next round), or the Prefect API has
        been unreachable past the outage budget (nobody could see or cancel the run)."""
        if self.cancel_event is not None and self.cancel_event.is_set():
            return "the flow run is being cancelled"
        if self.flow_run_id is None:
            return None
        if cancel_watch.saw_cancelled(self.flow_run_id, ask_now=ask_now):
            return "the flow run is being cancelled"
        down = outbox.unreachable_for()
        if down > api_outage_budget_s():
            return (
                f"the Prefect API has been unreachable for {down:.0f}s (budget "
                f"{api_outage_budget_s():g}s, set {OUTAGE_BUDGET_ENV} to wait longer)"
            )
        return None

    @contextlib.contextmanager
    def cancellation_watched(self) -> Iterator[None]:
        """Have the cancel watch ask about this run while the block runs (a wait that has
        nothing of its own to stop, e.g. for a graph it only attached to)."""
        if self.flow_run_id is None:
            yield
            return
        with cancel_watch.watching(self.flow_run_id):
            yield

    def track(self, key: str, stop: Callable[[], str], *, also_on_success: bool = False) -> None:
        """Have stop() called if this run is cancelled, crashes or fails while the work is
        live (`also_on_success`: when it completes, too); stop() must not raise and returns how
        the work ended. No-op outside a run."""
        if self.flow_run_id is None:
            return
        live_work.add(self.flow_run_id, key, stop, also_on_success=also_on_success)
        cancel_watch.ensure_running()

    def own(self, job: JobHandle) -> None:
        """This run submitted (or attached to) the job: its heartbeats name it from now until
        the job or the run ends, so the sweeper leaves it alone. No-op outside a run."""
        if self.flow_run_id is None:
            return
        run_jobs.own(self.flow_run_id, job)
        cancel_watch.ensure_running()

    def release(self, job: JobHandle) -> None:
        """The job ended: no more heartbeats for it."""
        if self.flow_run_id is not None:
            run_jobs.release(self.flow_run_id, job)

    def untrack(self, key: str) -> None:
        """The work ended normally: nothing to stop for it any more."""
        live_work.discard(self.flow_run_id, key)


def current_run() -> RunContext:
    """The run context of the calling task or flow (installing the stop hooks on its flow)."""
    task_ctx = TaskRunContext.get()
    flow_ctx = FlowRunContext.get()
    flow_run = flow_ctx.flow_run if flow_ctx else None
    task_run = task_ctx.task_run if task_ctx else None
    flow_run_id = (
        str(flow_run.id)
        if flow_run
        else (str(task_run.flow_run_id) if task_run and task_run.flow_run_id else None)
    )
    if flow_ctx is not None and flow_ctx.flow is not None:
        _install_stop_hooks(flow_ctx.flow)
    try:
        logger = get_run_logger()
    except Exception:
        logger = fallback_logger()
    return RunContext(
        flow_run_id=flow_run_id,
        flow_run_name=flow_run.name if flow_run else "",
        task_run_id=str(task_run.id) if task_run else None,
        task_key=f"{task_ctx.task.name}-{task_run.dynamic_key}" if task_ctx and task_run else None,
        experiment=experiment_of(flow_run_id),
        run_key=run_key_of(flow_run_id),
        logger=logger,
        cancel_event=_runner_cancel_event(flow_ctx, task_run),
    )


def _runner_cancel_event(flow_ctx: FlowRunContext | None, task_run: Any) -> threading.Event | None:
    """The event Prefect's task runner sets when it cancels this task (the flow got SIGTERM).

    On SIGTERM the main thread gets the exception, but a task in a worker thread only sees its
    task runner's cancel event, and the engine then waits for those threads. Prefect keeps the
    events private (`ThreadPoolTaskRunner._cancel_events`, 3.x): read it defensively.
    """
    runner = getattr(flow_ctx, "task_runner", None)
    events = getattr(runner, "_cancel_events", None)
    event = events.get(task_run.id) if isinstance(events, dict) and task_run else None
    return event if isinstance(event, threading.Event) else None


# ---------------------------------------------------------------------------------------------
# Experiments: the names flow runs declared (start_experiment), for job ids


_experiments: dict[str, str] = {}
_experiments_lock = threading.Lock()


def declare_experiment(flow_run_id: str, name: str) -> None:
    """Record that this flow run is experiment `name` (job ids become stable per name)."""
    with _experiments_lock:
        _experiments[flow_run_id] = name


def experiment_of(flow_run_id: str | None) -> str | None:
    """The experiment name declared by this flow run, if any."""
    with _experiments_lock:
        return _experiments.get(flow_run_id or "")


_run_keys: dict[str, str] = {}


def declare_run_key(flow_run_id: str, key: str) -> None:
    """Record that this flow run's job ids are stable under `key` (see tasks.experiments)."""
    with _experiments_lock:
        _run_keys[flow_run_id] = key


def run_key_of(flow_run_id: str | None) -> str | None:
    """The run key of this flow run: declared, else $PREFECT_NEMO_RUN_KEY, else None."""
    with _experiments_lock:
        declared = _run_keys.get(flow_run_id or "")
    return declared or (os.environ.get(RUN_KEY_ENV) or None if flow_run_id else None)


# ---------------------------------------------------------------------------------------------
# Live work, and what stops it


class _LiveWork:
    """What each flow run started in this process and has not ended yet, each piece with the
    callable that stops it (and says how it ended)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_run: dict[str, dict[str, Callable[[], str]]] = {}
        self._on_success: set[tuple[str, str]] = set()  # stopped when the run completes too

    def add(
        self, flow_run_id: str, key: str, stop: Callable[[], str], *, also_on_success: bool
    ) -> None:
        with self._lock:
            self._by_run.setdefault(flow_run_id, {})[key] = stop
            if also_on_success:
                self._on_success.add((flow_run_id, key))

    def discard(self, flow_run_id: str | None, key: str) -> None:
        with self._lock:
            self._by_run.get(flow_run_id or "", {}).pop(key, None)
            self._on_success.discard((flow_run_id or "", key))

    def take(
        self, flow_run_id: str, *, only_on_success: bool = False
    ) -> list[tuple[str, Callable[[], str]]]:
        """Remove the run's work and return it (`only_on_success`: the part to stop when the
        run completes; the rest is forgotten)."""
        with self._lock:
            work = self._by_run.pop(flow_run_id, {})
            marked = {key for run, key in self._on_success if run == flow_run_id}
            self._on_success -= {(flow_run_id, key) for key in marked}
        return [(k, stop) for k, stop in work.items() if not only_on_success or k in marked]

    def peek(self, flow_run_id: str) -> list[tuple[str, Callable[[], str]]]:
        """The run's work, left in place."""
        with self._lock:
            return list(self._by_run.get(flow_run_id, {}).items())

    def flow_run_ids(self) -> list[str]:
        with self._lock:
            return [run_id for run_id, work in self._by_run.items() if work]


live_work = _LiveWork()


class _RunJobs:
    """The jobs each flow run of this process submitted or attached to and that have not ended:
    what its heartbeats name."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_run: dict[str, dict[tuple[str, str], JobHandle]] = {}

    def own(self, flow_run_id: str, job: JobHandle) -> None:
        with self._lock:
            self._by_run.setdefault(flow_run_id, {})[(job.cluster, job.job_id)] = job

    def release(self, flow_run_id: str, job: JobHandle) -> None:
        with self._lock:
            self._by_run.get(flow_run_id, {}).pop((job.cluster, job.job_id), None)

    def forget(self, flow_run_id: str) -> None:
        with self._lock:
            self._by_run.pop(flow_run_id, None)

    def snapshot(self) -> dict[str, list[JobHandle]]:
        with self._lock:
            return {run: list(jobs.values()) for run, jobs in self._by_run.items() if jobs}


run_jobs = _RunJobs()


def stop_run_work(flow_run_id: str, why: str, *, only_on_success: bool = False) -> None:
    """Stop (in parallel, each confirmed) every piece of work this process tracks for the run
    (`only_on_success`: what is stopped when it completes; the rest is forgotten)."""
    work = live_work.take(flow_run_id, only_on_success=only_on_success)
    if not work:
        return
    logger = fallback_logger()
    logger.warning(f"{why}: stopping {len(work)} piece(s) of remote work")
    with ThreadPoolExecutor(max_workers=min(16, len(work))) as pool:
        outcomes = pool.map(lambda item: item[1](), work)
        for (key, _), outcome in zip(work, outcomes, strict=True):
            logger.warning(f"{key}: {outcome}")


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
                self._loop()
        finally:
            with self._lock:
                self._running = False

    def _loop(self) -> None:
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
                cancelled = self._cancelled_among(run_ids)
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
    def _cancelled_among(run_ids: list[str]) -> list[str]:
        cancelled = FlowRunFilter(
            id=FlowRunFilterId(any_=[uuid.UUID(r) for r in run_ids]),
            state=FlowRunFilterState(
                type=FlowRunFilterStateType(any_=[StateType.CANCELLING, StateType.CANCELLED])
            ),
        )
        with get_client(sync_client=True) as client:
            return [str(run.id) for run in client.read_flow_runs(flow_run_filter=cancelled)]


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


def _end_cancelled(flow_run_id: str) -> None:
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


# ---------------------------------------------------------------------------------------------
# Flow hooks (installed automatically on any flow that uses our tasks)


def stop_flow_run_work(flow: Any, flow_run: Any, state: Any) -> None:
    """Flow hook (cancellation, crash, failure): stop every piece of work this process still
    runs for the flow run; then deliver what the run reported."""
    stop_run_work(str(flow_run.id), f"flow run {flow_run.name} ended {state.type.value}")
    run_jobs.forget(str(flow_run.id))
    _end_cancelled(str(flow_run.id))
    outbox.flush(timeout_s=FLUSH_AT_END_S)


def forget_flow_run_work(flow: Any, flow_run: Any, state: Any) -> None:
    """Flow hook on completion: what is still tracked was left running on purpose (a job
    submitted and not waited for, graphs kept with keep_dgds): forget it; only what ends with
    the run whatever its outcome (a cluster created for it) is stopped. Then deliver what the
    run reported."""
    stop_run_work(str(flow_run.id), f"flow run {flow_run.name} completed", only_on_success=True)
    run_jobs.forget(str(flow_run.id))
    _end_cancelled(str(flow_run.id))
    outbox.flush(timeout_s=FLUSH_AT_END_S)


def _install_stop_hooks(flow: Any) -> None:
    for hooks in (flow.on_cancellation_hooks, flow.on_crashed_hooks, flow.on_failure_hooks):
        if stop_flow_run_work not in hooks:
            hooks.append(stop_flow_run_work)
    if forget_flow_run_work not in flow.on_completion_hooks:
        flow.on_completion_hooks.append(forget_flow_run_work)
