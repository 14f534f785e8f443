"""The local Slurm as a busy shared cluster: a partition with room for one job (the rest queue,
with a reason and an estimated start), scancel of a queued job, and a low-priority job preempted
and requeued by a high-priority partition's job, then run again to completion.

What squeue and sacct say at each step is asserted in the exact strings Slurm 22.05 prints, since
the Slurm backend maps those strings to job states."""

from __future__ import annotations

import pwd
import shlex
import subprocess
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path

import pytest

from prefect_nemo.testing.slurm import LocalSlurm

pytestmark = pytest.mark.slow

# the backend's own poll (accounting.status_command): squeue while queued, sacct once ended
SQUEUE = "%i|%T|%r|%S"
SACCT = "JobID,State,ExitCode,Start,End,Reason"
GATED = "while [ ! -e {gate} ]; do sleep 0.2; done\n"


def sbatch(slurm: LocalSlurm, partition: str, script: str, out: Path, *options: str) -> str:
    """Submit a batch script through the cluster's sshd, as a remote user would; its job id."""
    remote = ["sbatch", "--parsable", f"--account={slurm.account}", f"--partition={partition}"]
    result = subprocess.run(
        slurm.ssh_command(shlex.join([*remote, f"--output={out}", *options])),
        input="#!/bin/bash\n" + script,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().split(";")[0]


def squeue(
    slurm: LocalSlurm, *job_ids: str, fmt: str = SQUEUE, extra: tuple[str, ...] = ()
) -> dict[str, list[str]]:
    """squeue's fields of each job, by id (`-t all`: ended jobs too, for MinJobAge)."""
    out = slurm.run(
        ["squeue", "-h", "-t", "all", "-j", ",".join(job_ids), "-o", fmt, *extra], check=False
    ).stdout
    return {line.split("|")[0]: line.split("|")[1:] for line in out.splitlines() if line}


def sacct(slurm: LocalSlurm, job_id: str, *options: str) -> list[list[str]]:
    """sacct's allocation rows of a job (one per run with --duplicates)."""
    out = slurm.run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", SACCT, *options]).stdout
    return [line.split("|") for line in out.splitlines() if line]


def epoch(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


@pytest.fixture
def cancel_after(slurm: LocalSlurm) -> Iterator[list[str]]:
    """Job ids the test submits: cancelled when it ends, so the one-CPU nodes are free again."""
    ids: list[str] = []
    yield ids
    if ids:
        slurm.run(["scancel", *ids], check=False)
        _wait_for(lambda: not squeue_live(slurm, ids), 30)


def squeue_live(slurm: LocalSlurm, ids: list[str]) -> list[str]:
    rows = squeue(slurm, *ids, fmt="%i|%T")
    return [i for i, (state,) in rows.items() if state in ("PENDING", "RUNNING", "COMPLETING")]


def test_a_full_partition_runs_one_job_and_queues_the_rest_with_reason_and_start(
    slurm: LocalSlurm, tmp_path: Path, cancel_after: list[str]
) -> None:
    gate = tmp_path / "gate"
    part = slurm.queue_partition
    first = sbatch(slurm, part, GATED.format(gate=gate), tmp_path / "1")
    cancel_after.append(first)
    _wait_for(lambda: squeue(slurm, first)[first][0] == "RUNNING")
    second = sbatch(slurm, part, GATED.format(gate=gate), tmp_path / "2")
    third = sbatch(slurm, part, GATED.format(gate=gate), tmp_path / "3", "--time=5")
    cancel_after += [second, third]

    # Job reason codes (slurm.schedmd.com/job_reason_codes.html): "Resources — The resources
    # requested by the job are not available (e.g., already used by other jobs)"; "Priority —
    # One or more higher priority jobs exist for the partition". So the first job in line waits
    # for Resources, every one behind it for Priority.
    def waiting() -> list[list[str]]:
        out = slurm.run(
            ["squeue", "-h", "-p", part, "-t", "PD", "--sort=-p,i", "-o", "%i|%r"]
        ).stdout
        return [line.split("|") for line in out.splitlines()]

    def settled() -> bool:
        queue = waiting()
        ids, reasons = {i for i, _ in queue}, {r for _, r in queue}
        return {second, third} <= ids and reasons <= {"Resources", "Priority"}

    _wait_for(settled)
    queue = waiting()
    assert [i for i, _ in queue][-2:] == [second, third]
    assert [r for _, r in queue] == ["Resources"] + ["Priority"] * (len(queue) - 1)
    rows = squeue(slurm, first, second, third)
    assert rows[first][0:2] == ["RUNNING", "None"]
    assert [rows[j][0] for j in (second, third)] == ["PENDING", "PENDING"]
    # sacct has no reason for a job that never ran: squeue is the one to ask
    _wait_for(lambda: [r[1] + "|" + r[5] for r in sacct(slurm, second)] == ["PENDING|None"])

    # slurm.conf(5), DefaultTime: "Run time limit used for jobs that don't specify a value";
    # the queue partition's is 10 minutes, so a job without --time still has a limit
    limits = squeue(slurm, first, third, fmt="%i|%l")
    assert (limits[first], limits[third]) == (["10:00"], ["5:00"])
    # squeue(1) --start: "Report the expected start time and resources to be allocated for
    # pending jobs in order of increasing start time". Backfill plans from time limits: one
    # CPU, so the second may start when the first's limit runs out, the third when the
    # second's does (within bf_resolution, "Default: 60" seconds).
    started = epoch(squeue(slurm, first)[first][2])

    def estimates() -> dict[str, list[str]]:
        return squeue(slurm, second, third, fmt="%i|%S", extra=("--start",))

    _wait_for(lambda: all(v[0] not in ("N/A", "") for v in estimates().values()))
    est = {job: epoch(v[0]) for job, v in estimates().items()}
    assert est[second] >= started + 600 - 60
    assert est[third] >= est[second] + 600 - 60


def test_the_queue_moves_on_when_the_running_job_ends(
    slurm: LocalSlurm, tmp_path: Path, cancel_after: list[str]
) -> None:
    gate = tmp_path / "gate"
    part = slurm.queue_partition
    first = sbatch(slurm, part, GATED.format(gate=gate), tmp_path / "1", "--time=2")
    cancel_after.append(first)
    _wait_for(lambda: squeue(slurm, first)[first][0] == "RUNNING")
    second = sbatch(slurm, part, "echo second ran\n", tmp_path / "2", "--time=2")
    cancel_after.append(second)
    _wait_for(lambda: squeue(slurm, second)[second][:2] == ["PENDING", "Resources"])

    gate.touch()

    # the next job starts once the first's CPU is free (sched_interval=2: within seconds)
    second_row = slurm.wait_job(second, ("COMPLETED", "FAILED", "CANCELLED"))
    assert second_row["State"] == "COMPLETED"
    first_end = sacct(slurm, first)[0]
    assert first_end[1:3] == ["COMPLETED", "0:0"]
    assert epoch(sacct(slurm, second)[0][3]) >= epoch(first_end[4])
    assert (tmp_path / "2").read_text() == "second ran\n"


def test_scancel_of_a_queued_job_removes_it_and_sacct_says_cancelled(
    slurm: LocalSlurm, tmp_path: Path, cancel_after: list[str]
) -> None:
    gate = tmp_path / "gate"
    part = slurm.queue_partition
    blocker = sbatch(slurm, part, GATED.format(gate=gate), tmp_path / "1", "--time=2")
    cancel_after.append(blocker)
    _wait_for(lambda: squeue(slurm, blocker)[blocker][0] == "RUNNING")
    queued = sbatch(slurm, part, "echo must not run\n", tmp_path / "2", "--time=2")
    cancel_after.append(queued)
    _wait_for(lambda: squeue(slurm, queued)[queued][0] == "PENDING")

    assert slurm.run(slurm.ssh_command(f"scancel {queued}")).returncode == 0

    # squeue --help: -t, --states "default is pending and running": the cancelled job leaves
    # that listing at once; with -t all it is still shown (for MinJobAge), as CANCELLED
    _wait_for(lambda: queued not in slurm.run(["squeue", "-h", "-o", "%i"]).stdout.split())
    assert squeue(slurm, queued)[queued][0] == "CANCELLED"
    row = slurm.wait_job(queued, ("CANCELLED",))
    # sacct(1) job state codes, CANCELLED: "Job was explicitly cancelled by the user or system
    # administrator. The job may or may not have been initiated." sacct adds "by <uid>". This
    # one never ran: no node, no time (sacct gives its Start as the cancel time, or None)
    assert row["State"] == f"CANCELLED by {pwd.getpwnam(slurm.user).pw_uid}"
    fields = ["sacct", "-n", "-X", "-P", "-j", queued, "-o", "NodeList,Elapsed,Start,End"]
    nodes, elapsed, start, end = slurm.run(fields).stdout.strip().split("|")
    assert (nodes, elapsed) == ("None assigned", "00:00:00")
    assert start in ("None", end)
    assert squeue(slurm, blocker)[blocker][0] == "RUNNING"  # the running one is untouched
    assert not (tmp_path / "2").exists()


def test_a_high_priority_job_preempts_and_requeues_the_low_one_which_then_completes(
    slurm: LocalSlurm, tmp_path: Path, cancel_after: list[str]
) -> None:
    # the low job's first run waits to be preempted; its run after the requeue ends soon
    low_script = (
        'echo "run ${SLURM_RESTART_COUNT:-0}"\n'
        'if [ "${SLURM_RESTART_COUNT:-0}" = 0 ]; then sleep 300; else sleep 2; fi\n'
    )
    low = sbatch(slurm, slurm.low_partition, low_script, tmp_path / "low")
    cancel_after.append(low)
    _wait_for(lambda: squeue(slurm, low)[low][0] == "RUNNING")
    high = sbatch(slurm, slurm.high_partition, "sleep 3\necho high ran\n", tmp_path / "high")
    cancel_after.append(high)

    # What the backend's poll sees, step by step: each new answer of squeue (%T|%r) and of sacct
    # (State|Reason) about the low job
    queue_seen: list[str] = []
    acct_seen: list[str] = []

    def low_ran_again() -> bool:
        q = "|".join(squeue(slurm, low).get(low, [])[:2])
        a = ",".join(f"{r[1]}|{r[5]}" for r in sacct(slurm, low))
        for seen, now in ((queue_seen, q), (acct_seen, a)):
            if not seen or seen[-1] != now:
                seen.append(now)
        # sacct lags squeue (below): the job has ended for both once sacct says so too (CI run
        # 51 stopped at squeue's COMPLETED and found sacct still at the requeued run's RUNNING)
        return q.startswith("COMPLETED") and a.startswith("COMPLETED")

    _wait_for(low_ran_again, 90, interval=0.2)
    print("low job: squeue", queue_seen, "sacct", acct_seen)

    # slurm.conf(5), PriorityTier: jobs of a higher tier "will also be considered for preemption
    # of running jobs in partition(s) with lower PriorityTier values if
    # PreemptType=preempt/partition_prio"; PreemptMode REQUEUE "Preempts jobs by requeuing them
    # (if possible)", possible as "the cluster wide JobRequeue parameter in slurm.conf" is 1.
    # Requeued, the job is PENDING until its earliest start time: job_reason_codes, "BeginTime —
    # The job's earliest start time has not yet been reached" (AuthInfo cred_expire: "This also
    # controls how long a requeued job must wait before starting again").
    steps = ["RUNNING|None", "PENDING|BeginTime", "RUNNING|None", "COMPLETED|None"]
    # passing states a poll may catch: PENDING before the requeue sets the begin time,
    # COMPLETING while a run's processes are killed or end, and PENDING for Resources once the
    # begin time has passed while the high job still holds the one CPU (job_reason_codes:
    # "Resources — The job is waiting for resources to become available")
    passing = ("PENDING|None", "COMPLETING|None", "PENDING|Resources")
    assert [q for q in queue_seen if q not in passing] == steps, queue_seen
    # sacct lags squeue, and for a moment it has only the preempted run (PREEMPTED, ended)
    # while squeue already says PENDING: a poll must not take that for the job's end
    words = {a.split("|")[0] for a in acct_seen}
    assert words <= {"", "PENDING", "RUNNING", "PREEMPTED", "COMPLETED"}, acct_seen
    assert acct_seen[-1].startswith("COMPLETED|"), acct_seen
    # sacct(1) --duplicates shows every run of a requeued job: the preempted one, then this one
    runs = sacct(slurm, low, "--duplicates")
    assert [(r[1], r[2]) for r in runs] == [("PREEMPTED", "0:0"), ("COMPLETED", "0:0")]
    assert [r[1] for r in sacct(slurm, low)] == ["COMPLETED"]  # without it: the last run
    high_run = sacct(slurm, high)[0]
    assert high_run[1:3] == ["COMPLETED", "0:0"]
    # one CPU: the high job started when the low one was preempted, the low one's second run
    # after the high one ended
    assert epoch(runs[0][4]) <= epoch(high_run[3]) <= epoch(high_run[4]) <= epoch(runs[1][3])
    # slurm.conf(5): "Restarted jobs will have the environment variable SLURM_RESTART_COUNT set
    # to the number of times the job has been restarted"; squeue's RestartCnt says the same
    restarts = slurm.run(["squeue", "-h", "-t", "all", "-j", low, "-O", "RestartCnt"]).stdout
    assert restarts.split() == ["1"]
    # JobFileAppend: "By default, any existing file is truncated" when the job starts again
    assert (tmp_path / "low").read_text() == "run 1\n"
    assert (tmp_path / "high").read_text() == "high ran\n"


def test_a_running_cluster_is_reused_only_while_its_slurm_conf_is_this_versions(
    slurm: LocalSlurm,
) -> None:
    # slurm.conf(5): "Changes in node configuration (e.g. adding nodes ...) require restarting
    # both the slurmctld daemon and the slurmd daemons", so a cluster started by an older kit
    # (two nodes, no queue partitions) is restarted, not reconfigured
    state = slurm._read_state()
    assert state is not None and slurm._current(state)
    other = LocalSlurm(state_dir=slurm.state_dir, queue_partition="busy")
    assert not other._current(state)
    two_nodes = {k: v for k, v in state["ports"].items() if k not in ("slurmd3", "slurmd4")}
    assert not slurm._current(dict(state, ports=two_nodes))
    # ... but not while a session (this one) is attached: its jobs would fail
    with pytest.raises(RuntimeError, match="still in use"):
        other._wait_unused(0.5)


def _wait_for(condition: Callable[[], bool], timeout_s: float = 30, interval: float = 0.3) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {condition}"
        time.sleep(interval)
