"""What Slurm answers, read: the squeue/sacct rows of a poll, the state table, Slurm time
formats, sbatch's refusals mapped to the block field they are about, and the owner comment our
jobs carry (the sweeper's listing). No SSH here: the executor runs the commands this module
writes and hands it their output."""

from __future__ import annotations

import re
import shlex
from collections.abc import Collection
from datetime import UTC, datetime
from typing import Any

from prefect_nemo.errors import BackendUnavailable, InvalidJobSpec, Throttled
from prefect_nemo.jobs import (
    META_FLOW_RUN,
    Failure,
    FailureClass,
    JobState,
    JobStatus,
    OwnedJob,
    QueueInfo,
)
from prefect_nemo.names import is_slurm_name

#: sacct/squeue state (first word) -> ours. A job in Slurm's queue is QUEUED: `row_status`
#: keeps PENDING for one the scheduler has not looked at yet (no reason) and one that can never
#: run (DependencyNeverSatisfied). PREEMPTED is an end only once squeue no longer lists the job:
#: a job requeued after its preemption is QUEUED again (`parse_rows`); one Slurm did not requeue
#: is FAILED (preempted, `FAILURES`), so that its recovery resubmits it, not STOPPED (our stop).
SLURM_STATES = {
    "PENDING": JobState.QUEUED,
    "REQUEUED": JobState.QUEUED,
    "REQUEUE_FED": JobState.QUEUED,
    "REQUEUE_HOLD": JobState.QUEUED,
    "RESV_DEL_HOLD": JobState.QUEUED,
    "CONFIGURING": JobState.PENDING,  # allocated, its nodes booting: no longer in the queue
    "RUNNING": JobState.RUNNING,
    "COMPLETING": JobState.RUNNING,
    "RESIZING": JobState.RUNNING,
    "SUSPENDED": JobState.RUNNING,
    "STOPPED": JobState.RUNNING,
    "SIGNALING": JobState.RUNNING,
    "STAGE_OUT": JobState.RUNNING,
    "COMPLETED": JobState.SUCCEEDED,
    "CANCELLED": JobState.STOPPED,
    "PREEMPTED": JobState.FAILED,
    "FAILED": JobState.FAILED,
    "TIMEOUT": JobState.FAILED,
    "NODE_FAIL": JobState.FAILED,
    "OUT_OF_MEMORY": JobState.FAILED,
    "BOOT_FAIL": JobState.FAILED,
    "DEADLINE": JobState.FAILED,
    "SPECIAL_EXIT": JobState.FAILED,
    "REVOKED": JobState.FAILED,
}
#: The ended states that say why, by sacct(1)'s JOB STATE CODES, -> (class, what it means).
#: The others (FAILED: "non-zero exit code or other failure condition", TIMEOUT, DEADLINE) are
#: left to the lifecycle, which reads the log tail (NCCL / Xid errors are the cluster's) and
#: else calls them the job's own.
FAILURES: dict[str, tuple[FailureClass, str]] = {
    "NODE_FAIL": (
        FailureClass.INFRASTRUCTURE,
        "NODE_FAIL: the job ended because one or more of its nodes failed",
    ),
    "BOOT_FAIL": (
        FailureClass.INFRASTRUCTURE,
        "BOOT_FAIL: the job could not be launched on its node (typically a hardware failure)",
    ),
    "PREEMPTED": (
        FailureClass.PREEMPTED,
        "PREEMPTED: the job was preempted and not requeued (the partition's PreemptMode "
        "cancels preempted jobs, or the job cannot be requeued)",
    ),
    "OUT_OF_MEMORY": (
        FailureClass.APPLICATION,
        "OUT_OF_MEMORY: the job ran out of memory (OOM)",
    ),
}
#: The reason Slurm gives a job whose afterok dependency failed.
NEVER_SATISFIED = "DependencyNeverSatisfied"
# every sacct state: with -S alone sacct lists only jobs that became eligible (not one
# cancelled while held or waiting on a dependency)
ALL_STATES = "BF,CA,CD,DL,F,NF,OOM,PD,PR,R,RQ,RS,RV,S,TO"

#: Words in sbatch's refusal -> the block field (under the block's name) it is about.
SBATCH_FIELDS = {
    "account": "account",
    "partition": "partition",
    "time limit": "time",
    "qos": "qos",
    "constraint": "constraint",
    "feature": "constraint",
    "gres": "gpus_per_node or additional_parameters",
    "node count": "nodes (or JobSpec.placement.nodes)",
    "node configuration": "nodes, gpus_per_node, cpus_per_task or mem (or the JobSpec's "
    "placement / resources: more than the partition's nodes have)",
    "generic resource": "gpus_per_node or additional_parameters['gres']",
    "memory": "mem (or JobSpec.resources.memory_bytes)",
}


#: The reasons sbatch prints (the line before "Job violates accounting/QOS policy") when a
#: job would pass a submit limit (QOS or association MaxSubmitJobs*, GrpSubmitJobs): the
#: limit frees up as our own jobs end, so the submit is retried, not refused.
SUBMIT_LIMIT = re.compile(r"\b(?:QOS|Assoc)\w*Submit\w*Limit\b")


def check_names(value: str, field: str, what: str, *, many: bool = False) -> None:
    """InvalidJobSpec unless `value` is a Slurm name (`many`: a comma-separated list)."""
    if not is_slurm_name(value, many=many):
        also = " (a comma-separated list lets Slurm start it in whichever frees up first)"
        raise InvalidJobSpec(
            f"{field}={value!r} is not a Slurm {what} name: use letters, digits, '_', '-' or "
            f"'.'{also if many else ''}; nothing was submitted"
        )


def sbatch_error(exc: Any, field: str, overrides: dict[str, str] | None = None) -> Exception:
    """sbatch's refusal: Throttled at a submit limit, else InvalidJobSpec naming the block
    field it is about, or the JobSpec field that overrode it (`overrides`: block field ->
    JobSpec field); else BackendUnavailable with sbatch's message."""
    text = (exc.result.stderr or exc.result.stdout or "").strip()
    reason = text.splitlines()[-1] if text else f"exit {exc.result.exited}"
    if limit := SUBMIT_LIMIT.search(text):
        return Throttled(f"Slurm's submit limit is reached ({limit.group()}): {reason}")
    lowered = reason.lower()
    for needle, name in SBATCH_FIELDS.items():
        if needle in lowered:
            where = (overrides or {}).get(name) or f"{field}.{name}"
            return InvalidJobSpec(
                f"sbatch refused the job: {reason}. Check {where} (nothing was submitted)"
            )
    return BackendUnavailable(f"sbatch failed: {reason}")


def slurm_seconds(text: str, field: str) -> int | None:
    """Seconds in a Slurm time limit (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS);
    None for no limit."""
    text = text.strip()
    if text.upper() in ("INFINITE", "UNLIMITED", "-1"):
        return None
    days, _, clock = text.rpartition("-")
    try:
        parts = [int(p) for p in clock.split(":")]
        if days:
            if len(parts) > 3:
                raise ValueError(text)
            hours, minutes, seconds = (*parts, 0, 0)[:3]
            hours += int(days) * 24
        elif len(parts) == 3:
            hours, minutes, seconds = parts
        elif len(parts) in (1, 2):
            hours, minutes, seconds = 0, parts[0], (parts[1] if len(parts) == 2 else 0)
        else:
            raise ValueError(text)
    except ValueError:
        raise InvalidJobSpec(
            f"{field}={text!r} is not a Slurm time: use minutes, HH:MM:SS or D-HH:MM:SS"
        ) from None
    return (hours * 60 + minutes) * 60 + seconds


def _epoch(text: str) -> datetime | None:
    return datetime.fromtimestamp(int(text), tz=UTC) if text.isdigit() and text != "0" else None


def row_status(job_id: str, sid: str, row: dict[str, str]) -> JobStatus:
    """Our status of job_id from its Slurm row (`parse_rows`): QUEUED with the partition,
    squeue's reason and estimated start while Slurm's queue holds it, a message that says
    why a job that waits on or was cancelled for a dependency did not run, and the failure
    of a job Slurm ended for a cause it names (`FAILURES`: NODE_FAIL names its nodes)."""
    word = row["State"].split()[0] if row["State"] else "PENDING"
    state = SLURM_STATES.get(word, JobState.PENDING)
    reason = row.get("Reason", "")
    restarts = int(row.get("Restarts") or 0)
    message = f"{row['State']} (Slurm job {sid}" + (f", {reason})" if reason else ")")
    started = _epoch(row.get("Start", ""))
    queue = None
    if state is JobState.QUEUED and (reason == NEVER_SATISFIED or not (reason or restarts)):
        # never satisfied: cancelled soon (kill_on_invalid_dep), not waiting for anything; no
        # reason yet: the scheduler has not looked at the job (a second at most)
        state = JobState.PENDING
    elif state is JobState.QUEUED:
        queue = QueueInfo(
            queue=row.get("Partition") or None,
            reason=reason,
            estimated_start=_epoch(row.get("Estimate", "")),
            preempted=restarts > 0,
        )
        if restarts:
            runs = "run" if restarts == 1 else "runs"
            message = message[:-1] + f"; requeued after {restarts} {runs})"
    if reason == NEVER_SATISFIED and not state.is_terminal():
        message = (
            f"Slurm job {sid} cannot run: a job it depends on (afterok) did not succeed ({reason})"
        )
    elif reason.startswith("Dependency") and state is JobState.STOPPED:
        started = None  # sacct gives a job cancelled while pending the cancel time as Start
        message = (
            f"Slurm job {sid} never ran: it was cancelled while waiting for the jobs it depends "
            "on (afterok); Slurm cancels it when one of them fails or is cancelled "
            f"({row['State']}, {reason})"
        )
    failure = None
    if word in FAILURES and state is JobState.FAILED:
        kind, meaning = FAILURES[word]
        nodes = row.get("NodeList", "")
        node = nodes if nodes and nodes not in ("None assigned", "(null)") else None
        failure = Failure(kind=kind, reason=meaning, node=node)
        message = f"Slurm job {sid}: {failure.describe()}"
    exit_code = None
    code = row.get("ExitCode", "").split(":")[0]
    if code.isdigit() and (
        state is JobState.SUCCEEDED or (state is JobState.FAILED and code != "0")
    ):
        exit_code = int(code)  # a job Slurm killed (NODE_FAIL, PREEMPTED: "0:0") has none
    return JobStatus(
        job_id=job_id,
        state=state,
        message=message,
        queue=queue,
        start_time=started,
        end_time=_epoch(row.get("End", "")) if state.is_terminal() else None,
        exit_code=exit_code,
        failure=failure,
        metadata={"slurm_job_id": sid},
        # squeue's RestartCnt, while squeue lists the job (sacct's row has no count)
        requeues=restarts if "Restarts" in row else None,
    )


#: squeue's fields of a poll (`-O`, each unpadded and ended by '|'). StartTime is Slurm's
#: estimate while the job is pending (the one `squeue --start` prints; N/A without one) and
#: RestartCnt counts its requeues (a preemption with PreemptMode=REQUEUE is one).
SQUEUE_FIELDS = ("JobID", "State", "Reason", "StartTime", "Partition", "RestartCnt")
#: sacct's fields of a poll (`-P`, '|'-separated). NodeList names the node of a NODE_FAIL (all
#: of a multi-node job's: Slurm 22.05's sacct does not say which one failed).
SACCT_FIELDS = ("JobID", "State", "ExitCode", "Start", "End", "Reason", "NodeList")


def status_command(slurm_ids: Collection[str]) -> str:
    """One shell line for a poll: squeue (current, never lags a just-submitted job), '@@',
    then sacct (exit code and end of jobs that left the queue), with epoch times."""
    joined = ",".join(sorted(set(slurm_ids)))
    fields = ",".join(f"{name}:0|" for name in SQUEUE_FIELDS)
    return (
        f"export SLURM_TIME_FORMAT=%s; squeue -h -t all -j {joined} -O '{fields}' "
        f"2>/dev/null; echo @@; sacct -n -X -P -j {joined} "
        f"-o {','.join(SACCT_FIELDS)} 2>/dev/null"
    )


def parse_rows(output: str, slurm_ids: Collection[str]) -> dict[str, dict[str, str]]:
    """The row of each Slurm id in `status_command`'s output: squeue's while it lists the job
    queued or running, sacct's (exit code, end) once the run squeue lists has ended there, or
    the job has left squeue. sacct lags squeue, and for a moment after a preemption it has only
    the preempted run, ended, while squeue already lists the job requeued."""
    queue, _, acct = output.partition("@@")
    rows: dict[str, dict[str, str]] = {}
    for line in queue.splitlines():
        parts = line.strip().split("|")
        if len(parts) < len(SQUEUE_FIELDS):
            continue
        sid, state, reason, start, partition, restarts = parts[: len(SQUEUE_FIELDS)]
        reason = "" if reason in ("None", "(null)") else reason
        row = {
            "State": state,
            "Reason": reason,
            "Partition": partition,
            "Restarts": restarts if restarts.isdigit() else "0",
            "Listed": state,  # squeue's own word and start, kept to compare sacct's with
            "ListedStart": start,
        }
        ours = SLURM_STATES.get(state, JobState.PENDING)
        if ours.is_terminal():
            # ended, but sacct (exit code, end) has not caught up: still finishing, or still
            # queued for a job cancelled in the queue (Slurm keeps its pending reason)
            ran = start.isdigit() and not (state == "CANCELLED" and reason)
            row["State"] = "COMPLETING" if ran else "PENDING"
            row["Start" if ran else "Estimate"] = start if ran else ""
        else:  # a pending job's StartTime is Slurm's estimate, not a start
            row["Estimate" if ours.is_waiting() else "Start"] = start
        rows[sid] = row
    for line in acct.splitlines():
        parts = line.strip().split("|")
        if len(parts) == len(SACCT_FIELDS) and parts[0] in slurm_ids:
            sid, state, exit_code, start, end, reason, nodes = parts
            live = rows.get(sid)
            if live is not None and not _sacct_ends(live, state, start):
                continue  # squeue is current
            rows[sid] = {
                "State": state,
                "ExitCode": exit_code,
                "Start": start,
                "End": end,
                "Reason": reason if reason not in ("None", "") else (live or {}).get("Reason", ""),
                "Partition": (live or {}).get("Partition", ""),
                "NodeList": nodes,
            }
            if live is not None:
                rows[sid]["Restarts"] = live["Restarts"]
    return rows


def _sacct_ends(live: dict[str, str], state: str, start: str) -> bool:
    """Whether sacct's row (`state`, `start`) is the end of the run squeue lists in `live`.
    Not while squeue lists the job back in the queue (the row is a run before its requeue),
    nor a PREEMPTED row while squeue lists the job live (being requeued: a job preempted for
    good, PreemptMode=CANCEL, ends PREEMPTED in squeue too); else when both say the same end,
    or the row has the start of the run squeue lists (sacct may say it ended first)."""
    word = state.split()[0] if state else ""
    if not SLURM_STATES.get(word, JobState.PENDING).is_terminal():
        return False  # sacct lags: squeue's row is current
    listed = SLURM_STATES.get(live["Listed"], JobState.PENDING)
    if listed.is_waiting() or (word == "PREEMPTED" and not listed.is_terminal()):
        return False
    return word == live["Listed"] or (start.isdigit() and start == live["ListedStart"])


def sacct_id_command(job_id: str, job_dir: str) -> str:
    """Shell printing the newest Slurm id of a job named job_id that sacct knows since the
    job's claim (the time of `job_dir`/meta.json); nothing without a claim. Bounded by the
    claim so that a job cancelled when an earlier claim was released is not taken for this one."""
    q = shlex.quote
    meta = q(f"{job_dir}/meta.json")
    return (
        f"{{ [ -f {meta} ] && sacct -n -X -P --name={q(job_id)} -o JobID "
        f"-S $(date -d @$(stat -c %Y {meta}) +%Y-%m-%dT%H:%M:%S) -E now -s {ALL_STATES} "
        "2>/dev/null | tail -1; }"
    )


def id_lookup_command(job_id: str, job_dir: str) -> str:
    """Shell printing '<job id> <Slurm id>': the id in `job_dir`/slurm_job_id, else Slurm's by
    name (a submitter that died between sbatch and writing it): squeue while queued or
    running, sacct once the job has left the queue."""
    q = shlex.quote
    return (
        f"s=$(cat {q(job_dir)}/slurm_job_id 2>/dev/null); "
        f'[ -n "$s" ] || s=$(squeue -h --name={q(job_id)} -o %i | head -1); '
        f'[ -n "$s" ] || s=$({sacct_id_command(job_id, job_dir)}); echo {q(job_id)} "$s"'
    )


def owner_comment(flow_run_id: str) -> str:
    """The Slurm comment (``sbatch --comment``) of a job we submit: the flow run that submitted
    it, empty when none; the mark `parse_owned` finds our jobs by."""
    return f"{META_FLOW_RUN}={flow_run_id}"


def owned_command() -> str:
    """One squeue of the login user's jobs still in the queue: id, name, state, submit time
    (epoch), comment, and the batch script (the command, last: it may hold a '|')."""
    return "export SLURM_TIME_FORMAT=%s; squeue -h -u \"$(id -un)\" -o '%i|%j|%T|%V|%k|%o'"


def parse_owned(output: str, script_dir: str) -> list[OwnedJob]:
    """Our live jobs in `owned_command`'s output: those whose comment is an `owner_comment`
    and whose batch script is under `script_dir` (this block's job dir); the job id is the
    Slurm job name (ours)."""
    prefix = owner_comment("")
    found = []
    for line in output.splitlines():
        parts = line.strip().split("|", 5)
        if len(parts) != 6:
            continue
        _, name, state, submitted, comment, script = parts
        if not comment.startswith(prefix) or not script.startswith(script_dir.rstrip("/") + "/"):
            continue
        ours = SLURM_STATES.get(state.split()[0] if state else "", JobState.PENDING)
        if ours.is_terminal():
            continue
        found.append(
            OwnedJob(
                job_id=name,
                state=ours,
                flow_run_id=comment.removeprefix(prefix) or None,
                submitted_at=_epoch(submitted),
            )
        )
    return found
