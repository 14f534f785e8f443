"""run_jobs: many jobs from one flow run, each its own `run_job` task run, in a bounded window.

Why not `run_job.submit` a thousand times: Prefect's default task runner gives every submitted
task a thread (no limit), and each of those threads sits in its job's wait, so 1,000 jobs hold
1,000 threads whose wakeups all contend for the one watcher lock. Here every job is an async
`run_job` task run on ONE event loop that run_jobs owns for the length of the call: its wait
awaits the cluster's watcher, which wakes only the waiter whose job changed, and holds no
thread; what blocks (submit, stop, reading a log) runs in a small executor. Each job keeps its
own task run, logs, state and events; cancellation, timeout and crash stop every job the same
way run_job does (the run's stop hooks and cancel watch, the wait's own stop).

The window: at most `max_in_flight` jobs are submitted and not yet ended; a task run starts
only once its job has a slot. When the cluster pushes back (`Throttled`: HTTP 429/503), the
window halves and the submit is retried after the wait the cluster asked for (or a backoff);
every job submitted afterwards grows it by one again, up to `max_in_flight`.

Progress: one progress artifact (k/N done; how many of the rest run, wait in a queue, or are on
their way) and the run's one job table, rewritten in place.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.concurrency.asyncio import concurrency
from prefect.context import AsyncClientContext

from prefect_nemo.errors import InvalidJobSpec, JobFailed, JobStopped, Throttled
from prefect_nemo.jobs import JobHandle, JobResult, JobSpec, JobState, JobStatus
from prefect_nemo.lifecycle import JobIdentity, Submission, Supervisor
from prefect_nemo.log_files import logs_dir
from prefect_nemo.redaction import Redactor
from prefect_nemo.tasks._blocks import ClusterLike, resolve_cluster
from prefect_nemo.tasks._outbox import outbox
from prefect_nemo.tasks._run import RunContext, api_outage_budget_s, current_run
from prefect_nemo.tasks.artifacts import RunProgress
from prefect_nemo.tasks.jobs import (
    Upstream,
    _after,
    _cluster_limit,
    _identity,
    _track_cluster,
    job_spec,
    wait_policy,
)
from prefect_nemo.tasks.reporting import JobReporter, say
from prefect_nemo.usage import JobUsage
from prefect_nemo.watcher import JobClock

T = TypeVar("T")

DEFAULT_MAX_IN_FLIGHT = 256
BLOCKING_THREADS = 8  # submits, stops and log reads in flight at once (they are short)
MAX_BACKOFF_S = 30.0

_progress = RunProgress("jobs ended")


class _Window:
    """At most `limit` jobs in flight; the limit halves on pushback and grows back by one per
    accepted submit, up to `most`."""

    def __init__(self, most: int) -> None:
        self.most = most
        self.limit = most
        self.in_flight = 0
        self._cond = asyncio.Condition()

    async def acquire(self) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: self.in_flight < self.limit)
            self.in_flight += 1

    async def release(self) -> None:
        async with self._cond:
            self.in_flight -= 1
            self._cond.notify_all()

    def shrink(self) -> int:
        self.limit = max(1, self.limit // 2)
        return self.limit

    async def grow(self) -> None:
        async with self._cond:
            if self.limit < self.most:
                self.limit += 1
                self._cond.notify_all()


class _Settler:
    """What a job's end waits for before its task run ends (`outbox.settle`: its reports reach
    the API first, and through an outage its result waits for the API), on one thread for all
    the jobs of the batch: a job that ends while a settle runs waits for the next one, so a
    thousand ends cost a few settles and never block the loop."""

    def __init__(self) -> None:
        self._lock = asyncio.Lock()
        self._started = 0

    async def settle(self) -> None:
        wanted = self._started + 1  # a settle that starts after this call
        async with self._lock:
            if self._started >= wanted:  # one started after the call and has ended
                return
            self._started += 1
            await asyncio.to_thread(outbox.settle, api_outage_budget_s())


class _Batch:
    """One run_jobs call: its specs, the one backend they share, the window, the progress."""

    def __init__(
        self,
        specs: list[JobSpec],
        block: Any,
        run: RunContext,
        *,
        max_in_flight: int,
        stream_logs: bool,
    ) -> None:
        self.specs = specs
        self.block = block
        self.backend = block.backend()  # ONE backend: one API client, one set of informers
        self.run = run
        self.stream_logs = stream_logs
        self.window = _Window(max_in_flight)
        secrets = list(self.backend.secrets) + [v for s in specs for v in s.secret_values()]
        self.redact = Redactor(secrets)
        self.done = 0
        self.states: dict[str, JobState] = {}  # each job's latest state
        self.counts: Counter[JobState] = Counter()  # ... counted (the progress' detail)
        self._states_lock = threading.Lock()  # a stop's status comes from an executor thread
        self.settler = _Settler()
        self.limit_name: str | None = None  # the cluster's concurrency cap (run_job's), if set

    def validate(self) -> None:
        """Every spec checked before anything is sent (the first bad one names itself)."""
        for i, spec in enumerate(self.specs):
            try:
                self.backend.validate(spec)
            except InvalidJobSpec as exc:
                raise InvalidJobSpec(f"specs[{i}] ({spec.name}): {exc}") from None

    async def run_all(self) -> list[JobResult | BaseException]:
        """Every job through its own task run, at most the window's limit in flight."""
        loop = asyncio.get_running_loop()
        loop.set_default_executor(
            ThreadPoolExecutor(BLOCKING_THREADS, thread_name_prefix="prefect-nemo-jobs")
        )
        await asyncio.to_thread(self.backend.check_access)  # once, not once per job
        self.report_progress()
        # one Prefect client on this loop for every task run (else each makes its own)
        async with AsyncClientContext.get_or_create():
            outcomes = await asyncio.gather(
                *(self._one(i) for i in range(len(self.specs))), return_exceptions=True
            )
        return list(outcomes)

    async def _one(self, index: int) -> JobResult:
        await self.window.acquire()
        try:
            if reason := self.run.interrupted():
                raise JobStopped(f"job {self.specs[index].name} was not submitted: {reason}")
            return await _run_job(self, index, self.specs[index].name or "")
        finally:
            await self.window.release()
            self.done += 1
            self.report_progress()

    def report_progress(self) -> None:
        """k/N ended, and how many of the others run, wait in a queue, or are on their way."""
        with self._states_lock:
            live = self.counts.copy()
        detail = ", ".join(
            f"{live[state]} {state.value.lower()}"
            for state in (JobState.RUNNING, JobState.QUEUED, JobState.PENDING)
            if live[state]
        )
        _progress.update(self.run.flow_run_id, self.done, len(self.specs), detail)

    def changed(self, job_id: str, state: JobState) -> None:
        """A job's new state (from its reporter): the progress says it when it moved."""
        with self._states_lock:
            before = self.states.get(job_id)
            moved = before is not state
            if moved:  # kept as counts: a thousand jobs' changes cost O(1) each, not O(N)
                self.states[job_id] = state
                self.counts[state] += 1
                if before is not None:
                    self.counts[before] -= 1
        if moved:
            self.report_progress()

    async def run_one(self, index: int) -> JobResult:
        """The body of one job's task run: submit (with backpressure), then wait."""
        run = current_run()
        spec = self.specs[index]
        policy = wait_policy(
            self.block, timeout_s=spec.timeout_s, queue_timeout_s=spec.queue_timeout_s,
            stream_logs=self.stream_logs, spec=spec, log_dir=logs_dir(run.flow_run_id),
        )  # fmt: skip
        reporter = _BatchReporter(self, run, self.redact)
        supervisor = Supervisor(self.backend, policy, reporter, run.interrupted, self.redact)
        slot = (
            concurrency(self.limit_name, occupy=1, strict=True)
            if self.limit_name
            else contextlib.nullcontext()
        )
        identity = _identity(spec, run)
        async with slot:  # the cluster's cap, held from submit to end as run_job holds it
            try:
                return await supervisor.run_async(
                    identity, partial(self._submit, supervisor, spec, identity, run)
                )
            finally:
                if run.flow_run_id is not None:
                    await self.settler.settle()

    async def _submit(
        self,
        supervisor: Supervisor,
        spec: JobSpec,
        identity: JobIdentity,
        run: RunContext,
        from_attempt: int,
    ) -> Submission:
        """Submit (or attach); on pushback halve the window and retry after the asked wait.
        A retried submit is safe: the id is deterministic, a job created meanwhile is attached."""
        backoff = 0.5
        while True:
            try:
                submission = await asyncio.to_thread(
                    supervisor.submit,
                    spec,
                    identity,
                    check_access=False,
                    from_attempt=from_attempt,
                )
            except Throttled as exc:
                limit = self.window.shrink()
                delay = min(exc.retry_after_s or backoff, MAX_BACKOFF_S)
                backoff = min(backoff * 2, MAX_BACKOFF_S)
                say(
                    run,
                    logging.WARNING,
                    self.redact(
                        f"{self.backend.cluster} pushed back ({exc}): at most {limit} jobs in "
                        f"flight now; submitting {identity.key} again in {delay:g}s"
                    ),
                )
                await asyncio.sleep(delay)
                continue
            await self.window.grow()
            return submission


class _BatchReporter(JobReporter):
    """A job's reporter that also tells its batch each new state (the progress' counts)."""

    def __init__(self, batch: _Batch, run: RunContext, redact: Redactor) -> None:
        # the batch settles the outbox itself
        super().__init__(run, redact, settle=False, log_storage=batch.block.log_storage)
        self.batch = batch

    def changed(
        self,
        handle: JobHandle,
        status: JobStatus,
        clock: JobClock | None,
        usage: JobUsage | None = None,
    ) -> None:
        """Report it, and count it in the batch's progress."""
        super().changed(handle, status, clock, usage)
        self.batch.changed(handle.job_id, status.state)


@task(name="run_job", cache_policy=NO_CACHE, task_run_name="{name}")
async def _run_job(batch: _Batch, index: int, name: str) -> JobResult:
    """One job of a run_jobs call (named after the job), as its own task run."""
    return await batch.run_one(index)


def run_jobs(
    specs: Iterable[JobSpec | Any],
    cluster: ClusterLike = None,
    *,
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    stream_logs: bool = False,
    raise_on_failure: bool = True,
    after: Iterable[Upstream] = (),
) -> list[JobResult]:
    """Run many jobs from this flow, each its own `run_job` task run; return their results in
    the order of `specs` (JobSpecs, or NeMo-Run tasks as run_job takes them).

    At most `max_in_flight` jobs are submitted and not ended at a time; the window halves when
    the cluster pushes back (HTTP 429/503) and grows back as submits are accepted. A job
    without a name is named `job-<index>`; names must be unique (they make the job ids, so a
    re-run attaches). Progress is one progress artifact (k/N ended) plus the run's job table.
    `stream_logs`: follow every running job's log live (off by default: at a thousand jobs that
    is a thousand streams; a failed job's log tail is still read into its error). With
    `raise_on_failure`, JobFailed is raised after every job ended if any did not succeed (its
    `.result` holds all results); else the results of failed jobs are returned too.
    `after`: upstream jobs or experiments every job waits for, as in run_job (natively where
    the scheduler can, e.g. Slurm afterok; else here, once, before the first submit);
    DependencyFailed, and nothing submitted, if one failed. Each job holds a slot of the
    cluster's concurrency cap (`max_concurrent_jobs`) from its submit to its end, as run_job.
    """
    specs = _named(specs)
    if not isinstance(max_in_flight, int) or max_in_flight < 1:
        raise InvalidJobSpec(f"max_in_flight: expected a whole number >= 1, got {max_in_flight!r}")
    batch = _Batch(
        specs,
        resolve_cluster(cluster),
        current_run(),
        max_in_flight=max_in_flight,
        stream_logs=stream_logs,
    )
    batch.validate()
    if not specs:
        return []
    # the cluster a backend creates for this run (Ray on Lepton) goes when the run ends
    _track_cluster(Supervisor(batch.backend), batch.run)
    upstream = Supervisor(batch.backend, interrupted=batch.run.interrupted)
    batch.backend = _after(upstream, after, batch.run).backend  # afterok's backend, if native
    batch.limit_name = _cluster_limit(batch.block, batch.backend)
    outcomes = _on_own_loop(batch.run_all)
    return _results(specs, outcomes, raise_on_failure)


def _named(specs: Iterable[JobSpec | Any]) -> list[JobSpec]:
    """The specs, each with its name (its task's key, else `job-<index>`); names unique."""
    named: list[JobSpec] = []
    seen: dict[str, int] = {}
    for i, given in enumerate(specs):
        spec = job_spec(given)  # a NeMo-Run task runs as JobSpec(task=...), as in run_job
        if not isinstance(spec, JobSpec):
            raise InvalidJobSpec(
                f"specs[{i}]: expected a JobSpec or a NeMo-Run task, got {type(spec).__name__}"
            )
        if not spec.name:
            name = (spec.task.key if spec.task else None) or f"job-{i:04d}"
            spec = spec.model_copy(update={"name": name})
        assert spec.name is not None
        if spec.name in seen:
            raise InvalidJobSpec(
                f"specs[{i}].name: '{spec.name}' is also the name of specs[{seen[spec.name]}]; "
                "give every job its own name (the name makes the job id)"
            )
        seen[spec.name] = i
        named.append(spec)
    return named


def _on_own_loop(main: Callable[[], Awaitable[T]]) -> T:
    """Run main() on a new event loop in this thread (the flow's, blocked in this call anyway),
    or, called from a coroutine, in one new thread; the loop and its executor end with it."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(main())  # type: ignore[arg-type]
    context = contextvars.copy_context()
    with ThreadPoolExecutor(1, thread_name_prefix="prefect-nemo-run-jobs") as pool:
        return pool.submit(context.run, asyncio.run, main()).result()  # type: ignore[arg-type]


def _results(
    specs: list[JobSpec], outcomes: list[JobResult | BaseException], raise_on_failure: bool
) -> list[JobResult]:
    """Each job's JobResult (a failed job's from its error); raises as run_jobs documents."""
    results: list[JobResult] = []
    errors: list[BaseException] = []
    for outcome in outcomes:
        if isinstance(outcome, JobResult):
            results.append(outcome)
        elif isinstance(outcome, JobFailed) and isinstance(outcome.result, JobResult):
            results.append(outcome.result)
        else:
            errors.append(outcome)
    if errors:  # no result at all (not submitted, cluster lost): the first error, with a count
        first = errors[0]
        if len(errors) > 1:
            first.add_note(f"{len(errors) - 1} more of the {len(specs)} jobs ended with no result")
        raise first
    failed = [r for r in results if r.state is not JobState.SUCCEEDED]
    if failed and raise_on_failure:
        names = ", ".join(f"{r.handle.job_id} ({r.state.value})" for r in failed[:10])
        more = f" and {len(failed) - 10} more" if len(failed) > 10 else ""
        message = f"{len(failed)} of {len(specs)} jobs did not succeed: {names}{more}"
        raise JobFailed(message, results)
    return results
