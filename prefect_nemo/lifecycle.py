"""The backend-neutral life of a job: submit-or-attach, wait (streaming its log), and stop it
whenever the wait ends any other way than with the job ended. No Prefect here.

A caller hands a job to a `Supervisor` once (`run`, or `submit` + `wait`, or `stop`); what
happens is pushed to a `JobObserver` as it happens (submitted, live, each state change, each log
line, ended), so the Prefect side (tasks/) only reports and keeps teardown hooks: it is never
called back for a decision.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Protocol

from prefect_nemo import names
from prefect_nemo.errors import (
    AuthenticationFailed,
    BackendClosed,
    BackendUnavailable,
    JobAlreadyExists,
    JobFailed,
    JobInterrupted,
    JobStalled,
    JobStopped,
    JobTimedOut,
    PrefectNemoError,
    StopNotConfirmed,
)
from prefect_nemo.jobs import (
    INFRASTRUCTURE_LOGS,
    Backend,
    DryRun,
    EngineProgress,
    Failure,
    JobHandle,
    JobResult,
    JobSpec,
    JobState,
    JobStatus,
    RecoveryPolicy,
)
from prefect_nemo.jobs import META_FLOW_RUN as META_FLOW_RUN  # every job's metadata keys,
from prefect_nemo.jobs import META_KEY as META_KEY  # re-exported where callers look for them
from prefect_nemo.jobs import META_SPEC as META_SPEC
from prefect_nemo.log_files import LogFile
from prefect_nemo.logs import LogFollower, log_pump
from prefect_nemo.recovery import Recovery, attempt_env, classify
from prefect_nemo.redaction import Redactor
from prefect_nemo.report import Report, parse
from prefect_nemo.usage import JobShape, JobUsage, measure
from prefect_nemo.watcher import ClusterWatcher, JobClock, Silence, _never, watcher_for
from prefect_nemo.watcher import wait_until_terminal as wait_until_terminal  # where callers look
from prefect_nemo.watcher import wait_until_terminal_async as wait_until_terminal_async

MAX_ATTEMPTS = 100
LOG_TAIL_LINES = 40

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Submission:
    """What submit_or_attach did: the handle, whether it attached, and any drift it saw."""

    handle: JobHandle
    attached: bool
    status: JobStatus | None = None
    drift: str | None = None
    attempt: int = 0  # its number: 0, then 1 for '-r1', ...
    earlier: tuple[JobStatus, ...] = ()  # the attempts before it, found ended


@dataclass(frozen=True)
class JobIdentity:
    """Who a job is: its (scope, key) pair names it (the job id is derived from it), `readable`
    makes the id easier to read, `metadata` is written on the job (owner flow run, ...)."""

    scope: str
    key: str
    readable: str = ""
    metadata: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class WaitPolicy:
    """How a job is waited for: the cluster block's limits plus the job's own timeouts."""

    timeout_s: float | None = None
    queue_timeout_s: float | None = None
    stream_logs: bool = True
    max_poll_interval_s: float = 2.0
    unreachable_budget_s: float = 120.0
    stop_timeout_s: float = 60.0
    stall_after_s: float | None = None
    stop_on_stall: bool = False
    shape: JobShape | None = None  # the GPUs the job holds (its spec's); None: unknown
    gpu_hour_price: float | None = None  # the block's, for the job's cost
    log_dir: Path | None = None  # each job's log is saved there as <job id>.log
    recovery: RecoveryPolicy | None = None  # None: a failed attempt is not tried again


class JobObserver(Protocol):
    """Told what happens to jobs as it happens. Must not raise."""

    def submitted(
        self,
        handle: JobHandle,
        *,
        attached: bool,
        drift: str | None,
        shape: JobShape | None = None,
    ) -> None:
        """The job was submitted (or an existing one attached to); `shape`: the GPUs its spec
        holds, where known (the sweeper prices a dead run's jobs by it)."""

    def live(self, handle: JobHandle, stop: Callable[[], str]) -> None:
        """From now until `ended`, `stop()` must run if the caller goes away (it returns how
        the job ended and never raises)."""

    def changed(
        self,
        handle: JobHandle,
        status: JobStatus,
        clock: JobClock | None,
        usage: JobUsage | None = None,
    ) -> None:
        """A new observation of the job (maybe the same state again); `clock` says where its
        time went while we watched (None for a status outside a wait, e.g. a stop's); a
        terminal status of a job whose GPUs are known comes with its `usage`."""

    def log(self, handle: JobHandle, line: str) -> None:
        """One line of the job's own log (report lines go to `progress` instead)."""

    def progress(self, handle: JobHandle, report: Report) -> None:
        """A report line of the job (prefect_nemo.report), parsed; not redacted yet."""

    def stalled(self, handle: JobHandle, silent_s: float, last: Report | None) -> None:
        """The running job said nothing for its stall_after_s (once per stall)."""

    def log_saved(self, handle: JobHandle, path: Path) -> None:
        """The job's log, read to its end, is saved in `path` (redacted): told once per wait,
        before the job's terminal state, when the wait saves logs (`WaitPolicy.log_dir`)."""

    def ended(self, handle: JobHandle) -> None:
        """The wait is over: nobody needs to stop the job on the caller's behalf any more."""

    def retrying(
        self, handle: JobHandle, failure: Failure, *, next_job_id: str, attempt: int, delay_s: float
    ) -> None:
        """The failed attempt `handle` is tried again (its recovery policy said so): as
        `next_job_id`, attempt number `attempt`, after `delay_s`."""

    def unstopped(self, handle: JobHandle, message: str) -> None:
        """A stop was asked for but not confirmed (the cluster unreachable): the job may still
        run, and someone must finish the stop once the cluster answers."""


class QuietObserver:
    """An observer that reports nothing (library use outside Prefect)."""

    def submitted(
        self,
        handle: JobHandle,
        *,
        attached: bool,
        drift: str | None,
        shape: JobShape | None = None,
    ) -> None:
        """Nothing."""

    def live(self, handle: JobHandle, stop: Callable[[], str]) -> None:
        """Nothing."""

    def changed(
        self,
        handle: JobHandle,
        status: JobStatus,
        clock: JobClock | None,
        usage: JobUsage | None = None,
    ) -> None:
        """Nothing."""

    def log(self, handle: JobHandle, line: str) -> None:
        """Nothing."""

    def progress(self, handle: JobHandle, report: Report) -> None:
        """Nothing."""

    def stalled(self, handle: JobHandle, silent_s: float, last: Report | None) -> None:
        """Nothing."""

    def log_saved(self, handle: JobHandle, path: Path) -> None:
        """Nothing."""

    def ended(self, handle: JobHandle) -> None:
        """Nothing."""

    def retrying(
        self, handle: JobHandle, failure: Failure, *, next_job_id: str, attempt: int, delay_s: float
    ) -> None:
        """Nothing."""

    def unstopped(self, handle: JobHandle, message: str) -> None:
        """Nothing."""


@dataclass
class Supervisor:
    """Carries jobs through their life on one backend: submit or attach, wait, stop."""

    backend: Backend
    policy: WaitPolicy = field(default_factory=WaitPolicy)
    observer: JobObserver = field(default_factory=QuietObserver)
    interrupted: Callable[[], str | bool | None] = _never  # why the caller stops waiting
    redact: Redactor = field(default_factory=Redactor)

    @property
    def watcher(self) -> ClusterWatcher:
        """The process-wide watcher of this backend's cluster."""
        return watcher_for(
            self.backend,
            max_interval_s=self.policy.max_poll_interval_s,
            unreachable_budget_s=self.policy.unreachable_budget_s,
        )

    def run(self, spec: JobSpec, identity: JobIdentity) -> JobResult:
        """Submit (or attach) and wait, and while its recovery policy says so, submit the next
        attempt of a failed one: the JobResult, or JobFailed/JobStopped/JobTimedOut."""
        submission = self.submit(spec, identity)
        recovery = self._recovery(submission)
        while True:
            try:
                result = self.wait(submission.handle, attached=submission.attached)
            except JobFailed as exc:
                delay = self._retry_after(exc, submission, identity, recovery)
                if not self._pause(delay):
                    raise
                submission = self.submit(
                    spec, identity, check_access=False, from_attempt=submission.attempt + 1
                )
                continue
            return _with_attempts(result, recovery)

    async def run_async(
        self, identity: JobIdentity, submit: Callable[[int], Awaitable[Submission]]
    ) -> JobResult:
        """`run` on an event loop, with the caller's `submit(from_attempt)` (run_jobs' submit
        with pushback)."""
        submission = await submit(0)
        recovery = self._recovery(submission)
        while True:
            try:
                result = await self.wait_async(submission.handle, attached=submission.attached)
            except JobFailed as exc:
                delay = self._retry_after(exc, submission, identity, recovery)
                if not await self._pause_async(delay):
                    raise
                submission = await submit(submission.attempt + 1)
                continue
            return _with_attempts(result, recovery)

    def submit(
        self,
        spec: JobSpec,
        identity: JobIdentity,
        *,
        check_access: bool = True,
        from_attempt: int = 0,
    ) -> Submission:
        """Check access (unless the caller did, once for many jobs), then submit the job under
        its deterministic id or attach to it (from attempt `from_attempt` on: a recovery
        knows the ones before it ended)."""
        if check_access:
            self.backend.check_access()  # auth and reachability fail here, before any submit
        submission = submit_or_attach(
            self.backend,
            spec,
            scope=identity.scope,
            key=identity.key,
            readable=identity.readable,
            metadata=identity.metadata,
            from_attempt=from_attempt,
        )
        self.observer.submitted(
            submission.handle, attached=submission.attached, drift=submission.drift,
            shape=self.policy.shape,
        )  # fmt: skip
        return submission

    def wait(self, handle: JobHandle, *, attached: bool = False) -> JobResult:
        """Wait for the job to end, streaming its log; stop it if we leave any other way.
        Returns the result of a job that SUCCEEDED; raises JobFailed/JobStopped otherwise."""
        stop = partial(self._stop_quietly, handle)
        self.observer.live(handle, stop)
        logs = _LogStream(self, handle)
        clock = JobClock()
        final: JobStatus | None = None
        stopped = False  # set once we have stopped the job ourselves

        def on_change(status: JobStatus) -> None:
            logs.update(status)
            status = self._classified(status, logs.whole)  # its class goes into its event
            self.observer.changed(handle, status, clock, self._usage(status, clock))

        try:
            final = wait_until_terminal(
                self.watcher,
                handle,
                timeout_s=self.policy.timeout_s,
                queue_timeout_s=self.policy.queue_timeout_s,
                on_change=on_change,
                interrupted=self.interrupted,
                clock=clock,
                silence=logs.silence,
            )
        except (JobTimedOut, JobInterrupted, JobStalled) as exc:
            final, stopped = self._stop(handle, clock, logs), True
            raise self._stopped_error(
                handle, final, attached, exc, clock, logs.last_report
            ) from None
        finally:
            logs.close()
            if final is None and not stopped:  # cancelled, crashed or lost the cluster
                self._stop(handle, clock)
            self.observer.ended(handle)
        return self._outcome(handle, final, attached, logs.whole, clock)

    async def wait_async(self, handle: JobHandle, *, attached: bool = False) -> JobResult:
        """`wait` on an event loop: the wait holds no thread; what blocks (stopping, reading
        the log) runs in the loop's executor."""
        stop = partial(self._stop_quietly, handle)
        self.observer.live(handle, stop)
        logs = _LogStream(self, handle)
        clock = JobClock()
        final: JobStatus | None = None
        stopped = False

        def on_change(status: JobStatus) -> None:
            if not status.state.is_terminal():  # the end is told after its log was read
                logs.update(status)
                self.observer.changed(handle, status, clock)

        try:
            final = await wait_until_terminal_async(
                self.watcher,
                handle,
                timeout_s=self.policy.timeout_s,
                queue_timeout_s=self.policy.queue_timeout_s,
                on_change=on_change,
                interrupted=self.interrupted,
                clock=clock,
                silence=logs.silence,
            )
            await asyncio.to_thread(logs.update, final)
            told = self._classified(final, logs.whole)
            self.observer.changed(handle, told, clock, self._usage(told, clock))
        except (JobTimedOut, JobInterrupted, JobStalled) as exc:
            final, stopped = await asyncio.to_thread(self._stop, handle, clock, logs), True
            raise self._stopped_error(
                handle, final, attached, exc, clock, logs.last_report
            ) from None
        finally:
            await asyncio.to_thread(logs.close)
            if final is None and not stopped:  # cancelled, crashed or lost the cluster
                await asyncio.to_thread(self._stop, handle, clock)
            self.observer.ended(handle)
        return await asyncio.to_thread(self._outcome, handle, final, attached, logs.whole, clock)

    def render(self, spec: JobSpec, identity: JobIdentity) -> DryRun:
        """What `run`/`submit` would send for this job (its first attempt), secrets masked;
        nothing is sent, not even a request to check access."""
        job_id = names.job_id(
            identity.scope,
            identity.key,
            readable=identity.readable,
            max_len=self.backend.max_job_id_len,
        )
        metadata = job_metadata(spec, identity.scope, identity.key, identity.metadata)
        documents = self.backend.render(with_attempt(spec, 0, None), job_id, metadata)
        return DryRun(
            job_id=job_id,
            backend=self.backend.kind,
            cluster=self.backend.cluster,
            documents=self.redact.deep(documents),
        )

    def stop(self, handle: JobHandle) -> JobResult:
        """Stop the job and return how it ended once the cluster confirms it."""
        status = stop_and_confirm(self.backend, handle.job_id, timeout_s=self.policy.stop_timeout_s)
        if status is not None:
            self.observer.changed(handle, status, None)
        return self._result(handle, status, attached=False)

    def wait_for_upstream(self, handle: JobHandle) -> JobStatus:
        """Wait (without logs, timeout or stop) until an upstream job is terminal."""
        return wait_until_terminal(self.watcher, handle, interrupted=self.interrupted)

    # -- helpers --------------------------------------------------------------------------------

    def _recovery(self, first: Submission) -> Recovery | None:
        """The attempts of a job about to be waited for: those a re-attach found ended count
        against its budgets. None where failed attempts are not tried again."""
        if self.policy.recovery is None:
            return None
        recovery = Recovery(self.policy.recovery)
        recovery.seed(
            s.model_copy(update={"failure": self._redacted(s.failure)}) for s in first.earlier
        )
        return recovery

    def _retry_after(
        self,
        exc: JobFailed,
        submission: Submission,
        identity: JobIdentity,
        recovery: Recovery | None,
    ) -> float:
        """The pause before the next attempt of a failed one, told to the observer; re-raises
        `exc` (with the attempts before it, and why it is not retried) when there is none.
        Only an attempt its engine ended FAILED is tried again: a stop is someone's will."""
        result = exc.result
        if not isinstance(result, JobResult):
            raise exc
        if (
            recovery is None
            or isinstance(exc, JobStopped)
            or result.state is not JobState.FAILED
            or result.failure is None
        ):
            exc.result = _with_attempts(result, recovery)
            raise exc
        delay = recovery.retry_after(result)
        if delay is None:
            exc.result = _with_attempts(result, recovery, last_failed=True)
            exc.args = (f"{exc}\nnot retried: {recovery.refusal(result)}",)
            raise exc
        attempt = submission.attempt + 1
        self.observer.retrying(
            submission.handle,
            result.failure,
            next_job_id=names.job_id(
                identity.scope,
                identity.key,
                readable=identity.readable,
                attempt=attempt,
                max_len=self.backend.max_job_id_len,
            ),
            attempt=attempt,
            delay_s=delay,
        )
        return delay

    def _pause(self, seconds: float) -> bool:
        """Sleep between attempts, False as soon as the caller stops waiting (the failed
        attempt's error then stands: nothing runs that needs a stop)."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if self.interrupted():
                return False
            time.sleep(min(left, 0.25))
        return not self.interrupted()

    async def _pause_async(self, seconds: float) -> bool:
        """`_pause` on an event loop: a backoff holds no thread (a hundred preempted jobs
        of run_jobs would otherwise fill its executor)."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if self.interrupted():
                return False
            await asyncio.sleep(min(left, 0.25))
        return not self.interrupted()

    def _stop(
        self, handle: JobHandle, clock: JobClock | None = None, logs: _LogStream | None = None
    ) -> JobStatus | None:
        """Stop the job; once it ended, its log is read to the end (`logs`) before its
        terminal state is told, as on any other end."""
        try:
            status = stop_and_confirm(
                self.backend, handle.job_id, timeout_s=self.policy.stop_timeout_s
            )
        except Exception as exc:
            self.observer.unstopped(
                handle, self.redact(f"could not stop job {handle.job_id}: {exc}")
            )
            return None
        if logs is not None:
            logs.close()
        if status is not None:
            if clock is not None:  # its run time ends with the stop
                clock.observe(status)
            self.observer.changed(handle, status, None, self._usage(status, clock))
        return status

    def _usage(self, status: JobStatus | None, clock: JobClock | None) -> JobUsage | None:
        """What an ended job used, when its GPUs are known (None before its end): the
        engine's count where it says one, else the spec's."""
        if clock is None or status is None or not status.state.is_terminal():
            return None
        shape = status.shape or self.policy.shape
        if shape is None:
            return None
        run_s = clock.running_s()
        ran = status.state is JobState.SUCCEEDED or status.exit_code is not None
        if not run_s and ran and status.duration_s is not None:
            # never seen RUNNING (it ran between two polls): the cluster's own span stands in.
            # Seen running, our clock measures: engines mean different things by a start
            # time (Ray: the submission; Slurm: the start after the queue)
            run_s = status.duration_s
        return measure(
            shape,
            run_s=run_s,
            queue_wait_s=clock.queued_s(),
            price=self.policy.gpu_hour_price,
            wasted=status.state in (JobState.FAILED, JobState.STOPPED),
        )

    def _stopped_error(
        self,
        handle: JobHandle,
        final: JobStatus | None,
        attached: bool,
        why: JobTimedOut | JobInterrupted | JobStalled,
        clock: JobClock,
        last: Report | None = None,
    ) -> JobStopped:
        """What a wait we ended (timeout, interruption, stall) raises, once the job was
        stopped; a stall names the job's last report."""
        result = self._result(handle, final, attached, clock=clock)
        if isinstance(why, JobStalled):
            said = f"; its last report: {last.describe()}" if last else "; it never reported"
            return JobStalled(self.redact(f"{why}{said}"), result)
        if isinstance(why, JobTimedOut):  # QueueTimedOut stays one
            return type(why)(self.redact(str(why)), result)
        return JobStopped(f"job {handle.job_id} {result.state.value}: {why.reason}", result)

    def _stop_quietly(self, handle: JobHandle) -> str:
        try:
            status = stop_and_confirm(
                self.backend, handle.job_id, timeout_s=self.policy.stop_timeout_s
            )
            return status.state.value if status else "gone"
        except Exception as exc:
            message = self.redact(f"stop not confirmed: {exc}")
            self.observer.unstopped(handle, message)
            return message

    def _outcome(
        self,
        handle: JobHandle,
        final: JobStatus,
        attached: bool,
        whole_log: str | None,
        clock: JobClock,
    ) -> JobResult:
        if final.state is JobState.SUCCEEDED:
            return self._result(handle, final, attached, clock=clock)
        tail = self._log_tail(handle, whole_log) if final.state is JobState.FAILED else ""
        final = self._classified(final, whole_log if whole_log is not None else tail)
        result = self._result(handle, final, attached, log_tail=self.redact(tail), clock=clock)
        exit_code = f" (exit code {final.exit_code})" if final.exit_code is not None else ""
        why = f" [{final.failure.describe()}]" if final.failure is not None else ""
        message = self.redact(
            f"job {handle.job_id} {final.state.value}{exit_code}{why}: {final.message}".rstrip(": ")
        )
        if tail and tail.strip() not in final.message:
            message += "\n--- last log lines ---\n" + self.redact(tail)
        if final.state is JobState.STOPPED:
            raise JobStopped(message, result)
        raise JobFailed(message, result)

    def _classified(self, status: JobStatus, log: str | None) -> JobStatus:
        """A FAILED status with its failure classified (recovery.classify) from what its
        engine said and its log; any other status as it is."""
        if status.state is not JobState.FAILED:
            return status
        policy = self.policy.recovery
        patterns = policy.infrastructure_logs if policy is not None else INFRASTRUCTURE_LOGS
        failure = classify(status, log or "", patterns)
        return status.model_copy(update={"failure": self._redacted(failure)})

    def _redacted(self, failure: Failure | None) -> Failure | None:
        """The failure with its reason redacted: it comes from a log line or the engine's
        message, and goes into events, the job table, JobResult and errors."""
        if failure is None:
            return None
        return failure.model_copy(update={"reason": self.redact(failure.reason)})

    def _log_tail(self, handle: JobHandle, whole_log: str | None) -> str:
        """The last lines of the job's log, from the read already made if there was one."""
        try:
            whole = whole_log if whole_log is not None else self.backend.logs(handle.job_id)
        except Exception:
            return ""
        return "\n".join(whole.rstrip().splitlines()[-LOG_TAIL_LINES:])

    def _result(
        self,
        handle: JobHandle,
        status: JobStatus | None,
        attached: bool,
        log_tail: str = "",
        clock: JobClock | None = None,
    ) -> JobResult:
        queued = clock.queued_s() if clock is not None else 0.0
        waited = {
            "queue_wait_s": round(queued, 3) if queued else None,
            "preemptions": clock.preemptions if clock is not None else 0,
        }
        if status is None:
            return JobResult(
                handle=handle,
                state=JobState.STOPPED,
                message="stop not confirmed",
                attached=attached,
                **waited,
            )
        return JobResult(
            handle=handle,
            state=status.state,
            message=self.redact(status.message),
            start_time=status.start_time,
            end_time=status.end_time,
            exit_code=status.exit_code,
            log_tail=log_tail,
            attached=attached,
            usage=self._usage(status, clock),
            failure=status.failure if status.state is JobState.FAILED else None,
            **waited,
        )


class _LogStream:
    """A job's log while it is waited on: followed once it runs, read whole once it ended
    (its lines come before the line that says how it ended). Not streamed (run_jobs' default),
    the log of a job that failed or was stopped is still saved when the wait saves logs: read
    whole once, when it ended, into the file alone."""

    def __init__(self, supervisor: Supervisor, handle: JobHandle) -> None:
        self._supervisor = supervisor
        self._handle = handle
        self._follower: LogFollower | None = None
        self.whole: str | None = None  # the whole log, read once when the job ended
        self.last_report: Report | None = None
        self._engine_seen: EngineProgress | None = None  # the engine's progress last seen
        policy = supervisor.policy
        self._file = (
            LogFile(policy.log_dir / f"{handle.job_id}.log", supervisor.redact)
            if policy.log_dir is not None
            else None
        )
        self._ran = False  # seen running or ended: there is a log to read
        self._succeeded = False  # ended SUCCEEDED: an unstreamed log is not read
        self.silence = (
            Silence(policy.stall_after_s, self._stalled, stop=policy.stop_on_stall)
            if policy.stall_after_s is not None and policy.stream_logs
            else None
        )  # a job whose log is not followed cannot be heard: no stall watch

    def _sink(self, line: str) -> None:
        """Each line of the job's log: a report line goes to `progress` (and not into the
        log: the artifacts and events carry it), any other line to `log`; either ends a
        silence. Every line, reports too, goes to the saved log file."""
        if self._file is not None:
            self._file.write(line)
        if self.silence is not None:
            self.silence.heard()
        report = parse(line)
        if report is None:
            self._supervisor.observer.log(self._handle, line)
            return
        self.last_report = report
        self._supervisor.observer.progress(self._handle, report)

    def _stalled(self, silent_s: float) -> None:
        self._supervisor.observer.stalled(self._handle, silent_s, self.last_report)

    def _engine_progress(self, status: JobStatus) -> None:
        """The engine's own record of the job's progress (Kubeflow Trainer's trainerStatus) as a
        report, for a job whose log brings no report line. The lines win: they carry every
        step and the metrics as numbers, the engine's record a copy posted every few seconds
        with a whole percent and the values as text; taking both would make the step jump
        between the step and the percent. So once a line was read the record is ignored, and
        while the log is followed the first record waits for a second (report.py posts at
        most every 5 s: a line printed with it has been read by then)."""
        progress = status.progress
        if progress is None or progress == self._engine_seen or self.last_report is not None:
            return
        first = self._engine_seen is None
        self._engine_seen = progress
        if first and self._supervisor.policy.stream_logs:
            return
        metrics: dict[str, float] = {}
        for name, text in progress.metrics.items():
            with contextlib.suppress(ValueError):
                metrics[name] = float(text)  # "nan" and "inf" too
        total = None if progress.percent is None else 100
        report = Report(step=progress.percent, total=total, metrics=metrics, eta_s=progress.eta_s)
        self._supervisor.observer.progress(self._handle, report)

    def update(self, status: JobStatus) -> None:
        self._engine_progress(status)
        self._ran = self._ran or status.state is JobState.RUNNING or status.state.is_terminal()
        self._succeeded = status.state is JobState.SUCCEEDED
        if not self._supervisor.policy.stream_logs:
            # a failed job's log is read for its tail anyway: saved from that read; a succeeded
            # one's is not read (a read per job is ~4 API requests on KubeRay: run_jobs' budget)
            if status.state.is_terminal() and status.state is not JobState.SUCCEEDED:
                self._save_unstreamed()
            return
        backend, job_id = self._supervisor.backend, self._handle.job_id
        if status.state.is_terminal():
            # the follower sent each line once; its finish sends the rest from one full read
            # made after the end (the last lines before exit), or the whole log if none ran
            self.whole = (self._follower or LogFollower(backend, job_id, self._sink)).finish()
            self._follower = None
            self._saved()
        elif self._follower is None and status.state is JobState.RUNNING:
            watcher = self._supervisor.watcher
            self._follower = log_pump.follow(
                backend,
                job_id,
                self._sink,
                is_done=lambda: (s := watcher.latest(job_id)) is None or s.state.is_terminal(),
            )

    def close(self) -> None:
        if self._follower is not None:
            self._follower.finish()
            self._follower = None
        if not self._supervisor.policy.stream_logs and not self._succeeded:
            self._save_unstreamed()  # a stopped job's log too, as a followed one's
        self._saved()

    def _save_unstreamed(self) -> None:
        """Save the log of a job whose log was not followed: one full read, once, kept as
        `whole` (a failed job's tail and class come from it, not from a second read)."""
        file = self._file
        if not self._ran or self.whole is not None:
            return
        try:
            self.whole = self._supervisor.backend.logs(self._handle.job_id)
        except Exception as exc:  # the cluster may be gone: an earlier wait's file stays
            log.debug("could not read the log of %s to save it: %s", self._handle.job_id, exc)
        else:
            if file is not None:
                for line in self.whole.splitlines():
                    file.write(line)
        self._saved()

    def _saved(self) -> None:
        """Close the log file once its log was read to the end and tell where it is (once;
        an earlier wait's file counts when this one read nothing)."""
        file, self._file = self._file, None
        if file is None:
            return
        file.close()
        if file.path.exists():
            self._supervisor.observer.log_saved(self._handle, file.path)


# -------------------------------------------------------------------------------------------------
# The steps, for callers that drive a backend themselves


def submit_or_attach(
    backend: Backend,
    spec: JobSpec,
    *,
    scope: str,
    key: str,
    readable: str = "",
    metadata: dict[str, str] | None = None,
    from_attempt: int = 0,
) -> Submission:
    """Submit the job for (scope, key) unless it already exists; then attach to it.

    A job that ended FAILED or STOPPED is an attempt that is over: the next attempt gets the
    next id (`-r1`, `-r2`, ...), so a retry really retries. A live or SUCCEEDED job is attached
    to, never submitted twice: the cluster refuses a taken id (JobAlreadyExists), then we look.
    Each attempt finds its number and its previous attempt's id in its environment
    (recovery.attempt_env). `from_attempt`: the attempts before it are known to have ended.
    """
    meta = job_metadata(spec, scope, key, metadata)
    fingerprint = meta[META_SPEC]
    earlier: list[JobStatus] = []

    def id_of(attempt: int) -> str:
        return names.job_id(
            scope, key, readable=readable, attempt=attempt, max_len=backend.max_job_id_len
        )

    for attempt in range(from_attempt, MAX_ATTEMPTS):
        job_id = id_of(attempt)
        previous = id_of(attempt - 1) if attempt else None
        try:  # the common case is a new id: submit first, look up only when it is taken
            handle = backend.submit(with_attempt(spec, attempt, previous), job_id, meta)
            return Submission(handle, attached=False, attempt=attempt, earlier=tuple(earlier))
        except JobAlreadyExists:
            status = backend.find(job_id)
        if status is None:
            raise BackendUnavailable(f"job '{job_id}' is reported as existing but cannot be found")
        if status.state in (JobState.FAILED, JobState.STOPPED):
            earlier.append(status)
            continue
        seen = status.metadata.get(META_SPEC)
        drift = (
            f"job '{job_id}' was submitted with a different spec (fingerprint {seen}, now "
            f"{fingerprint}); attached to the existing job. Give the job a new name (or a new "
            "experiment) to run the changed spec."
            if seen and seen != fingerprint
            else None
        )
        return Submission(
            backend.handle(job_id),
            attached=True,
            status=status,
            drift=drift,
            attempt=attempt,
            earlier=tuple(earlier),
        )
    raise PrefectNemoError(
        f"{MAX_ATTEMPTS} attempts of '{scope}/{key}' already failed: use a new job name"
    )


def with_attempt(spec: JobSpec, attempt: int, previous_job_id: str | None) -> JobSpec:
    """The spec an attempt is submitted with: its environment names the attempt (and the one
    before it). Not part of the fingerprint: every attempt is the same job."""
    env = {**spec.env, **attempt_env(attempt, previous_job_id)}
    return spec.model_copy(update={"env": env})


def _with_attempts(
    result: JobResult, recovery: Recovery | None, *, last_failed: bool = False
) -> JobResult:
    """The result with the failed attempts before it (the last recorded one is its own when
    `last_failed`)."""
    if recovery is None or not recovery.attempts:
        return result
    attempts = recovery.attempts[:-1] if last_failed else recovery.attempts
    return result.model_copy(update={"attempts": tuple(attempts)})


def job_metadata(
    spec: JobSpec, scope: str, key: str, metadata: dict[str, str] | None = None
) -> dict[str, str]:
    """The metadata written on every job: the caller's, its (scope, key) and the spec's
    fingerprint (to spot drift when attaching)."""
    return {**(metadata or {}), META_KEY: f"{scope}/{key}", META_SPEC: spec.fingerprint()}


def stop_and_confirm(
    backend: Backend, job_id: str, *, timeout_s: float = 60.0, poll_s: float = 0.25
) -> JobStatus | None:
    """Stop the job and return its terminal status once the cluster confirms it.

    The stop request is re-sent every round: Ray accepts a stop on a PENDING job but acts on it
    only once the job is scheduled. Transient outages are retried until the deadline. Raises
    StopNotConfirmed if the job is still live at the deadline, and at once when the cluster
    rejects our credentials or the backend was closed.
    """
    deadline = time.monotonic() + timeout_s
    last: JobStatus | None = None
    last_error: Exception | None = None
    while True:
        try:
            last = backend.find(job_id)
            if last is None or last.state.is_terminal():
                return last
            backend.request_stop(job_id)
        except (AuthenticationFailed, BackendClosed) as exc:  # asking again cannot help
            raise StopNotConfirmed(
                f"job '{job_id}' on {backend.cluster} could not be stopped: {exc}"
            ) from None
        except BackendUnavailable as exc:
            last_error = exc
        if time.monotonic() >= deadline:
            state = last.state.value if last else "unknown"
            hint = (
                " Ray stops a PENDING job only once it gets resources; the stop stays queued."
                if last and last.state.is_waiting() and backend.kind == "ray-jobs"
                else ""
            )
            raise StopNotConfirmed(
                f"job '{job_id}' on {backend.cluster} was asked to stop but is still {state} "
                f"after {timeout_s:g}s.{hint}"
                + (f" Last error: {last_error}" if last_error else "")
            )
        time.sleep(poll_s)
        poll_s = min(poll_s * 1.5, 2.0)
