"""Issue 28 on a real Slurm: jobs that wait in Slurm's queue are QUEUED (the partition, squeue's
reason and its estimated start), queue time is not run time, `queue_timeout_s` removes a queued
job, a job preempted and requeued is followed to its end, and every stop of ours (cancel, queue
timeout, the sweeper after a kill -9) leaves nothing queued.

The local Slurm's partitions (prefect_nemo.testing.slurm): `queue` has one 1-CPU node (one job
runs, the others wait), `low` and `high` share one (a high job requeues the low one,
PreemptMode=REQUEUE; a requeued job waits ~21 s before it may start again). Other tests may use
those nodes at the same time, so nothing here assumes it has them to itself. Each end-to-end test
goes through Prefect (`run_job` in a flow) and quotes the rule it checks."""

from __future__ import annotations

import contextvars
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.states import Cancelling
from pydantic import ValidationError

from prefect_nemo import InvalidJobSpec, JobSpec, JobState, QueueTimedOut, run_job
from prefect_nemo.backends.nemo_run.slurm.accounting import parse_rows, row_status
from prefect_nemo.jobs import JobHandle
from prefect_nemo.tasks.reporting import job_rows
from tests.conftest import subprocess_env
from tests.test_nemo_run_slurm import sacct_job_names, slurm_block, wait_rows

# the end-to-end tests: a real Slurm through NeMo-Run (the extra's environment)
slurm_e2e = [pytest.mark.nemo_run, pytest.mark.slow]
GATE = "while [ ! -e {gate} ]; do sleep 0.2; done"
# job_reason_codes: "Resources — The resources requested by the job are not available (e.g.,
# already used by other jobs)"; "Priority — One or more higher priority jobs exist for the
# partition": the first job in line waits for Resources, the ones behind it for Priority
WAITING = {"Resources", "Priority"}


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


@pytest.fixture(scope="module")
def job_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This module's remote job dir (the sshd runs on this machine: a local path too)."""
    return tmp_path_factory.mktemp("slurm-queues")


@pytest.fixture
def block(slurm: Any, job_root: Path, prefect_api: str) -> Any:
    return slurm_block(slurm, job_root)


def listed(slurm: Any, part: str) -> list[dict[str, str]]:
    """squeue's default listing (pending and running jobs) of jobs whose name holds `part`."""
    out = slurm.run(["squeue", "-h", "-o", "%i|%j|%T|%r|%S|%k"], check=False).stdout
    keys = ("sid", "name", "state", "reason", "start", "comment")
    rows = [dict(zip(keys, line.split("|"), strict=False)) for line in out.splitlines()]
    return [r for r in rows if part in r.get("name", "")]


def wait_until(check: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}")


def hand_sbatch(slurm: Any, partition: str, script: str) -> str:
    """A job sbatch'ed by hand (the cluster's other users): its Slurm id."""
    args = ["sbatch", "--parsable", "-A", slurm.account, "-p", partition, "-o", "/dev/null"]
    return slurm.run([*args, "--wrap", script]).stdout.strip().split(";")[0]


@pytest.fixture
def busy_queue(slurm: Any, tmp_path: Path) -> Iterator[str]:
    """The queue partition's one node taken by someone else's job (sbatch'ed by hand, waiting
    on a gate file), so what the test submits there waits; let go at the end."""
    gate = tmp_path / "blocker-go"
    sid = hand_sbatch(slurm, slurm.queue_partition, GATE.format(gate=gate))
    yield sid
    gate.touch()
    slurm.run(["scancel", sid], check=False)


def job_events(prefect_api: str, handle: JobHandle, until: str) -> list[dict[str, Any]]:
    """The job's events in the API, oldest first, once `until` is among them (events are
    written asynchronously)."""
    events: list[dict[str, Any]] = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        body = {"filter": {"resource": {"id": [handle.resource_id]}}, "limit": 50}
        events = httpx.post(f"{prefect_api}/events/filter", json=body).json()["events"]
        if any(e["event"] == until for e in events):
            break
        time.sleep(0.5)
    return sorted(events, key=lambda e: e["occurred"])


def named(events: list[dict[str, Any]], what: str) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == f"prefect-nemo.job.{what}"]


def in_thread(target: Callable[[], None]) -> threading.Thread:
    """Run `target` (a flow) in a thread with this context, as a script's flow run."""
    thread = threading.Thread(target=contextvars.copy_context().run, args=(target,), daemon=True)
    thread.start()
    return thread


# -- the state table ------------------------------------------------------------------------------


def poll(squeue: str, sacct: str) -> tuple[str, str, bool | None]:
    """Our (state, queue reason, preempted) of one poll's answer: squeue's row (State, Reason,
    StartTime, Partition, RestartCnt) and sacct's (State, ExitCode, Start, End, Reason,
    NodeList)."""
    out = (f"7|{squeue}|\n" if squeue else "") + "@@\n" + (f"7|{sacct}\n" if sacct else "")
    status = row_status("job", "7", parse_rows(out, {"7"})["7"])
    queue = status.queue
    return status.state.value, queue.reason if queue else "", queue.preempted if queue else None


def test_slurm_state_table_follows_squeue_while_it_lists_the_job() -> None:
    """The answers the local Slurm 22.05 gave at each step (tests/test_local_slurm_queues.py and
    its kit's measurements), mapped. job_reason_codes: a PENDING job waits in the queue for the
    reason squeue gives ("sacct never has the pending reason; only squeue does"). slurm.conf(5)
    PreemptMode REQUEUE "Preempts jobs by requeuing them": for ~0.3-1 s after a preemption sacct
    has only the preempted run (PREEMPTED, with an end) while squeue already lists the job again;
    issue 28: "Preemption is a requeue, not a failure", so squeue wins while it lists the job
    pending or running. PreemptMode CANCEL ends a job PREEMPTED in squeue too: then it is over,
    FAILED for its recovery to resubmit (issue 29; tests/test_slurm_recovery.py)."""
    acct_pending = "PENDING|0:0|Unknown|Unknown|None|None assigned"
    preempted_run = "PREEMPTED|0:0|1795873464|1795873465|None|vm-4"
    table = [
        # a queue where one fits: the scheduler's first look, then its reasons
        ("PENDING|None|N/A|queue|0", "", ("PENDING", "", None)),
        ("PENDING|Resources|1795874135|queue|0", acct_pending, ("QUEUED", "Resources", False)),
        ("PENDING|Priority|1795874700|queue|0", acct_pending, ("QUEUED", "Priority", False)),
        # afterok: waits for another job in the queue; one that can never run is not waiting
        ("PENDING|Dependency|N/A|queue|0", acct_pending, ("QUEUED", "Dependency", False)),
        ("PENDING|DependencyNeverSatisfied|N/A|queue|0", acct_pending, ("PENDING", "", None)),
        # sacct lags squeue: a running job may still be PENDING there
        ("RUNNING|None|1795873464|low|0", acct_pending, ("RUNNING", "", None)),
        # preempted with REQUEUE: squeue's passing states, then BeginTime, then the second run
        ("COMPLETING|None|1795873465|low|1", preempted_run, ("RUNNING", "", None)),
        ("PENDING|None|N/A|low|1", preempted_run, ("QUEUED", "", True)),
        ("PENDING|BeginTime|1795873486|low|1", preempted_run, ("QUEUED", "BeginTime", True)),
        ("PENDING|BeginTime|N/A|low|1", "PENDING|0:0|Unknown|Unknown|BeginTime|None assigned",
         ("QUEUED", "BeginTime", True)),
        ("RUNNING|None|1795873487|low|1", preempted_run, ("RUNNING", "", None)),
        # its end: sacct may say it first (same start); a lagging sacct's preempted run is not it
        ("RUNNING|None|1795873487|low|1", "COMPLETED|0:0|1795873487|1795873489|BeginTime|vm-4",
         ("SUCCEEDED", "", None)),
        ("COMPLETED|None|1795873487|low|1", preempted_run, ("RUNNING", "", None)),
        # preempted with CANCEL: PREEMPTED in squeue as well, or gone from it
        ("PREEMPTED|None|1795873464|low|0", preempted_run, ("FAILED", "", None)),
        ("", preempted_run, ("FAILED", "", None)),
        # scancel of a queued job: squeue keeps its reason; until sacct has it, still queued
        ("CANCELLED|Resources|1795873541|queue|0", acct_pending, ("QUEUED", "Resources", False)),
        ("CANCELLED|Resources|1795873541|queue|0",
         "CANCELLED by 0|0:0|None|1795873541|None|None assigned",
         ("STOPPED", "", None)),
    ]  # fmt: skip
    for squeue, sacct, want in table:
        assert poll(squeue, sacct) == want, (squeue, sacct)


def test_a_slurm_poll_carries_the_jobs_requeue_count_while_squeue_lists_it() -> None:
    """slurm.conf(5) PreemptMode REQUEUE: "Restarted jobs will have the environment variable
    SLURM_RESTART_COUNT set to the number of times the job has been restarted"; squeue's
    RestartCnt is that count. A job preempted within a second of starting runs again before
    the next poll (CI: polls saw PENDING, QUEUED, RUNNING): its count is what tells of the
    preemption. sacct's row has no count: once squeue no longer lists the job, none is said."""

    def requeues(squeue: str, sacct: str) -> int | None:
        out = (f"7|{squeue}|\n" if squeue else "") + "@@\n" + (f"7|{sacct}\n" if sacct else "")
        return row_status("job", "7", parse_rows(out, {"7"})["7"]).requeues

    preempted_run = "PREEMPTED|0:0|1795873464|1795873465|None|vm-4"
    done = "COMPLETED|0:0|1795873487|1795873489|BeginTime|vm-4"
    assert requeues("RUNNING|None|1795873464|low|0", "") == 0
    assert requeues("RUNNING|None|1795873487|low|1", preempted_run) == 1
    assert requeues("RUNNING|None|1795873487|low|2", done) == 2, "sacct said the end first"
    assert requeues("", done) is None


# -- a queue where one job fits --------------------------------------------------------------------
# -- a queue where one job fits --------------------------------------------------------------------


QUEUE_TIMEOUT_S = 8.0  # the third job's timeout_s: it waits longer than this in the queue


@pytest.mark.nemo_run
@pytest.mark.slow
def test_three_jobs_where_one_fits_queue_with_reason_and_estimate_and_all_succeed(
    block: Any, slurm: Any, job_root: Path, prefect_api: str, tmp_path: Path
) -> None:
    """Issue 28: "Slurm: three jobs where one fits: the others are QUEUED with the scheduler's
    reason and an estimated start; the timeout does not count queue time", "queue wait in the
    job table, the JobResult and the events", and "Where to queue, on the JobSpec ...: Slurm
    partition / QOS". squeue(1) --start: "Report the expected start time ... for pending jobs"
    (the %S of a pending job). JobSpec.timeout_s: "counted from when it runs: time queued for
    quota or resources does not count"."""
    gate = tmp_path / "first-go"
    tag = unique("three")
    part = slurm.queue_partition
    specs = [
        JobSpec(name=f"{tag}-1", entrypoint=f"{GATE.format(gate=gate)}; echo first", queue=part),
        # each runs a second at least: a poll sees it RUNNING (admitted from the queue)
        JobSpec(name=f"{tag}-2", entrypoint="sleep 1; echo second", queue=part),
        JobSpec(
            name=f"{tag}-3", entrypoint="sleep 1; echo third", queue=part, priority="normal",
            timeout_s=QUEUE_TIMEOUT_S,
        ),
    ]  # fmt: skip
    seen: dict[str, Any] = {}

    def release_when_queued() -> None:
        """Let the first job end once the other two are queued with a reason and an estimate
        in squeue and in the run's job table, and the third has waited past its timeout."""
        try:

            def both_waiting() -> list[dict[str, str]] | None:
                rows = [r for r in listed(slurm, tag) if r["name"].split(tag)[1][:2] != "-1"]
                ok = len(rows) == 2 and all(
                    r["state"] == "PENDING" and r["reason"] in WAITING and r["start"] != "N/A"
                    for r in rows
                )
                return rows if ok else None

            seen["squeue"] = wait_until(both_waiting, 120, "two jobs queued with estimates")
            queued_at = time.monotonic()  # the third is queued: its wait counts from here on
            run_id = seen["squeue"][0]["comment"].split("=", 1)[1]

            def table() -> list[dict[str, Any]] | None:
                rows = [r for r in job_rows(run_id) if r["job_id"].split(tag)[1][:2] != "-1"]
                done = len(rows) == 2 and all(r.get("queue_estimated_start") for r in rows)
                return rows if done else None

            seen["rows"] = wait_until(table, 30, "the job table to show both queued")
            time.sleep(max(0.0, QUEUE_TIMEOUT_S + 3 - (time.monotonic() - queued_at)))
        except BaseException as exc:  # asserted below
            seen["error"] = exc
        finally:
            gate.touch()

    @flow
    def three_jobs() -> list[Any]:
        first = run_job.submit(specs[0], block)
        wait_until(lambda: [r for r in listed(slurm, f"{tag}-1") if r["state"] == "RUNNING"],
                   120, "the first job to run")  # fmt: skip
        in_thread(release_when_queued)
        rest = [run_job.submit(spec, block) for spec in specs[1:]]
        return [future.result() for future in (first, *rest)]

    started = time.monotonic()
    first, second, third = three_jobs()
    took = time.monotonic() - started
    assert "error" not in seen, seen.get("error")
    assert [r.state for r in (first, second, third)] == [JobState.SUCCEEDED] * 3

    # the job table, while they waited: squeue's partition, reason and estimate
    by_job = {r["job_id"]: r for r in seen["rows"]}
    by_name = {r["name"]: r for r in seen["squeue"]}
    for result in (second, third):
        row, queue = by_job[result.handle.job_id], by_name[result.handle.job_id]
        assert row["queue"] == part and row["queue_reason"] == queue["reason"], (row, queue)
        estimate = row["queue_estimated_start"]
        assert abs(estimate.timestamp() - datetime.fromisoformat(queue["start"]).timestamp()) < 90
        # backfill plans from time limits: not before the running job's (the block's 5 min)
        assert estimate >= first.start_time + timedelta(seconds=300 - 60), (estimate, first)
    # the events: queued with the partition and reason, admitted with the wait
    for result in (second, third):
        events = job_events(prefect_api, result.handle, "prefect-nemo.job.succeeded")
        (queued,) = named(events, "queued")
        assert queued["payload"]["queue"]["queue"] == part
        assert queued["payload"]["queue"]["reason"] in WAITING
        assert not queued["payload"]["queue"]["preempted"]
        (admitted,) = named(events, "admitted")
        assert admitted["payload"]["this_wait_s"] > 0
        assert result.queue_wait_s is not None and result.queue_wait_s > 0
        assert result.preemptions == 0
    # the timeout counted the time it ran, not the time it waited
    assert third.queue_wait_s > QUEUE_TIMEOUT_S, third
    # JobSpec.queue -> sbatch --partition, JobSpec.priority -> --qos (over the block's)
    for result, qos in ((first, None), (third, "normal")):
        script = next(job_root.rglob(f"{result.handle.job_id}_sbatch.sh")).read_text()
        assert f"--partition={part}\n" in script
        assert (f"--qos={qos}\n" in script) if qos else "--qos" not in script
    (row,) = wait_rows(slurm, third.handle.job_id, "COMPLETED")
    qos = slurm.run(["sacct", "-n", "-X", "-P", "-j", row["JobID"], "-o", "QOS,Partition"])
    assert qos.stdout.strip() == f"normal|{part}"
    print(f"three jobs through a one-job partition: {took:.1f}s")


@pytest.mark.nemo_run
@pytest.mark.slow
def test_queue_timeout_removes_the_queued_job_naming_partition_and_reason(
    block: Any, slurm: Any, job_root: Path, busy_queue: str
) -> None:
    """Issue 28: "A new `queue_timeout_s` (default: wait) bounds the wait; when it expires the
    queued job is removed (... `scancel` of the pending job ...) and the error names the queue
    and the scheduler's reason", and "`queue_timeout_s` expiring removes the queued job (nothing
    left in ... squeue)". scancel(1): "used to signal or cancel jobs"; squeue's default listing
    is "pending and running" jobs."""
    name = unique("qto")

    @flow
    def impatient() -> Any:
        spec = JobSpec(
            name=name, entrypoint="echo must not run", queue=slurm.queue_partition,
            queue_timeout_s=3,
        )  # fmt: skip
        return run_job(spec, block)

    with pytest.raises(QueueTimedOut) as info:
        impatient()
    message, result = str(info.value), info.value.result
    where = rf"in {slurm.queue_partition} \((Resources|Priority)\)"
    assert re.search(rf"waited \d+s {where}.* past its queue_timeout_s of 3s", message), message
    assert result.state is JobState.STOPPED and result.queue_wait_s >= 3, result
    assert not listed(slurm, result.handle.job_id), "nothing left in squeue"
    (row,) = wait_rows(slurm, result.handle.job_id, "CANCELLED")
    assert row["Start"] in ("None", "Unknown", row["End"]), "it never ran"
    assert not list(job_root.rglob(f"log-{result.handle.job_id}_*.out"))


# -- preemption ------------------------------------------------------------------------------------


@pytest.mark.nemo_run
@pytest.mark.slow
def test_a_preempted_job_is_requeued_and_followed_to_success(
    block: Any, slurm: Any, prefect_api: str, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """Issue 28: "Preemption is a requeue, not a failure: ... a Slurm job preempted with
    `PreemptMode=REQUEUE` likewise [goes back to QUEUED and is waited on to its end]", "a REQUEUE
    preemption is followed to completion". slurm.conf(5) PreemptMode REQUEUE: "Preempts jobs by
    requeuing them (if possible)"; "Restarted jobs will have the environment variable
    SLURM_RESTART_COUNT set to the number of times the job has been restarted"."""
    caplog.set_level("INFO")
    name = unique("low")
    high: list[str] = []
    ran = tmp_path / "first-run"  # the first run's command has started (past NeMo-Run's setup)

    def preempt_once_running() -> None:
        try:
            wait_until(ran.exists, 120, "the low job's first run")
            high.append(hand_sbatch(slurm, slurm.high_partition, "sleep 2"))
        except AssertionError:
            pass  # the flow's result says what went wrong

    @flow
    def low_priority() -> Any:
        in_thread(preempt_once_running)
        restarts = "${SLURM_RESTART_COUNT:-0}"
        first = f"touch {ran}; sleep 300"  # until preempted
        spec = JobSpec(
            name=name, queue=slurm.low_partition,
            entrypoint=f'echo "run {restarts}"; if [ {restarts} = 0 ]; then {first}; fi',
        )  # fmt: skip
        return run_job(spec, block)

    try:
        result = low_priority()
    finally:
        slurm.run(["scancel", *high], check=False)
    assert high, "the high job was never submitted"
    assert result.succeeded, result
    (row,) = wait_rows(slurm, result.handle.job_id, "COMPLETED")
    runs = slurm.run(
        ["sacct", "-n", "-X", "-P", "--duplicates", "-j", row["JobID"], "-o", "State"]
    ).stdout.split()
    assert runs[-1] == "COMPLETED" and set(runs[:-1]) == {"PREEMPTED"}, runs
    assert result.preemptions == len(runs) - 1 >= 1, (result, runs)
    assert result.queue_wait_s is not None and result.queue_wait_s > 10, result
    events = job_events(prefect_api, result.handle, "prefect-nemo.job.succeeded")
    assert len(named(events, "preempted")) == result.preemptions, [e["event"] for e in events]
    requeued = [e for e in named(events, "queued") if e["payload"]["queue"]["preempted"]]
    assert requeued and requeued[0]["payload"]["queue"]["queue"] == slurm.low_partition
    assert not named(events, "stopped") and not named(events, "failed")
    # both runs' output reached the task's log (NeMo-Run writes one srun log per restart)
    assert "run 0" in caplog.text and f"run {len(runs) - 1}" in caplog.text


# -- our own stops remove queued jobs --------------------------------------------------------------


@pytest.mark.nemo_run
@pytest.mark.slow
def test_cancelling_the_flow_run_removes_its_queued_job(
    block: Any, slurm: Any, busy_queue: str
) -> None:
    """Issue 28: "Our own stops (cancel, timeout, failure hooks, the sweeper) still remove
    queued jobs", "Cancel ... of a run whose jobs are queued leave nothing queued": the run is
    cancelled through the API (a script's run: its cancel watch stops its jobs)."""
    name = unique("cancel")
    outcome: dict[str, Any] = {}

    @flow
    def waits_in_the_queue() -> Any:
        spec = JobSpec(name=name, entrypoint="echo must not run", queue=slurm.queue_partition)
        return run_job(spec, block)

    thread = in_thread(lambda: outcome.update(state=waits_in_the_queue(return_state=True)))
    (job,) = wait_until(
        lambda: [r for r in listed(slurm, name) if r["reason"] in WAITING], 120, "a queued job"
    )
    with get_client(sync_client=True) as client:
        run_id = uuid.UUID(job["comment"].split("=", 1)[1])
        client.set_flow_run_state(run_id, Cancelling(), force=True)
    wait_until(lambda: not listed(slurm, name), 60, "the queued job to leave squeue")
    thread.join(60)
    assert not thread.is_alive(), "the flow ends once its job is gone"
    assert not outcome["state"].is_completed()
    assert wait_rows(slurm, job["name"], "CANCELLED")


KILLED_SCRIPT = textwrap.dedent(
    """
    import sys
    from prefect import flow
    from prefect_nemo import JobSpec, run_job

    @flow
    def queued():
        run_job(JobSpec(entrypoint="echo must not run", name="q", queue=sys.argv[2]), sys.argv[1])

    queued()
    """
)


@pytest.mark.nemo_run
@pytest.mark.slow
def test_kill_9_then_the_sweeper_removes_the_queued_job(
    block: Any, slurm: Any, prefect_api: str, tmp_path: Path, busy_queue: str
) -> None:
    """Issue 28: "Cancel, timeout, failure and kill -9 + sweeper of a run whose jobs are queued
    leave nothing queued". The flow process is killed with SIGKILL while its job waits in the
    queue; the sweeper finds the job by its Slurm comment (issue 17) and scancels it."""
    from prefect_nemo.tasks.sweeper import sweep

    block.sweep_grace_s = 1
    saved = unique("sweep-queued")
    block.save(saved)
    key = unique("killed")
    env = subprocess_env(prefect_api, PREFECT_NEMO_RUN_KEY=key, PREFECT_NEMO_HEARTBEAT_S="1")
    log = tmp_path / "killed.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", KILLED_SCRIPT, f"slurm-cluster/{saved}",
             slurm.queue_partition],
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    try:

        def queued() -> list[dict[str, str]]:
            assert proc.poll() is None, log.read_text()[-3000:]
            return [r for r in listed(slurm, key) if r["reason"] in WAITING]

        (job,) = wait_until(queued, 180, "the script's job to be queued")
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    killed_at = time.monotonic()

    def swept() -> Any:
        return [v for v in sweep([block], lease_s=4) if v.job_id == job["name"] and v.stop]

    (verdict,) = wait_until(swept, 90, "the sweeper to stop the queued job")
    assert verdict.outcome == "STOPPED", verdict
    assert not listed(slurm, key), "nothing left in squeue"
    assert wait_rows(slurm, job["name"], "CANCELLED")
    print(f"queued job of a killed run swept {time.monotonic() - killed_at:.1f}s after the kill")


# -- bad input -------------------------------------------------------------------------------------


@pytest.mark.nemo_run
@pytest.mark.slow
def test_bad_queue_input_fails_before_anything_is_sent(
    block: Any, slurm: Any, job_root: Path
) -> None:
    """Issue 28: "Bad input: ... a negative `queue_timeout_s`: clear error, nothing sent"; the
    errors name the field and the fix. A partition or QOS name goes into the batch script's
    #SBATCH lines: one that is not a Slurm name is refused before sbatch runs; one sbatch
    refuses ("Invalid partition name specified") names the JobSpec field that chose it."""
    name = unique("bad")
    before = sorted(p.name for p in job_root.rglob("*"))
    for fields, error in [
        ({"queue_timeout_s": -5}, r"JobSpec\.queue_timeout_s: Input should be greater than 0"),
        ({"queue_timeout_s": 0}, r"JobSpec\.queue_timeout_s: Input should be greater than 0"),
        ({"queue": "gpu queue"}, r"JobSpec\.queue='gpu queue' is not a Slurm partition name"),
        ({"queue": "a,,b"}, r"JobSpec\.queue='a,,b' is not a Slurm partition name"),
        ({"priority": "high\n#SBATCH --x"}, r"JobSpec\.priority=.* is not a Slurm QOS name"),
    ]:

        @flow
        def refused(fields: dict[str, Any] = fields) -> Any:
            return run_job(JobSpec(entrypoint="true", name=name, **fields), block)

        with pytest.raises(InvalidJobSpec, match=error):
            refused()
    assert sorted(p.name for p in job_root.rglob("*")) == before, "nothing written"
    assert not [n for n in sacct_job_names(slurm) if name in n], "nothing submitted"

    @flow
    def unknown() -> Any:
        return run_job(JobSpec(entrypoint="true", name=name, queue="no-such-partition"), block)

    with pytest.raises(InvalidJobSpec, match=r"sbatch refused the job.*Check JobSpec\.queue"):
        unknown()
    assert not [n for n in sacct_job_names(slurm) if name in n], "nothing submitted"
    # the block's own partition and QOS are checked when it is made
    for field, value in (("partition", "debug queue"), ("qos", "a;b")):
        with pytest.raises(ValidationError, match=rf"{field}\n.*is not a Slurm"):
            block.model_validate({**block.model_dump(), field: value})
