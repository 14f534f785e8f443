"""One exception hierarchy for every backend: catch `PrefectNemoError` to catch them all."""

from __future__ import annotations


class PrefectNemoError(Exception):
    """Base class of every error raised by prefect-nemo."""


class InvalidJobSpec(PrefectNemoError, ValueError):
    """The job or cluster configuration is wrong; nothing was submitted.

    Messages name the field and the fix.
    """


class BackendUnavailable(PrefectNemoError):
    """The cluster could not be reached (or kept answering errors) within the retry budget."""


class Throttled(BackendUnavailable):
    """The cluster pushed back (HTTP 429/503, a scheduler's submit limit): slow down and retry.

    `retry_after_s`: how long the cluster asked us to wait (Retry-After), when it said.
    """

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class AuthenticationFailed(BackendUnavailable):
    """The cluster rejected our credentials (missing or wrong token)."""


class BackendClosed(BackendUnavailable):
    """The backend was closed (its watches stopped): nothing more can be asked of it."""


class JobFailed(PrefectNemoError):
    """The job ran and ended in failure."""

    def __init__(self, message: str, result: object | None = None) -> None:
        super().__init__(message)
        self.result = result


class JobStopped(JobFailed):
    """The job was stopped (by us on timeout or cancellation, or by someone else)."""


class JobTimedOut(JobStopped):
    """The job exceeded its timeout and was stopped."""


class QueueTimedOut(JobTimedOut):
    """The job waited in its scheduler's queue past `queue_timeout_s` and was removed from it;
    the message names the queue and the scheduler's reason."""


class JobStalled(JobStopped):
    """The job ran but said nothing (no report, no log line) for its `stall_after_s`, and
    `stop_on_stall` asked for it to be stopped; the message names the job, how long it was
    silent and its last report."""


class JobAlreadyExists(PrefectNemoError):
    """Submit found the job id taken (a concurrent submitter won the race): attach instead."""


class JobInterrupted(JobStopped):
    """Waiting was interrupted: the flow run is being cancelled, or cannot go on (`reason`)."""

    def __init__(self, job_id: str, reason: str) -> None:
        super().__init__(f"stopped waiting for job '{job_id}': {reason}")
        self.reason = reason


class StopNotConfirmed(PrefectNemoError):
    """A stop was requested but the job did not reach a terminal state in time."""


class DependencyFailed(PrefectNemoError):
    """An upstream experiment this flow depends on failed, crashed or was cancelled."""


class DependencyNotFound(PrefectNemoError):
    """An upstream experiment this flow depends on does not exist."""
