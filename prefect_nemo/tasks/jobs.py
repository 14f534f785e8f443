"""The job tasks: run_job, or submit_job + wait_for_job + stop_job.

Each task resolves the cluster block, refuses bad input before anything is sent, takes the run
context, and then hands the job to a `lifecycle.Supervisor` once: the supervisor submits or
re-attaches, waits, and stops the job whenever the wait ends any other way than with the job
ended; the run's `JobReporter` is told what happens (logs, events, the job table, teardown
tracking). `after` waits for upstream jobs first (natively where the scheduler can), and
run_job holds a slot of the cluster's concurrency cap while the job runs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import (
    GlobalConcurrencyLimitCreate,
    GlobalConcurrencyLimitUpdate,
)
from prefect.concurrency.sync import concurrency
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

from prefect_nemo.blocks.base import ClusterBlock
from prefect_nemo.errors import DependencyFailed, InvalidJobSpec
from prefect_nemo.jobs import (
    META_EXPERIMENT,
    Backend,
    DryRun,
    JobHandle,
    JobResult,
    JobSpec,
    JobState,
    NativeDependencies,
    RunScopedCluster,
)
from prefect_nemo.lifecycle import META_FLOW_RUN, JobIdentity, Supervisor, WaitPolicy
from prefect_nemo.log_files import logs_dir
from prefect_nemo.nemo_task import home_dir, is_task_object
from prefect_nemo.redaction import Redactor
from prefect_nemo.tasks._blocks import ClusterLike, resolve_cluster
from prefect_nemo.tasks._run import RunContext, current_run
from prefect_nemo.tasks.experiments import Experiment
from prefect_nemo.tasks.reporting import JobReporter, dry_run_reported

#: What a job may wait for: a job (its handle, or its result once ended) or an upstream
#: experiment (the Experiment that start_experiment returned: the jobs its upstreams ran).
Upstream = JobHandle | JobResult | Experiment


def wait_policy(
    block: ClusterBlock,
    *,
    timeout_s: float | None,
    queue_timeout_s: float | None,
    stream_logs: bool,
    spec: JobSpec | None = None,
    log_dir: Path | None = None,
) -> WaitPolicy:
    """How a job on this block is waited for: the job's timeouts, the block's limits.
    InvalidJobSpec for a timeout that is no number of seconds > 0 (a JobSpec checks its own;
    wait_for_job's arrive here unchecked). A spec brings its stall watch."""
    if spec is not None and spec.stall_after_s is not None and not stream_logs:
        raise InvalidJobSpec(
            "JobSpec.stall_after_s: a stall is a silent log, and this job's log is not "
            "streamed: pass stream_logs=True (run_jobs streams none unless asked)"
        )
    for name, value in (("timeout_s", timeout_s), ("queue_timeout_s", queue_timeout_s)):
        if value is not None and not (
            isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < math.inf
        ):
            raise InvalidJobSpec(
                f"{name}: expected seconds > 0 (or None: wait as long as it takes), got {value!r}"
            )
    return WaitPolicy(
        timeout_s=timeout_s,
        queue_timeout_s=queue_timeout_s,
        stream_logs=stream_logs,
        max_poll_interval_s=block.max_poll_interval_s,
        unreachable_budget_s=block.unreachable_budget_s,
        stop_timeout_s=block.stop_timeout_s,
        stall_after_s=spec.stall_after_s if spec is not None else None,
        stop_on_stall=spec.stop_on_stall if spec is not None else False,
        shape=spec.shape(block.default_shape()) if spec is not None else None,
        gpu_hour_price=block.gpu_hour_price,
        log_dir=log_dir,
        # only a task that has the spec can submit another attempt (wait_for_job cannot)
        recovery=(spec.recovery or block.recovery) if spec is not None else None,
    )


def _supervisor(
    spec: JobSpec | None,
    cluster: ClusterLike,
    *,
    timeout_s: float | None = None,
    queue_timeout_s: float | None = None,
    stream_logs: bool = True,
) -> tuple[ClusterBlock, RunContext, Supervisor]:
    """The cluster block, the run context and the supervisor of one task call; bad input fails
    here, before any request (and before any wait for upstream jobs). A spec brings its own
    timeouts."""
    if spec is not None and not isinstance(spec, JobSpec):
        raise InvalidJobSpec(
            f"spec: expected a JobSpec or a NeMo-Run task, got {type(spec).__name__}"
        )
    block = resolve_cluster(cluster)
    backend = block.backend()
    secrets = list(backend.secrets)
    if spec is not None:
        backend.validate(spec)
        secrets += spec.secret_values()
    redact = Redactor(secrets)
    run = current_run()
    policy = wait_policy(
        block,
        timeout_s=spec.timeout_s if spec is not None else timeout_s,
        queue_timeout_s=spec.queue_timeout_s if spec is not None else queue_timeout_s,
        stream_logs=stream_logs,
        spec=spec,
        log_dir=logs_dir(run.flow_run_id),
    )
    reporter = JobReporter(run, redact, log_storage=block.log_storage)
    supervisor = Supervisor(backend, policy, reporter, run.interrupted, redact)
    return block, run, supervisor


def _track_cluster(supervisor: Supervisor, run: RunContext) -> None:
    """A cluster the backend creates for this run (Ray on Lepton) goes when the run ends."""
    backend = supervisor.backend
    if run.flow_run_id and isinstance(backend, RunScopedCluster):
        teardown = backend.teardown_for(run.flow_run_id)
        if teardown is not None:
            run.track(f"cluster {backend.cluster}", teardown, also_on_success=True)


def _identity(spec: JobSpec, run: RunContext) -> JobIdentity:
    """The job's identity in this run: stable per experiment (or flow run) and job name."""
    metadata = {META_FLOW_RUN: run.flow_run_id or ""}
    if run.experiment:
        metadata[META_EXPERIMENT] = run.experiment
    key = spec.name or (spec.task.key if spec.task else None) or run.task_key or "job"
    return JobIdentity(run.scope, key, run.readable, metadata)


def job_spec(spec: JobSpec | Any) -> JobSpec:
    """The spec itself, or a NeMo-Run task (run.Partial / run.Script) as JobSpec(task=...),
    shipped with the directory its function's module was imported from (a module written
    next to a notebook): a notebook cell may pass the task alone."""
    if not is_task_object(spec):
        return spec
    return JobSpec(task=spec, working_dir=home_dir(spec))


# ---------------------------------------------------------------------------------------------
# Dependencies


def _after(supervisor: Supervisor, after: Iterable[Upstream], run: RunContext) -> Supervisor:
    """The supervisor to submit with once `after` allows: native dependencies (Slurm afterok)
    for upstream jobs the scheduler can wait for, a wait here for the others; DependencyFailed
    if an upstream job failed. Nothing is submitted before this returns."""
    backend = supervisor.backend
    native_backend = backend if isinstance(backend, NativeDependencies) else None
    handles: list[JobHandle] = []
    for item in after:
        if isinstance(item, JobResult):
            if not item.succeeded:
                raise DependencyFailed(_upstream_failed(item.handle, item.state, item.message))
        elif isinstance(item, JobHandle):
            handles.append(item)
        elif isinstance(item, Experiment):
            # start_experiment saw the upstream flow runs COMPLETED; jobs they left running on
            # this cluster are waited for natively where the scheduler can. Their ended jobs
            # (a failed optional eval, say) were theirs to judge, not a reason to fail here.
            if native_backend is not None:
                jobs = [h for r in item.upstream for h in native_backend.experiment_jobs(r.name)]
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
        h for h in handles if native_backend is not None and native_backend.depends_natively_on(h)
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
        run.logger.info(f"waiting for upstream job {handle.job_id} before submitting")
        status = supervisor.wait_for_upstream(handle)
        if status.state is not JobState.SUCCEEDED:
            raise DependencyFailed(_upstream_failed(handle, status.state, status.message))
    if not native:
        return supervisor
    run.logger.info(
        "submitting after " + ", ".join(h.job_id for h in native) + " (native dependency)"
    )
    assert native_backend is not None
    return dataclasses.replace(supervisor, backend=native_backend.after(native))


def _upstream_failed(handle: JobHandle, state: JobState, message: str) -> str:
    return (
        f"upstream job {handle.job_id} ended {state.value}"
        + (f": {message}" if message else "")
        + "; this job was not submitted"
    )


# ---------------------------------------------------------------------------------------------
# The concurrency cap


def _cluster_limit(block: ClusterBlock, backend: Backend) -> str | None:
    """The name of the cluster's global concurrency limit, made to hold the block's cap (None
    when the block sets no cap)."""
    if not block.max_concurrent_jobs:
        return None
    name = block.concurrency_limit_name(backend)
    _ensure_limit(name, block.max_concurrent_jobs)
    return name


@contextmanager
def _cluster_slot(block: ClusterBlock, backend: Backend) -> Iterator[None]:
    """Hold one slot of the cluster's global concurrency limit while the job runs."""
    name = _cluster_limit(block, backend)
    if name is None:
        yield
        return
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
# The tasks


@task(name="run_job", cache_policy=NO_CACHE)
def run_job(
    spec: JobSpec | Any,
    cluster: ClusterLike = None,
    *,
    stream_logs: bool = True,
    after: Iterable[Upstream] = (),
    dry_run: bool = False,
) -> JobResult | DryRun:
    """Run a job to the end: submit (or re-attach), stream its logs, return its JobResult.

    Raises JobFailed / JobStopped / JobTimedOut (with `.result`) unless it succeeded; stops the
    job if the task is cancelled or crashes. Holds a slot of the cluster's concurrency cap.
    `after`: upstream jobs or experiments to wait for first (natively where the scheduler can,
    e.g. Slurm afterok; else here); DependencyFailed if one failed. `dry_run`: return what
    would be sent (a DryRun: manifests, request body or script, secrets masked) and send
    nothing. `spec` may be a NeMo-Run task (run.Partial / run.Script), run as JobSpec(task=...).
    """
    spec = job_spec(spec)
    block, run, supervisor = _supervisor(spec, cluster, stream_logs=stream_logs)
    identity = _identity(spec, run)
    if dry_run:
        return dry_run_reported(run, supervisor.render(spec, identity))
    _track_cluster(supervisor, run)
    supervisor = _after(supervisor, after, run)
    with _cluster_slot(block, supervisor.backend):
        return supervisor.run(spec, identity)


@task(name="submit_job", cache_policy=NO_CACHE)
def submit_job(
    spec: JobSpec | Any,
    cluster: ClusterLike = None,
    *,
    after: Iterable[Upstream] = (),
    dry_run: bool = False,
) -> JobHandle | DryRun:
    """Submit a job (or re-attach to the one this run already submitted) and return its handle.

    The concurrency cap is not held across tasks: use run_job where the cap matters. `after`
    as in run_job: with native dependencies the job is queued at once and starts only after
    its upstream jobs succeed. `dry_run` and a NeMo-Run task as `spec` as in run_job.
    """
    spec = job_spec(spec)
    _, run, supervisor = _supervisor(spec, cluster)
    identity = _identity(spec, run)
    if dry_run:
        return dry_run_reported(run, supervisor.render(spec, identity))
    _track_cluster(supervisor, run)
    supervisor = _after(supervisor, after, run)
    return supervisor.submit(spec, identity).handle


@task(name="wait_for_job", cache_policy=NO_CACHE)
def wait_for_job(
    handle: JobHandle,
    cluster: ClusterLike = None,
    *,
    timeout_s: float | None = None,
    queue_timeout_s: float | None = None,
    stream_logs: bool = True,
) -> JobResult:
    """Wait for a submitted job to end; stop it on timeout (`timeout_s` of activity,
    `queue_timeout_s` of a wait in its scheduler's queue), cancellation or crash."""
    _, _, supervisor = _supervisor(
        None, cluster, timeout_s=timeout_s, queue_timeout_s=queue_timeout_s,
        stream_logs=stream_logs,
    )  # fmt: skip
    return supervisor.wait(handle)


@task(name="stop_job", cache_policy=NO_CACHE)
def stop_job(handle: JobHandle, cluster: ClusterLike = None) -> JobResult:
    """Stop a job and return its state once the cluster confirms it ended."""
    _, _, supervisor = _supervisor(None, cluster)
    return supervisor.stop(handle)
