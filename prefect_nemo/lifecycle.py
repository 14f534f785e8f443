"""The backend-neutral life of a job: submit-or-attach, wait, stop-and-confirm. No Prefect here;
tasks.py adds logging, events, artifacts and cancellation on top."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from prefect_nemo import names
from prefect_nemo.errors import (
    AuthenticationFailed,
    BackendUnavailable,
    JobAlreadyExists,
    JobInterrupted,
    JobTimedOut,
    PrefectNemoError,
    StopNotConfirmed,
)
from prefect_nemo.jobs import Backend, JobHandle, JobSpec, JobState, JobStatus
from prefect_nemo.watcher import ClusterWatcher

# Metadata keys written on every job (string values: Ray requires them).
META_KEY = "prefect_nemo.key"
META_SPEC = "prefect_nemo.spec"
META_FLOW_RUN = "prefect_nemo.flow_run_id"
MAX_ATTEMPTS = 100


@dataclass(frozen=True)
class Submission:
    """What submit_or_attach did: the handle, whether it attached, and any drift it saw."""

    handle: JobHandle
    attached: bool
    status: JobStatus | None = None
    drift: str | None = None


def submit_or_attach(
    backend: Backend,
    spec: JobSpec,
    *,
    scope: str,
    key: str,
    readable: str = "",
    metadata: dict[str, str] | None = None,
) -> Submission:
    """Submit the job for (scope, key) unless it already exists; then attach to it.

    A job that ended FAILED or STOPPED is an attempt that is over: the next attempt gets the
    next id (`-r1`, `-r2`, ...), so a retry really retries. A live or SUCCEEDED job is attached
    to, never submitted twice: the cluster refuses a taken id (JobAlreadyExists), then we look.
    """
    fingerprint = spec.fingerprint()
    meta = {**(metadata or {}), META_KEY: f"{scope}/{key}", META_SPEC: fingerprint}
    for attempt in range(MAX_ATTEMPTS):
        job_id = names.job_id(
            scope, key, readable=readable, attempt=attempt, max_len=backend.max_job_id_len
        )
        try:  # the common case is a new id: submit first, look up only when it is taken
            return Submission(backend.submit(spec, job_id, meta), attached=False)
        except JobAlreadyExists:
            status = backend.find(job_id)
        if status is None:
            raise BackendUnavailable(f"job '{job_id}' is reported as existing but cannot be found")
        if status.state in (JobState.FAILED, JobState.STOPPED):
            continue
        seen = status.metadata.get(META_SPEC)
        drift = (
            f"job '{job_id}' was submitted with a different spec (fingerprint {seen}, now "
            f"{fingerprint}); attached to the existing job. Give the job a new name (or a new "
            "experiment) to run the changed spec."
            if seen and seen != fingerprint
            else None
        )
        return Submission(backend.handle(job_id), attached=True, status=status, drift=drift)
    raise PrefectNemoError(
        f"{MAX_ATTEMPTS} attempts of '{scope}/{key}' already failed: use a new job name"
    )


def wait_until_terminal(
    watcher: ClusterWatcher,
    handle: JobHandle,
    *,
    timeout_s: float | None = None,
    on_change: Callable[[JobStatus], None] = lambda status: None,
    interrupted: Callable[[], bool] = lambda: False,
    tick_s: float = 1.0,
) -> JobStatus:
    """Block until the job is terminal, calling on_change once per observed change.

    The timeout counts from the job's start on the cluster, so re-attaching after a crash does
    not extend it. Raises JobTimedOut (the caller stops the job), JobInterrupted when
    `interrupted()` turns true (the caller is shutting down), or BackendUnavailable.
    """
    waited_from = datetime.now(UTC)
    seen: JobStatus | None = None
    with watcher.watching(handle.job_id):
        while True:
            # Bounded waits keep the thread responsive to signals (Prefect's cancellation).
            status = watcher.next_status(handle.job_id, seen, timeout_s=tick_s)
            if status is not None and status != seen:
                seen = status
                on_change(status)
            if seen is not None and seen.state.is_terminal():
                return seen
            if interrupted():
                raise JobInterrupted(f"stopped waiting for job '{handle.job_id}': shutting down")
            started = (seen.start_time if seen else None) or waited_from
            if timeout_s is not None and (datetime.now(UTC) - started).total_seconds() > timeout_s:
                raise JobTimedOut(
                    f"job '{handle.job_id}' ran past its timeout of {timeout_s:g}s: stopping it"
                )


def stop_and_confirm(
    backend: Backend, job_id: str, *, timeout_s: float = 60.0, poll_s: float = 0.25
) -> JobStatus | None:
    """Stop the job and return its terminal status once the cluster confirms it.

    The stop request is re-sent every round: Ray accepts a stop on a PENDING job but acts on it
    only once the job is scheduled. Transient outages are retried until the deadline. Raises
    StopNotConfirmed if the job is still live at the deadline.
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
        except AuthenticationFailed:
            raise  # rejected credentials do not heal by waiting: fail now, not at the deadline
        except BackendUnavailable as exc:
            last_error = exc
        if time.monotonic() >= deadline:
            state = last.state.value if last else "unknown"
            hint = (
                " Ray stops a PENDING job only once it gets resources; the stop stays queued."
                if last and last.state is JobState.PENDING
                else ""
            )
            raise StopNotConfirmed(
                f"job '{job_id}' on {backend.cluster} was asked to stop but is still {state} "
                f"after {timeout_s:g}s.{hint}"
                + (f" Last error: {last_error}" if last_error else "")
            )
        time.sleep(poll_s)
        poll_s = min(poll_s * 1.5, 2.0)
