"""Issue 29 on Slurm: a failed attempt is classified from what Slurm says of it, so that its
recovery (JobSpec.recovery) resubmits the cluster's failures and fails fast on the job's own.

sacct(1), JOB STATE CODES, the rules the classes rest on:
  NF NODE_FAIL      "Job terminated due to failure of one or more allocated nodes."
  BF BOOT_FAIL      "Job terminated due to launch failure, typically due to a hardware failure
                    (e.g. unable to boot the node or block and the job can not be requeued)."
  PR PREEMPTED      "Job terminated due to preemption."
  OOM OUT_OF_MEMORY "Job experienced out of memory error."
  F  FAILED         "Job terminated with non-zero exit code or other failure condition."
  TO TIMEOUT        "Job terminated upon reaching its time limit."

The real failures: a job that may not be requeued (`sbatch --no-requeue`; a site's
JobRequeue=0 does the same to every job) on a node taken down, and on the low partition when a
high partition's job preempts it. `scontrol update state=down` is the controller's own path for a
node that stopped responding (both mark the node down, then kill its jobs as NODE_FAIL); a
killed slurmd would get there only after SlurmdTimeout (300 s by default), and the local
kit's supervisor stops the whole cluster when one of its daemons exits."""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prefect import flow

from prefect_nemo import JobFailed, JobSpec, run_job
from prefect_nemo.backends.nemo_run.slurm.accounting import parse_rows, row_status, status_command
from prefect_nemo.jobs import FailureClass, JobState, JobStatus
from tests.conftest import job_events
from tests.test_nemo_run_slurm import sacct_by_name, slurm_block, unique, wait_rows

# a job that runs until something ends it
SLEEPER = "echo started; sleep 300"


def poll(squeue: str, sacct: str) -> JobStatus:
    """Our status of one poll's answer: squeue's row (State, Reason, StartTime, Partition,
    RestartCnt) and sacct's (State, ExitCode, Start, End, Reason, NodeList)."""
    out = (f"7|{squeue}|\n" if squeue else "") + "@@\n" + (f"7|{sacct}\n" if sacct else "")
    return row_status("job", "7", parse_rows(out, {"7"})["7"])


def test_slurm_failure_table() -> None:
    """The answers the local Slurm 22.05 gave (the real tests below), and the states with no
    kit to cause them in sacct's own words, mapped to (state, class, node, exit code). A
    requeued job is not over: back in the queue (issue 28). FAILED, TIMEOUT and DEADLINE carry
    no class: the lifecycle reads their log tail (NCCL / Xid errors are the cluster's) and else
    calls them the job's own."""
    table = [
        # NODE_FAIL, not requeued: squeue says it first, sacct a moment later
        ("NODE_FAIL|NodeDown|1795930080|queue|0", "PENDING|0:0|1795930080|Unknown|None|vm-3",
         ("RUNNING", None, None, None)),
        ("NODE_FAIL|NodeDown|1795930080|queue|0", "NODE_FAIL|0:0|1795930080|1795930081|None|vm-3",
         ("FAILED", FailureClass.INFRASTRUCTURE, "vm-3", None)),
        ("", "NODE_FAIL|0:0|1795930080|1795930081|None|vm-[2-3]",
         ("FAILED", FailureClass.INFRASTRUCTURE, "vm-[2-3]", None)),
        # NODE_FAIL of a job Slurm requeued (JobRequeue=1): waiting again, not over
        ("PENDING|BeginTime|1795930112|queue|1", "NODE_FAIL|0:0|1795930090|1795930091|None|vm-3",
         ("QUEUED", None, None, None)),
        ("", "BOOT_FAIL|0:0|1795930090|1795930091|None|vm-3",
         ("FAILED", FailureClass.INFRASTRUCTURE, "vm-3", None)),
        # PREEMPTED and not requeued: FAILED (recovered), not STOPPED (someone's stop)
        ("PREEMPTED|None|1795930071|low|0", "PREEMPTED|0:0|1795930071|1795930072|None|vm-4",
         ("FAILED", FailureClass.PREEMPTED, "vm-4", None)),
        ("", "OUT_OF_MEMORY|0:125|1795930071|1795930072|None|vm",
         ("FAILED", FailureClass.APPLICATION, "vm", None)),
        ("", "FAILED|3:0|1795930071|1795930072|None|vm", ("FAILED", None, None, 3)),
        ("", "TIMEOUT|0:0|1795930071|1795930072|None|vm", ("FAILED", None, None, None)),
        ("", "DEADLINE|0:0|1795930071|1795930072|None|vm", ("FAILED", None, None, None)),
        # our own stop is no failure
        ("", "CANCELLED by 0|0:15|1795930071|1795930072|None|vm", ("STOPPED", None, None, None)),
    ]  # fmt: skip
    for squeue, sacct, want in table:
        status = poll(squeue, sacct)
        failure = status.failure
        got = (
            status.state.value,
            failure.kind if failure else None,
            failure.node if failure else None,
            status.exit_code,
        )
        assert got == want, (squeue, sacct, status)
    oom = poll("", "OUT_OF_MEMORY|0:125|1795930071|1795930072|None|vm")
    assert oom.failure and "OOM" in oom.failure.reason
    node_fail = poll("", "NODE_FAIL|0:0|1795930080|1795930081|None|vm-3")
    assert node_fail.message == f"Slurm job 7: {node_fail.failure.describe()}"  # type: ignore[union-attr]


# -- the real failures ---------------------------------------------------------------------------


def wait_until(check: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}")


def hand_sbatch(slurm: Any, partition: str, script: str, *options: str) -> str:
    """A job sbatch'ed by hand: its Slurm id."""
    args = ["sbatch", "--parsable", "-A", slurm.account, "-p", partition, "-o", "/dev/null"]
    return slurm.run([*args, *options, "--wrap", script]).stdout.strip().split(";")[0]


def running(slurm: Any, sid: str) -> bool:
    return slurm.run(["squeue", "-h", "-j", sid, "-o", "%T"], check=False).stdout.strip() == (
        "RUNNING"
    )


def backend_status(slurm: Any, sid: str) -> JobStatus:
    """The Slurm backend's status of the job from one real poll (its squeue + sacct line)."""
    output = slurm.run(status_command([sid])).stdout
    return row_status("job", sid, parse_rows(output, {sid})[sid])


def ended(slurm: Any, sid: str) -> JobStatus:
    return wait_until(
        lambda: (s := backend_status(slurm, sid)).state.is_terminal() and s, 30, f"{sid} to end"
    )


def node_back(slurm: Any, node: str) -> None:
    """The node up again (ReturnToService=2 returns a downed node once its slurmd registers;
    resume it where it has not)."""
    slurm.run(["scontrol", "update", f"nodename={node}", "state=resume"], check=False)

    def up() -> bool:
        out = slurm.run(["sinfo", "-h", "-n", node, "-o", "%T"], check=False).stdout
        return out.strip().rstrip("*~#$@^-!%") in ("idle", "mixed", "allocated")

    wait_until(up, 60, f"{node} up again")


@pytest.mark.slow
def test_node_fail_on_a_real_slurm_is_infrastructure_naming_the_node(slurm: Any) -> None:
    """NODE_FAIL: "Job terminated due to failure of one or more allocated nodes". The queue
    partition's node taken down under a running job that may not be requeued."""
    node = slurm.queue_node
    sid = hand_sbatch(slurm, slurm.queue_partition, SLEEPER, "--no-requeue")
    try:
        wait_until(lambda: running(slurm, sid), 60, f"{sid} running")
        reason = "prefect-nemo test: node lost"
        slurm.run(["scontrol", "update", f"nodename={node}", "state=down", f"reason={reason}"])
        status = ended(slurm, sid)
    finally:
        slurm.run(["scancel", sid], check=False)
        node_back(slurm, node)
    assert status.state is JobState.FAILED, status
    assert status.failure and status.failure.kind is FailureClass.INFRASTRUCTURE, status
    assert status.failure.node == node and "NODE_FAIL" in status.failure.reason, status
    assert status.exit_code is None, status  # Slurm killed it: "0:0" is no exit of its own


@pytest.mark.slow
def test_preempted_and_not_requeued_on_a_real_slurm_is_preempted(slurm: Any) -> None:
    """PREEMPTED: "Job terminated due to preemption". slurm.conf(5): the low partition's
    PreemptMode REQUEUE "Preempts jobs by requeuing them (if possible)"; a job that may not be
    requeued is killed instead and ends PREEMPTED, as with PreemptMode CANCEL."""
    sid = hand_sbatch(slurm, slurm.low_partition, SLEEPER, "--no-requeue")
    high = ""
    try:
        wait_until(lambda: running(slurm, sid), 60, f"{sid} running")
        high = hand_sbatch(slurm, slurm.high_partition, "sleep 2")
        status = ended(slurm, sid)
    finally:
        slurm.run(["scancel", sid, *([high] if high else [])], check=False)
    assert status.state is JobState.FAILED, status
    assert status.failure and status.failure.kind is FailureClass.PREEMPTED, status
    assert status.failure.node == slurm.preempt_node, status


# -- recovered through run_job ---------------------------------------------------------------------
# sacct(1) names every run of a job id; each attempt is its own Slurm job (`-r1`, ...).


@pytest.fixture(scope="module")
def job_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("slurm-recovery")


@pytest.fixture
def block(slurm: Any, job_root: Path, prefect_api: str) -> Any:
    """The test cluster's block, its jobs never requeued by Slurm (`--no-requeue`, as under a
    site's JobRequeue=0): a failure ends the attempt, and our recovery resubmits it."""
    return slurm_block(slurm, job_root).model_copy(
        update={"additional_parameters": {"no_requeue": True}}
    )


def first_run_then_done(marker: Path) -> str:
    """An entrypoint whose first attempt runs until something ends it, and whose next one
    resumes (the marker stands for a checkpoint on shared storage) and succeeds."""
    return f"if [ -e {marker} ]; then echo resumed; else touch {marker}; {SLEEPER}; fi"


def when(ready: Callable[[], bool], act: Callable[[], None]) -> threading.Thread:
    """Do `act` once `ready` holds (within 120 s), in a thread, while the flow runs."""

    def run() -> None:
        try:
            wait_until(ready, 120, "the first attempt to run")
            act()
        except AssertionError:
            pass  # the flow's result says what went wrong

    thread = threading.Thread(target=contextvars.copy_context().run, args=(run,), daemon=True)
    thread.start()
    return thread


def retrying_events(prefect_api: str, result: Any) -> list[dict[str, Any]]:
    """The `prefect-nemo.job.retrying` events of the job's first attempt (said on the failed
    attempt, naming the next)."""
    first = result.handle.model_copy(update={"job_id": result.attempts[0].job_id})
    events = job_events(prefect_api, first.resource_id, "prefect-nemo.job.retrying")
    return [e for e in events if e["event"] == "prefect-nemo.job.retrying"]


@pytest.mark.nemo_run
@pytest.mark.slow
def test_node_fail_is_resubmitted_and_completes(
    block: Any, slurm: Any, prefect_api: str, tmp_path: Path
) -> None:
    """Issue 29: "Slurm NODE_FAIL [...]: resubmitted and completed"; "the events name the class
    'infrastructure' and the lost node". NODE_FAIL: "Job terminated due to failure of one or
    more allocated nodes"."""
    node, marker = slurm.queue_node, tmp_path / "ran"
    down = ["scontrol", "update", f"nodename={node}", "state=down", "reason=prefect-nemo test"]
    spec = JobSpec(
        name=unique("node-fail"), queue=slurm.queue_partition,
        entrypoint=first_run_then_done(marker),
    )  # fmt: skip

    @flow
    def training() -> Any:
        when(marker.exists, lambda: slurm.run(down))
        return run_job(spec, block)

    started = time.monotonic()
    try:
        result = training()
    finally:
        node_back(slurm, node)
    took = time.monotonic() - started
    assert result.succeeded, result
    first = result.handle.job_id.removesuffix("-r1")
    assert result.handle.job_id == f"{first}-r1", result.handle
    (attempt,) = result.attempts
    assert attempt.job_id == first and attempt.failure, attempt
    assert (attempt.failure.kind, attempt.failure.node) == (FailureClass.INFRASTRUCTURE, node)
    assert len(wait_rows(slurm, first, "NODE_FAIL")) == 1  # sacct lags: wait for its row
    assert len(wait_rows(slurm, f"{first}-r1", "COMPLETED")) == 1
    (retrying,) = retrying_events(prefect_api, result)
    payload = retrying["payload"]
    assert (payload["class"], payload["node"]) == ("infrastructure", node), payload
    assert payload["next_job_id"] == result.handle.job_id, payload
    print(f"slurm_node_fail_recovered_s={took:.1f}")


@pytest.mark.nemo_run
@pytest.mark.slow
def test_preempted_is_resubmitted_and_completes(
    block: Any, slurm: Any, prefect_api: str, tmp_path: Path
) -> None:
    """Issue 29: "Slurm [...] PREEMPTED: resubmitted and completed"; a preemption does not count
    against max_restarts_on_errors (0 here). PREEMPTED: "Job terminated due to preemption";
    the low partition's PreemptMode REQUEUE cannot requeue a --no-requeue job, so Slurm ends
    it PREEMPTED."""
    marker, high = tmp_path / "ran", []
    spec = JobSpec(
        name=unique("preempted"), queue=slurm.low_partition,
        entrypoint=first_run_then_done(marker),
    )  # fmt: skip

    @flow
    def training() -> Any:
        when(
            marker.exists, lambda: high.append(hand_sbatch(slurm, slurm.high_partition, "sleep 2"))
        )
        return run_job(spec, block)

    try:
        result = training()
    finally:
        slurm.run(["scancel", *high], check=False)
    assert high, "the high job was never submitted"
    assert result.succeeded and result.handle.job_id.endswith("-r1"), result
    (attempt,) = result.attempts
    assert attempt.failure and attempt.failure.kind is FailureClass.PREEMPTED, attempt
    assert attempt.failure.node == slurm.preempt_node, attempt
    assert len(wait_rows(slurm, attempt.job_id, "PREEMPTED")) == 1
    assert len(wait_rows(slurm, result.handle.job_id, "COMPLETED")) == 1
    (retrying,) = retrying_events(prefect_api, result)
    assert retrying["payload"]["class"] == "preempted", retrying["payload"]


@pytest.mark.nemo_run
@pytest.mark.slow
def test_an_application_exit_1_fails_at_once_with_its_log_tail(
    block: Any, slurm: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 29: "an application exit 1 with no recover_on_exit_codes: fails at once with its
    log tail, no resubmission". FAILED: "Job terminated with non-zero exit code"."""
    caplog.set_level(logging.INFO)
    spec = JobSpec(name=unique("exit-1"), entrypoint="echo loss is nan >&2; exit 1")

    @flow
    def training() -> Any:
        return run_job(spec, block)

    with pytest.raises(JobFailed) as failed:
        training()
    result = failed.value.result
    assert result is not None and result.state is JobState.FAILED, result
    assert result.failure and result.failure.kind is FailureClass.APPLICATION, result
    assert result.exit_code == 1 and not result.attempts, result
    assert "loss is nan" in result.log_tail and "loss is nan" in str(failed.value)
    job_id = result.handle.job_id
    assert not job_id.endswith("-r1")
    assert len(wait_rows(slurm, job_id, "FAILED")) == 1
    assert not sacct_by_name(slurm, f"{job_id}-r1"), "resubmitted"
