"""The one run context: which flow run (and experiment) we are in, how its jobs are named, and the
guarantee that remote work a run started is stopped whenever the run ends another way than
success.

Every piece of remote work (a job being waited on, a replica set, an inference graph) is tracked
with the callable that stops it. Three things call those: the flow hooks installed on any flow
that uses our tasks (cancellation, crash, failure: Prefect runs them in the flow's process, e.g.
on SIGTERM), the cancel watch (a run cancelled through the API that no runner supervises, one
started from a script or a notebook, gets no signal: one thread asks the API every few seconds),
and nothing else. A run killed with SIGKILL re-attaches to its jobs when it runs again
(deterministic ids). The registry of live work is `_live.py`; the cancel watch and heartbeats are
`_run_watch.py`; this module puts them together for a task call and installs the flow hooks.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prefect import get_run_logger
from prefect.context import FlowRunContext, TaskRunContext

from prefect_nemo.jobs import JobHandle
from prefect_nemo.tasks._live import fallback_logger, live_work, run_jobs, stop_run_work
from prefect_nemo.tasks._outbox import outbox
from prefect_nemo.tasks._run_watch import cancel_watch, end_cancelled

#: How long the Prefect API may be unreachable while a run waits on jobs before the run gives
#: up, stops its jobs and fails (nobody could see, cancel or sweep it meanwhile).
OUTAGE_BUDGET_ENV = "PREFECT_NEMO_API_OUTAGE_BUDGET_S"
#: A run key for every flow run of the process (a script run again attaches to its jobs).
RUN_KEY_ENV = "PREFECT_NEMO_RUN_KEY"
FLUSH_AT_END_S = 30.0  # how long a run's end waits for its reports to reach the API


def api_outage_budget_s() -> float:
    """The Prefect API outage budget ($PREFECT_NEMO_API_OUTAGE_BUDGET_S, default 600 s)."""
    return float(os.environ.get(OUTAGE_BUDGET_ENV, "600"))


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
# Flow hooks (installed automatically on any flow that uses our tasks)


def stop_flow_run_work(flow: Any, flow_run: Any, state: Any) -> None:
    """Flow hook (cancellation, crash, failure): stop every piece of work this process still
    runs for the flow run; then deliver what the run reported."""
    stop_run_work(str(flow_run.id), f"flow run {flow_run.name} ended {state.type.value}")
    run_jobs.forget(str(flow_run.id))
    end_cancelled(str(flow_run.id))
    outbox.flush(timeout_s=FLUSH_AT_END_S)


def forget_flow_run_work(flow: Any, flow_run: Any, state: Any) -> None:
    """Flow hook on completion: what is still tracked was left running on purpose (a job
    submitted and not waited for, graphs kept with keep_dgds): forget it; only what ends with
    the run whatever its outcome (a cluster created for it) is stopped. Then deliver what the
    run reported."""
    stop_run_work(str(flow_run.id), f"flow run {flow_run.name} completed", only_on_success=True)
    run_jobs.forget(str(flow_run.id))
    end_cancelled(str(flow_run.id))
    outbox.flush(timeout_s=FLUSH_AT_END_S)


def _install_stop_hooks(flow: Any) -> None:
    for hooks in (flow.on_cancellation_hooks, flow.on_crashed_hooks, flow.on_failure_hooks):
        if stop_flow_run_work not in hooks:
            hooks.append(stop_flow_run_work)
    if forget_flow_run_work not in flow.on_completion_hooks:
        flow.on_completion_hooks.append(forget_flow_run_work)
