"""A RayJob's status read as ours (pure: no request, no Prefect import).

State mapping (``jobDeploymentStatus`` first, then ``jobStatus``):

=====================  ==============================  ===========================================
jobDeploymentStatus    jobStatus                       JobState (message)
=====================  ==============================  ===========================================
ValidationFailed       any                             FAILED ("KubeRay rejected RayJob <name>:
                                                       <message>")
Failed                 STOPPED                         STOPPED ("<reason>: <message>")
Failed                 anything else                   FAILED ("<reason>: <message>", e.g.
                                                       DeadlineExceeded, AppFailed)
Complete               SUCCEEDED / FAILED / STOPPED    the same
Complete               not terminal                    FAILED (KubeRay ended it unfinished)
Suspended, Suspending  any, spec.suspend true          STOPPED; QUEUED while Kueue holds it
                                                       (a queue-name label or its Workload)
Suspended, Suspending  any, spec.suspend false         PENDING (unsuspended: KubeRay resumes it)
Running                SUCCEEDED / FAILED / STOPPED    the same (the Ray job ended; KubeRay will
                                                       say Complete next, maybe after the logs
                                                       are gone)
Running                RUNNING                         RUNNING
Running                "", PENDING                     PENDING
Retrying               any                             PENDING (a new attempt is coming)
Initializing, Waiting  any                             PENDING
"" (not yet seen)      any                             PENDING
(RayJob gone)          -                               STOPPED if we deleted it, else absent
=====================  ==============================  ===========================================

A FAILED RayJob says why (JobStatus.failure): its cluster's and submitter's pods, listed once,
and their Nodes (a lost node: infrastructure, naming it; a bad image: spec; OOMKilled:
application), else its reason (ValidationFailed: spec, DeadlineExceeded: application,
PreRunningDeadlineExceeded: infrastructure; SubmissionFailed after Ray took the job, on a
cluster that goes with the RayJob, or before, Ray saying its head had no job agent yet:
infrastructure, naming the submitter pod's last log line),
else nothing (AppFailed: the log tail tells). A failed submission that left Ray no log reads
its submitter pod's.
"""

from __future__ import annotations

import re
from typing import Any

from prefect_nemo.backends._kube_objects import parse_time, reserved_metadata
from prefect_nemo.jobs import Failure, FailureClass, JobState, JobStatus
from prefect_nemo.recovery import REASON_CHARS

_EXIT_CODE = re.compile(r"exit code (-?\d+)")
# the RayJob status.reason of a failed K8sJobMode submitter Job (rayjob_failure)
SUBMISSION_FAILED = "SubmissionFailed"
# Ray's answer (500) to a submit while its head has no job agent yet, within
# WAIT_AVAILABLE_AGENT_TIMEOUT (ray/dashboard/modules/job/job_head.py): the cluster is not ready
NO_AGENT_YET = "No available agent to submit job, please try again later"
# RayJob status.reason (KubeRay v1.6 rayjob_types.go JobFailedReason) that alone say the class;
# AppFailed does not (the log tail tells), SubmissionFailed only with Ray's jobStatus
# (rayjob_failure)
_REASON_CLASS = {
    "ValidationFailed": FailureClass.SPEC,  # the RayJob's spec was refused
    "DeadlineExceeded": FailureClass.APPLICATION,  # ran past activeDeadlineSeconds
    # never running within preRunningDeadlineSeconds: the cluster did not come up (a bad
    # image shows in its pods first)
    "PreRunningDeadlineExceeded": FailureClass.INFRASTRUCTURE,
}


def _terminal(job_status: str) -> JobState | None:
    try:
        state = JobState(job_status)
    except ValueError:
        return None
    return state if state.is_terminal() else None


def status_from_rayjob(obj: dict[str, Any]) -> JobStatus:
    """Our JobStatus from a RayJob object (the table in the module docstring)."""
    meta = obj.get("metadata") or {}
    status = obj.get("status") or {}
    name = meta.get("name", "")
    deployment = status.get("jobDeploymentStatus") or ""
    job_status = status.get("jobStatus") or ""
    message = status.get("message") or ""
    reason = status.get("reason") or ""
    if deployment == "ValidationFailed":
        state = JobState.FAILED
        message = f"KubeRay rejected RayJob {name}: {message or reason or 'invalid spec'}"
    elif deployment == "Failed":
        state = JobState.STOPPED if job_status == "STOPPED" else JobState.FAILED
        message = ": ".join(p for p in (reason, message) if p) or "KubeRay marked it Failed"
    elif deployment == "Complete":
        state = _terminal(job_status) or JobState.FAILED
        if state is JobState.FAILED and not message:
            message = f"KubeRay completed the RayJob with Ray job status '{job_status}'"
    elif deployment in ("Suspended", "Suspending"):
        # Kueue unsuspends an admitted job: until KubeRay moves on it is starting, not stopped
        resuming = (obj.get("spec") or {}).get("suspend") is not True
        state = JobState.PENDING if resuming else JobState.STOPPED
        message = "" if resuming else message or f"RayJob {name} is {deployment.lower()}"
    elif deployment == "Running":
        state = _terminal(job_status) or (
            JobState.RUNNING if job_status == "RUNNING" else JobState.PENDING
        )
    else:  # "", Initializing, Waiting, Retrying
        state = JobState.PENDING
    exit_code, failure = None, None
    if state is JobState.FAILED and (match := _EXIT_CODE.search(message)):
        exit_code = int(match.group(1))
    if state is JobState.FAILED and deployment == "ValidationFailed":
        failure = Failure(kind=FailureClass.SPEC, reason="ValidationFailed")
    spec_meta = (obj.get("spec") or {}).get("metadata") or {}
    metadata = reserved_metadata(meta.get("annotations") or {})
    metadata.update({str(k): str(v) for k, v in spec_meta.items()})
    return JobStatus(
        job_id=name,
        state=state,
        message=message,
        start_time=parse_time(status.get("startTime")),
        end_time=parse_time(status.get("endTime")),
        exit_code=exit_code,
        metadata=metadata,
        failure=failure,
    )


def rayjob_failure(
    obj: dict[str, Any], *, submitter_said: str = "", ends_with_it: bool = False
) -> Failure | None:
    """The class a FAILED RayJob's status.reason says (_REASON_CLASS), else None.

    SubmissionFailed: KubeRay v1.6.1 (rayjob_controller.go) sets it when the submitter Job
    failed and Ray's job had not: "a failed Submitter Job indicates that the submission itself
    has failed or the user code has thrown an error. If the failure is due to user code, the
    JobStatus ... will be updated accordingly" (then the reason is AppFailed). Where Ray had
    the job (jobStatus PENDING or RUNNING) the submitter died following it, not the code: the
    cluster's failure, resubmitted on its budget, if nothing of the attempt outlives its RayJob
    (`ends_with_it`: its own cluster, torn down with it); on a cluster that stays its Ray job
    may still run (the backend stops it: `stop_left_running`), and a resubmission could run
    it twice. Where Ray never had it, the submit itself failed (an unreachable head, a bad
    runtime_env): the job's, unless Ray answered that its head had no job agent yet and to try
    again later (NO_AGENT_YET, a head still starting on a busy node): the cluster's, and safe
    to resubmit anywhere, since Ray never had the job. Either way the reason carries the
    submitter's last log line (`submitter_said`)."""
    status = obj.get("status") or {}
    reason = status.get("reason") or ""
    if reason == SUBMISSION_FAILED:
        ray_had_it = submission_failed_after_ray_took_it(obj)
        ours = ends_with_it if ray_had_it else NO_AGENT_YET in submitter_said
        said = f"{reason}: {submitter_said}" if submitter_said else reason
        return Failure(
            kind=FailureClass.INFRASTRUCTURE if ours else FailureClass.APPLICATION,
            reason=said[:REASON_CHARS],
        )
    kind = _REASON_CLASS.get(reason)
    return None if kind is None else Failure(kind=kind, reason=reason)


def submission_failed_after_ray_took_it(obj: dict[str, Any]) -> bool:
    """SubmissionFailed while Ray had the job (jobStatus PENDING or RUNNING): the submitter
    died following it, and the Ray job may still run (rayjob_failure)."""
    status = obj.get("status") or {}
    return status.get("reason") == SUBMISSION_FAILED and status.get("jobStatus") in (
        "PENDING", "RUNNING")  # fmt: skip


def ray_target(obj: dict[str, Any] | None) -> tuple[str, str] | None:
    """A RayJob's (RayCluster name, Ray submission id) once KubeRay has submitted it."""
    status = (obj or {}).get("status") or {}
    cluster, ray_job_id = status.get("rayClusterName"), status.get("jobId")
    if not cluster or not ray_job_id:
        return None
    return str(cluster), str(ray_job_id)
