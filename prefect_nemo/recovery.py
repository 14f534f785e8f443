"""Recovery by failure class: what an ended attempt failed of, and whether its policy tries it
again. Pure: no Prefect, no engine (the lifecycle runs the attempts, backends say what they
know in `JobStatus.failure`).

The classes and what they cost (SkyPilot's managed jobs are the model: preemptions never use up
the error budget, named exit codes always recover):
- preempted, infrastructure: the cluster's fault; resubmitted up to max_restarts_on_preemption;
- application: the job's own; resubmitted when its exit code is named (recover_on_exit_codes,
  uncounted) or while max_restarts_on_errors lasts, else the task fails with its log tail;
- spec: what was asked cannot run; never resubmitted.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from prefect_nemo.jobs import (
    Attempt,
    Failure,
    FailureClass,
    JobResult,
    JobState,
    JobStatus,
    RecoveryPolicy,
)

#: How many of a failed log's last lines the infrastructure patterns read (a collective's
#: error comes a traceback or two before the end)
CLASSIFY_LINES = 200
REASON_CHARS = 300

#: The environment each attempt gets, so a job can resume from its previous attempt's checkpoint
ENV_ATTEMPT = "PREFECT_NEMO_ATTEMPT"
ENV_PREVIOUS_JOB_ID = "PREFECT_NEMO_PREVIOUS_JOB_ID"


def classify(status: JobStatus, log: str, patterns: Iterable[str]) -> Failure:
    """The failure of a FAILED attempt: what its engine says where that is the cluster's fault
    or a bad spec; else infrastructure where its log's last lines match a pattern (NCCL, Xid,
    a Ray node's death: the code's exit code only passes the news on); else the engine's
    application failure, else application by its exit code."""
    said = status.failure
    if said is not None and said.kind is not FailureClass.APPLICATION:
        return said
    line = _last_match(log, patterns)
    if line is not None:
        return Failure(kind=FailureClass.INFRASTRUCTURE, reason=line[:REASON_CHARS])
    if said is not None:
        return said
    if status.exit_code is not None:
        reason = f"exit code {status.exit_code}"
    else:
        reason = status.message.strip().splitlines()[0] if status.message.strip() else "failed"
    return Failure(kind=FailureClass.APPLICATION, reason=reason[:REASON_CHARS])


def _last_match(log: str, patterns: Iterable[str]) -> str | None:
    compiled = [re.compile(p) for p in patterns]
    if not compiled:
        return None
    for line in reversed(log.splitlines()[-CLASSIFY_LINES:]):
        if any(p.search(line) for p in compiled):
            return line.strip()
    return None


@dataclass
class Recovery:
    """The attempts of one job and its policy's budgets: told each failed attempt, it says
    whether (and after how long) the next one is submitted."""

    policy: RecoveryPolicy
    attempts: list[Attempt] = field(default_factory=list)
    cluster_restarts: int = 0  # preempted + infrastructure
    error_restarts: int = 0  # application, outside recover_on_exit_codes

    def seed(self, earlier: Iterable[JobStatus]) -> None:
        """Count the attempts a re-attach found already ended (a crash in the middle of a
        recovery resumes it): each FAILED one was followed by another, so it used its budget."""
        for status in earlier:
            failure = None
            if status.state is JobState.FAILED:
                failure = classify(status, "", self.policy.infrastructure_logs)
                self._count(failure, status.exit_code)
            self.attempts.append(_attempt(status.job_id, status, failure))

    def retry_after(self, result: JobResult) -> float | None:
        """Record the failed attempt (classified: `result.failure`); the seconds to wait
        before the next one, or None when the policy gives up (its failure stands)."""
        failure = result.failure or Failure(kind=FailureClass.APPLICATION, reason="failed")
        self.attempts.append(_attempt(result.handle.job_id, result, failure))
        if not self._allowed(failure, result.exit_code):
            return None
        restarts = self.cluster_restarts + self.error_restarts
        self._count(failure, result.exit_code)
        return float(min(self.policy.backoff_s * 2**restarts, self.policy.max_backoff_s))

    def refusal(self, result: JobResult) -> str:
        """Why a failed attempt is not tried again, for its error message (with the knob
        that would change it)."""
        policy, kind = self.policy, result.failure.kind if result.failure else None
        if kind is FailureClass.SPEC:
            return "a spec error is never retried: fix the job and run it again"
        if kind in (FailureClass.PREEMPTED, FailureClass.INFRASTRUCTURE):
            return (
                f"the cluster failed it {self.cluster_restarts + 1} times, "
                f"max_restarts_on_preemption={policy.max_restarts_on_preemption}"
            )
        used = (
            f"used all {policy.max_restarts_on_errors} of max_restarts_on_errors"
            if policy.max_restarts_on_errors
            else "max_restarts_on_errors=0"
        )
        return (
            f"an application error, {used}, and its exit code is not in "
            f"recover_on_exit_codes={list(policy.recover_on_exit_codes)} (JobSpec.recovery)"
        )

    def _allowed(self, failure: Failure, exit_code: int | None) -> bool:
        policy = self.policy
        if failure.kind is FailureClass.SPEC:
            return False
        if failure.kind is not FailureClass.APPLICATION:
            return self.cluster_restarts < policy.max_restarts_on_preemption
        if exit_code is not None and exit_code in policy.recover_on_exit_codes:
            return True
        return self.error_restarts < policy.max_restarts_on_errors

    def _count(self, failure: Failure, exit_code: int | None) -> None:
        if failure.kind is FailureClass.APPLICATION:
            if exit_code is None or exit_code not in self.policy.recover_on_exit_codes:
                self.error_restarts += 1
        elif failure.kind is not FailureClass.SPEC:
            self.cluster_restarts += 1


def _attempt(job_id: str, ended: JobStatus | JobResult, failure: Failure | None) -> Attempt:
    """One ended attempt as JobResult.attempts lists it (from a status or a result)."""
    return Attempt(
        job_id=job_id,
        state=ended.state,
        failure=failure,
        exit_code=ended.exit_code,
        start_time=ended.start_time,
        end_time=ended.end_time,
    )


def attempt_env(attempt: int, previous_job_id: str | None) -> dict[str, str]:
    """What each attempt finds in its environment: its number (0 first) and, from the second
    on, the id of the attempt before it (its checkpoint's owner)."""
    env = {ENV_ATTEMPT: str(attempt)}
    if previous_job_id is not None:
        env[ENV_PREVIOUS_JOB_ID] = previous_job_id
    return env
