"""The Prefect side of every backend: submit_job, wait_for_job, stop_job and run_job.

Where Prefect meets the backends: job ids from the run context, logs/events/artifacts, the
per-cluster concurrency cap, and the guarantee that a job we started is stopped whenever we
leave without it having ended (failure, timeout, cancellation, crash). Three mechanisms give
that guarantee: `finally` in the wait loop (the waiting thread got the exception), flow hooks
(on_cancellation / on_crashed / on_failure, run in the flow's process by Prefect on SIGTERM)
that stop every job this process started for the run, and deterministic ids so a run killed
with SIGKILL re-attaches when it runs again.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import (
    GlobalConcurrencyLimitCreate,
    GlobalConcurrencyLimitUpdate,
)
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterId,
    FlowRunFilterState,
    FlowRunFilterStateType,
)
from prefect.client.schemas.objects import StateType
from prefect.concurrency.sync import concurrency
from prefect.context import FlowRunContext, SettingsContext, TaskRunContext
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound
from prefect.logging import get_logger

from prefect_nemo import experiments, lifecycle
from prefect_nemo.blocks.base import ClusterBlock
from prefect_nemo.errors import (
    DependencyFailed,
    InvalidJobSpec,
    JobFailed,
    JobStopped,
    JobTimedOut,
)
from prefect_nemo.jobs import (
    META_EXPERIMENT,
    Backend,
    JobHandle,
    JobResult,
    JobSpec,
    JobState,
    JobStatus,
    NativeDependencies,
)
from prefect_nemo.redaction import Redactor
from prefect_nemo.reporting import JobReporter
from prefect_nemo.watcher import LogFollower, log_pump, watcher_for

ClusterLike = ClusterBlock | str | None
#: What a job may wait for: a job (its handle, or its result once ended) or an upstream
#: experiment (the Experiment that start_experiment returned: the jobs its upstreams ran).
Upstream = JobHandle | JobResult | experiments.Experiment
LOG_TAIL_LINES = 40

# ---------------------------------------------------------------------------------------------
# Cluster resolution


def resolve_cluster(cluster: ClusterLike) -> ClusterBlock:
    """A cluster block from a block, a saved block's name ('ray-jobs-cluster/prod'), or None.

    None means the embedded default: a local Ray cluster (see local_ray.default_cluster).
    """
    if isinstance(cluster, ClusterBlock):
        return cluster
    if cluster is None:
        from prefect_nemo.local_ray import default_cluster

        return default_cluster()
    if isinstance(cluster, str):
        if "/" not in cluster:
            raise InvalidJobSpec(
                f"cluster={cluster!r}: name a saved block as '<block-type-slug>/<name>', e.g. "
                "'ray-jobs-cluster/prod'"
            )
        from prefect.blocks.core import Block

        try:
            block = Block.load(cluster)
        except (ValueError, ObjectNotFound) as exc:
            raise InvalidJobSpec(
                f"cluster={cluster!r}: no such block document ({exc}). Create it in the UI or "
                "with `prefect-nemo blocks apply`, or pass a block object"
            ) from None
        if not isinstance(block, ClusterBlock):
            raise InvalidJobSpec(f"cluster={cluster!r} is a {type(block).__name__}, not a cluster")
        return block
    raise InvalidJobSpec(
        f"cluster: expected a cluster block (e.g. RayJobsCluster), a saved block name or None, "
        f"got {type(cluster).__name__}"
    )


# ---------------------------------------------------------------------------------------------
# Where we are: the run context that job ids and reports hang off


@dataclass(frozen=True)
class _RunContext:
    flow_run_id: str | None
    scope: str
    readable: str
    default_key: str
    logger: Any
    interrupted: Callable[[], bool]


def _run_context() -> _RunContext:
    task_ctx = TaskRunContext.get()
    flow_ctx = FlowRunContext.get()
    flow_run = flow_ctx.flow_run if flow_ctx else None
    task_run = task_ctx.task_run if task_ctx else None
    flow_run_id = (
        str(flow_run.id)
        if flow_run
        else (str(task_run.flow_run_id) if task_run and task_run.flow_run_id else None)
    )
    experiment = experiments.current_experiment(flow_run_id)
    if experiment:
        scope, readable = f"experiment:{experiment}", experiment
    elif flow_run_id:
        scope, readable = f"flow-run:{flow_run_id}", flow_run.name if flow_run else ""
    else:
        scope, readable = f"task-run:{task_run.id if task_run else 'none'}", ""
    default_key = f"{task_ctx.task.name}-{task_run.dynamic_key}" if task_ctx and task_run else "job"
    if flow_ctx is not None and flow_ctx.flow is not None:
        _install_stop_hooks(flow_ctx.flow)
    try:
        logger = get_run_logger()
    except Exception:
        logger = get_logger("prefect_nemo")
    return _RunContext(
        flow_run_id, scope, readable, default_key, logger, _cancel_signal(flow_ctx, task_run)
    )


def _cancel_signal(flow_ctx: FlowRunContext | None, task_run: Any) -> Callable[[], bool]:
    """True once Prefect's task runner cancels this task (the flow got SIGTERM / was cancelled).

    On SIGTERM the main thread gets the exception, but a task in a worker thread only sees its
    task runner's cancel event, and the engine then waits for those threads. Prefect keeps the
    events private (`ThreadPoolTaskRunner._cancel_events`, 3.x): read it defensively.
    """
    runner = getattr(flow_ctx, "task_runner", None)
    events = getattr(runner, "_cancel_events", None)
    event = events.get(task_run.id) if isinstance(events, dict) and task_run else None
    return event.is_set if isinstance(event, threading.Event) else (lambda: False)


# ---------------------------------------------------------------------------------------------
# Jobs this process is responsible for, so flow hooks can stop them


class _LiveWork:
    """What each flow run started in this process and has not ended yet: jobs, replica sets,
    inference graphs. Each piece comes with the callable that stops it (and says how it
    ended); flow hooks and the cancel watch call them when the run ends any other way than
    success, so every kind of remote work is torn down by one mechanism."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_run: dict[str, dict[str, Callable[[], str]]] = {}

    def add(self, flow_run_id: str, key: str, stop: Callable[[], str]) -> None:
        with self._lock:
            self._by_run.setdefault(flow_run_id, {})[key] = stop

    def discard(self, flow_run_id: str | None, key: str) -> None:
        with self._lock:
            self._by_run.get(flow_run_id or "", {}).pop(key, None)

    def take(self, flow_run_id: str) -> list[tuple[str, Callable[[], str]]]:
        with self._lock:
            return list(self._by_run.pop(flow_run_id, {}).items())

    def flow_run_ids(self) -> list[str]:
        with self._lock:
            return [run_id for run_id, work in self._by_run.items() if work]


live_work = _LiveWork()


def register_teardown(key: str, stop: Callable[[], str]) -> str | None:
    """Have stop() called if the current flow run is cancelled (through a runner or the API),
    crashes or fails while this work is live. stop() must not raise; it returns how the work
    ended. Returns the flow run id (None outside a run): pass it to `live_work.discard` once
    the work has ended normally."""
    flow_ctx = FlowRunContext.get()
    task_ctx = TaskRunContext.get()
    if flow_ctx is not None and flow_ctx.flow_run is not None:
        run_id = str(flow_ctx.flow_run.id)
        if flow_ctx.flow is not None:
            _install_stop_hooks(flow_ctx.flow)
    elif task_ctx is not None and task_ctx.task_run.flow_run_id:
        run_id = str(task_ctx.task_run.flow_run_id)
    else:
        return None
    live_work.add(run_id, key, stop)
    cancel_watch.ensure_running()
    return run_id


class _CancelWatch:
    """Stops the jobs of flow runs that were cancelled through the API.

    A run that no runner supervises (started from a script or a notebook) gets no signal when
    someone presses Cancel in the UI: the server only marks it CANCELLING. One thread per
    process asks the API, every few seconds and in one request, whether any run with live jobs
    here was cancelled, and stops those jobs; their waiting tasks then end with JobStopped.
    """

    interval_s = 2.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running = False

    def ensure_running(self) -> None:
        """Start the thread if it is not running (it ends when no jobs are live)."""
        with self._lock:
            if self._running:
                return
            self._running = True
        # Carry Prefect's settings (API URL, ...) over, but not the run context of whichever task
        # started us: its client closes when that run ends.
        settings = SettingsContext.get()
        threading.Thread(
            target=self._run,
            args=(settings.model_copy() if settings else None,),
            daemon=True,
            name="prefect-nemo-cancel-watch",
        ).start()

    def _run(self, settings: SettingsContext | None) -> None:
        try:
            with settings or contextlib.nullcontext():
                self._loop()
        finally:
            with self._lock:
                self._running = False

    def _loop(self) -> None:
        while True:
            time.sleep(self.interval_s)
            with self._lock:
                run_ids = live_work.flow_run_ids()
                if not run_ids:
                    self._running = False
                    return
            try:
                for run_id in self._cancelled(run_ids):
                    _stop_run_jobs(run_id, f"flow run {run_id} was cancelled")
            except Exception as exc:  # the API may be briefly away: try again next round
                get_logger("prefect_nemo").debug(f"cancel watch: {exc}")

    @staticmethod
    def _cancelled(run_ids: list[str]) -> list[str]:
        cancelled = FlowRunFilter(
            id=FlowRunFilterId(any_=[uuid.UUID(r) for r in run_ids]),
            state=FlowRunFilterState(
                type=FlowRunFilterStateType(any_=[StateType.CANCELLING, StateType.CANCELLED])
            ),
        )
        with get_client(sync_client=True) as client:
            return [str(run.id) for run in client.read_flow_runs(flow_run_filter=cancelled)]


cancel_watch = _CancelWatch()


def stop_flow_run_jobs(flow: Any, flow_run: Any, state: Any) -> None:
    """Flow hook: stop (and confirm) every job this process still runs for the flow run.

    Installed automatically on any flow that uses our tasks, for cancellation, crash and failure.
    """
    _stop_run_jobs(str(flow_run.id), f"flow run {flow_run.name} ended {state.type.value}")


def _stop_run_jobs(flow_run_id: str, why: str) -> None:
    work = live_work.take(flow_run_id)
    if not work:
        return
    logger = get_logger("prefect_nemo")
    logger.warning(f"{why}: stopping {len(work)} piece(s) of remote work")
    with ThreadPoolExecutor(max_workers=min(16, len(work))) as pool:
        outcomes = pool.map(lambda item: item[1](), work)
        for (key, _), outcome in zip(work, outcomes, strict=True):
            logger.warning(f"{key}: {outcome}")


def _stop_quietly(backend: Backend, job_id: str, timeout_s: float) -> str:
    redact = Redactor(backend.secrets)
    try:
        status = lifecycle.stop_and_confirm(backend, job_id, timeout_s=timeout_s)
        return status.state.value if status else "gone"
    except Exception as exc:
        return redact(f"stop not confirmed: {exc}")


def forget_flow_run_work(flow: Any, flow_run: Any, state: Any) -> None:
    """Flow hook on completion: what is still registered was left running on purpose (a job
    submitted and not waited for, graphs kept with keep_dgds): forget it, stop nothing."""
    live_work.take(str(flow_run.id))


def _install_stop_hooks(flow: Any) -> None:
    # Users should not have to remember this: any flow that runs our tasks gets the hooks once.
    for hooks in (flow.on_cancellation_hooks, flow.on_crashed_hooks, flow.on_failure_hooks):
        if stop_flow_run_jobs not in hooks:
            hooks.append(stop_flow_run_jobs)
    if forget_flow_run_work not in flow.on_completion_hooks:
        flow.on_completion_hooks.append(forget_flow_run_work)


# ---------------------------------------------------------------------------------------------
# The concurrency cap


@contextmanager
def _cluster_slot(block: ClusterBlock, backend: Backend) -> Iterator[None]:
    """Hold one slot of the cluster's global concurrency limit while the job runs."""
    if not block.max_concurrent_jobs:
        yield
        return
    name = block.concurrency_limit_name(backend)
    _ensure_limit(name, block.max_concurrent_jobs)
    with concurrency(name, occupy=1, strict=True):
        yield


def _ensure_limit(name: str, limit: int) -> None:
    with get_client(sync_client=True) as client:
        try:
            current = client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            try:
                client.create_global_concurrency_limit(
                    GlobalConcurrencyLimitCreate(name=name, limit=limit)
                )
            except ObjectAlreadyExists:
                pass
            return
        if current.limit != limit:
            client.update_global_concurrency_limit(name, GlobalConcurrencyLimitUpdate(limit=limit))


# ---------------------------------------------------------------------------------------------
# Dependencies


def _after(
    block: ClusterBlock, backend: Backend, after: Iterable[Upstream], ctx: _RunContext
) -> Backend:
    """The backend to submit with once `after` allows: native dependencies (Slurm afterok) for
    upstream jobs the scheduler can wait for, a wait here for the others; DependencyFailed if
    an upstream job failed. Nothing is submitted before this returns."""
    handles: list[JobHandle] = []
    for item in after:
        if isinstance(item, JobResult):
            if not item.succeeded:
                raise DependencyFailed(
                    f"upstream job {item.handle.job_id} ended {item.state.value}"
                    + (f": {item.message}" if item.message else "")
                    + "; this job was not submitted"
                )
        elif isinstance(item, JobHandle):
            handles.append(item)
        elif isinstance(item, experiments.Experiment):
            # start_experiment saw the upstream flow runs COMPLETED; jobs they left running on
            # this cluster are waited for natively where the scheduler can. Their ended jobs
            # (a failed optional eval, say) were theirs to judge, not a reason to fail here.
            if isinstance(backend, NativeDependencies):
                jobs = [h for run in item.upstream for h in backend.experiment_jobs(run.name)]
                now = backend.statuses([h.job_id for h in jobs]) if jobs else {}
                handles += [
                    h for h in jobs if h.job_id in now and not now[h.job_id].state.is_terminal()
                ]
        else:
            raise InvalidJobSpec(
                f"after: expected JobHandle, JobResult or Experiment items, got "
                f"{type(item).__name__}"
            )
    native = [
        h
        for h in handles
        if isinstance(backend, NativeDependencies) and backend.depends_natively_on(h)
    ]
    for handle in handles:
        if handle in native:
            continue
        if handle.cluster != backend.cluster:
            raise InvalidJobSpec(
                f"after: job {handle.job_id} runs on {handle.cluster}, which this task cannot "
                f"watch from {backend.cluster}: pass its JobResult (from wait_for_job or "
                "run_job) instead, or order the tasks with wait_for=[...]"
            )
        ctx.logger.info(f"waiting for upstream job {handle.job_id} before submitting")
        watcher = watcher_for(
            backend,
            max_interval_s=block.max_poll_interval_s,
            unreachable_budget_s=block.unreachable_budget_s,
        )
        status = lifecycle.wait_until_terminal(watcher, handle, interrupted=ctx.interrupted)
        if status.state is not JobState.SUCCEEDED:
            raise DependencyFailed(
                f"upstream job {handle.job_id} ended {status.state.value}"
                + (f": {status.message}" if status.message else "")
                + "; this job was not submitted"
            )
    if native:
        ctx.logger.info(
            "submitting after " + ", ".join(h.job_id for h in native) + " (native dependency)"
        )
        return backend.after(native)  # type: ignore[union-attr]
    return backend


# ---------------------------------------------------------------------------------------------
# The shared steps


def _submit(
    block: ClusterBlock, backend: Backend, spec: JobSpec, ctx: _RunContext, redact: Redactor
) -> tuple[lifecycle.Submission, JobReporter]:
    backend.check_access()  # auth and reachability fail here, before anything is submitted
    owner = {lifecycle.META_FLOW_RUN: ctx.flow_run_id or ""}
    if ctx.scope.startswith("experiment:"):
        owner[META_EXPERIMENT] = ctx.readable
    submission = lifecycle.submit_or_attach(
        backend,
        spec,
        scope=ctx.scope,
        key=spec.name or ctx.default_key,
        readable=ctx.readable,
        metadata=owner,
    )
    reporter = JobReporter(
        submission.handle, logger=ctx.logger, redact=redact, flow_run_id=ctx.flow_run_id
    )
    reporter.submitted(attached=submission.attached, drift=submission.drift)
    return submission, reporter


def _watch(
    block: ClusterBlock,
    backend: Backend,
    handle: JobHandle,
    *,
    timeout_s: float | None,
    stream_logs: bool,
    ctx: _RunContext,
    reporter: JobReporter,
    attached: bool,
) -> JobResult:
    """Wait for the job to end; stop it if we leave any other way. Raise unless it succeeded."""
    watcher = watcher_for(
        backend,
        max_interval_s=block.max_poll_interval_s,
        unreachable_budget_s=block.unreachable_budget_s,
    )
    redact = reporter.redact
    follower: LogFollower | None = None
    whole_log: str | None = None  # read once when the job ends (streaming) for the log tail
    final: JobStatus | None = None
    stopped = False  # set once we have stopped the job ourselves
    if ctx.flow_run_id:
        stop = partial(_stop_quietly, backend, handle.job_id, block.stop_timeout_s)
        live_work.add(ctx.flow_run_id, f"job {handle.job_id}", stop)
        cancel_watch.ensure_running()

    def sink(line: str) -> None:
        ctx.logger.info(redact(f"[{handle.job_id}] {line}"))

    def on_change(status: JobStatus) -> None:
        nonlocal follower, whole_log
        if status.state.is_terminal() and stream_logs:
            # The job's log lines come before the line that says how it ended.
            whole_log = (follower or LogFollower(backend, handle.job_id, sink)).finish()
            follower = None
        elif stream_logs and follower is None and status.state is JobState.RUNNING:
            follower = log_pump.follow(
                backend,
                handle.job_id,
                sink,
                is_done=lambda: (
                    (s := watcher.latest(handle.job_id)) is None or s.state.is_terminal()
                ),
            )
        reporter.changed(status)

    try:
        final = lifecycle.wait_until_terminal(
            watcher,
            handle,
            timeout_s=timeout_s,
            on_change=on_change,
            interrupted=ctx.interrupted,
        )
    except JobTimedOut as exc:
        final, stopped = _stop(backend, handle, block, reporter), True
        raise JobTimedOut(redact(str(exc)), _result(handle, final, attached, redact)) from None
    finally:
        if follower is not None:
            follower.finish()
        # Cancelled, crashed or lost the cluster: the job must not outlive us.
        if final is None and not stopped:
            _stop(backend, handle, block, reporter)
        live_work.discard(ctx.flow_run_id, f"job {handle.job_id}")

    if final.state is JobState.SUCCEEDED:
        return _result(handle, final, attached, redact)
    tail = _log_tail(backend, handle, whole_log) if final.state is JobState.FAILED else ""
    result = _result(handle, final, attached, redact, log_tail=redact(tail))
    exit_code = f" (exit code {final.exit_code})" if final.exit_code is not None else ""
    message = redact(
        f"job {handle.job_id} {final.state.value}{exit_code}: {final.message}".rstrip(": ")
    )
    if tail and tail.strip() not in final.message:
        message += "\n--- last log lines ---\n" + redact(tail)
    if final.state is JobState.STOPPED:
        raise JobStopped(message, result)
    raise JobFailed(message, result)


def _stop(
    backend: Backend, handle: JobHandle, block: ClusterBlock, reporter: JobReporter
) -> JobStatus | None:
    try:
        status = lifecycle.stop_and_confirm(backend, handle.job_id, timeout_s=block.stop_timeout_s)
    except Exception as exc:
        reporter.logger.error(reporter.redact(f"could not stop job {handle.job_id}: {exc}"))
        return None
    if status is not None:
        reporter.changed(status)
    return status


def _log_tail(backend: Backend, handle: JobHandle, whole_log: str | None) -> str:
    """The last lines of the job's log, from the read already made if there was one."""
    try:
        whole = whole_log if whole_log is not None else backend.logs(handle.job_id)
    except Exception:
        return ""
    return "\n".join(whole.rstrip().splitlines()[-LOG_TAIL_LINES:])


def _result(
    handle: JobHandle,
    status: JobStatus | None,
    attached: bool,
    redact: Redactor,
    log_tail: str = "",
) -> JobResult:
    if status is None:
        return JobResult(
            handle=handle, state=JobState.STOPPED, message="stop not confirmed", attached=attached
        )
    return JobResult(
        handle=handle,
        state=status.state,
        message=redact(status.message),
        start_time=status.start_time,
        end_time=status.end_time,
        exit_code=status.exit_code,
        log_tail=log_tail,
        attached=attached,
    )


def _setup(spec: JobSpec | None, cluster: ClusterLike) -> tuple[ClusterBlock, Backend, Redactor]:
    if spec is not None and not isinstance(spec, JobSpec):
        raise InvalidJobSpec(f"spec: expected a JobSpec, got {type(spec).__name__}")
    block = resolve_cluster(cluster)
    backend = block.backend()
    if spec is not None:
        backend.validate(spec)  # bad input fails before any wait for upstream jobs
    redact = Redactor([*backend.secrets, *(spec.secret_values() if spec else [])])
    return block, backend, redact


# ---------------------------------------------------------------------------------------------
# The tasks


@task(name="run_job", cache_policy=NO_CACHE)
def run_job(
    spec: JobSpec,
    cluster: ClusterLike = None,
    *,
    stream_logs: bool = True,
    after: Iterable[Upstream] = (),
) -> JobResult:
    """Run a job to the end: submit (or re-attach), stream its logs, return its JobResult.

    Raises JobFailed / JobStopped / JobTimedOut (with `.result`) unless it succeeded; stops the
    job if the task is cancelled or crashes. Holds a slot of the cluster's concurrency cap.
    `after`: upstream jobs or experiments to wait for first (natively where the scheduler can,
    e.g. Slurm afterok; else here); DependencyFailed if one failed.
    """
    block, backend, redact = _setup(spec, cluster)
    ctx = _run_context()
    backend = _after(block, backend, after, ctx)
    with _cluster_slot(block, backend):
        submission, reporter = _submit(block, backend, spec, ctx, redact)
        return _watch(
            block,
            backend,
            submission.handle,
            timeout_s=spec.timeout_s,
            stream_logs=stream_logs,
            ctx=ctx,
            reporter=reporter,
            attached=submission.attached,
        )


@task(name="submit_job", cache_policy=NO_CACHE)
def submit_job(
    spec: JobSpec, cluster: ClusterLike = None, *, after: Iterable[Upstream] = ()
) -> JobHandle:
    """Submit a job (or re-attach to the one this run already submitted) and return its handle.

    The concurrency cap is not held across tasks: use run_job where the cap matters. `after`
    as in run_job: with native dependencies the job is queued at once and starts only after
    its upstream jobs succeed.
    """
    block, backend, redact = _setup(spec, cluster)
    ctx = _run_context()
    backend = _after(block, backend, after, ctx)
    submission, _ = _submit(block, backend, spec, ctx, redact)
    return submission.handle


@task(name="wait_for_job", cache_policy=NO_CACHE)
def wait_for_job(
    handle: JobHandle,
    cluster: ClusterLike = None,
    *,
    timeout_s: float | None = None,
    stream_logs: bool = True,
) -> JobResult:
    """Wait for a submitted job to end; stop it on timeout, cancellation or crash."""
    block, backend, redact = _setup(None, cluster)
    ctx = _run_context()
    reporter = JobReporter(handle, logger=ctx.logger, redact=redact, flow_run_id=ctx.flow_run_id)
    return _watch(
        block,
        backend,
        handle,
        timeout_s=timeout_s,
        stream_logs=stream_logs,
        ctx=ctx,
        reporter=reporter,
        attached=False,
    )


@task(name="stop_job", cache_policy=NO_CACHE)
def stop_job(handle: JobHandle, cluster: ClusterLike = None) -> JobResult:
    """Stop a job and return its state once the cluster confirms it ended."""
    block, backend, redact = _setup(None, cluster)
    ctx = _run_context()
    reporter = JobReporter(handle, logger=ctx.logger, redact=redact, flow_run_id=ctx.flow_run_id)
    status = lifecycle.stop_and_confirm(backend, handle.job_id, timeout_s=block.stop_timeout_s)
    if status is not None:
        reporter.changed(status)
    return _result(handle, status, attached=False, redact=redact)
