"""The kill -9 scenario of issue 17, shared by the sweeper's end-to-end tests on every backend
(tests/test_sweeper.py: Ray Jobs; tests/test_sweeper_backends.py: KubeRay, Slurm): a plain
script with 6 running jobs is killed with SIGKILL, then either nobody retries (the sweeper must
stop all six) or the same script runs again with its run key (it attaches, the sweeper spares
all six)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prefect import flow

from prefect_nemo.blocks.base import ClusterBlock
from prefect_nemo.tasks.sweeper import EVENTS_DELAY_S, SWEPT_EVENT, Verdict, sweep
from tests.conftest import subprocess_env

# the states of ended jobs, as Ray (and RayJobs) and Slurm's squeue say them
ENDED = {"STOPPED", "SUCCEEDED", "FAILED", "CANCELLED", "COMPLETED", "TIMEOUT"}
# The grace within which the scenario's re-run attaches and its heartbeats reach the API: on a
# busy 2-core machine a re-run took 28 s to start, and the burst of reports at its attach held
# its heartbeats back ~15 s more (30 s of grace was too short there). The scenario waits only
# until the re-run vouches for the jobs, not for the whole grace.
RETRY_GRACE_S = 60.0
HEARTBEAT_S = 1  # the scripts' runs renew their lease (twice this) every second

# The plain script: six jobs, each `sleep 240` (long enough to outlive the scenario on a busy
# machine, short of the Slurm test block's 5-minute time limit), waited on by one flow run.
SCRIPT = textwrap.dedent(
    """
    import sys
    from prefect import flow
    from prefect_nemo import JobSpec, run_job
    block, count = sys.argv[1], int(sys.argv[2])

    @flow
    def six_jobs():
        futures = [run_job.submit(JobSpec(entrypoint="sleep 240", name=f"s{i}"), block)
                   for i in range(count)]
        print("SUBMITTED", flush=True)
        for f in futures:
            f.wait()

    six_jobs()
    """
)


@dataclass
class Engine:
    """One cluster as the kill -9 scenario sees it: a saved block to run the script on (its
    `sweep_grace_s` short), and the engine's own view of its jobs (not the sweeper's)."""

    block: ClusterBlock
    ref: str  # the block's saved name: what the script runs its jobs on
    states: Callable[[], dict[str, str]]  # job id -> state, for every job on the cluster
    stop: Callable[[str], None]  # stop a job by hand (cleanup)
    # what counts as running before the kill (the scenario waits for six jobs in it)
    running: frozenset[str] = frozenset({"RUNNING"})


@dataclass
class Swept:
    """What the scenario saw: the job ids of the killed run, the flow run of the sweep that
    stopped them and how long after the kill they were all stopped."""

    killed: list[str]
    sweep_run_id: str
    stopped_after_s: float


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}")


def kill_9_scenario(engine: Engine, prefect_api: str, logs: Path, lease_s: float = 4.0) -> Swept:
    """Issue 17: "kill -9 of a flow process with 6 running ... jobs, no retry: 0 jobs of the
    killed run still running `sweep_grace_s + 60 s` after the kill; with a retry inside the
    grace period, 6 of 6 attached and 0 stopped". The retry is the same plain script run again
    with its run key ($PREFECT_NEMO_RUN_KEY); runs renew their lease every HEARTBEAT_S
    ($PREFECT_NEMO_HEARTBEAT_S), and `lease_s` is what a sign of life without a lease of its
    own counts (the jobs' submission)."""
    grace = engine.block.sweep_grace_s

    def start(key: str) -> subprocess.Popen[bytes]:
        env = subprocess_env(
            prefect_api, PREFECT_NEMO_RUN_KEY=key, PREFECT_NEMO_HEARTBEAT_S=str(HEARTBEAT_S)
        )
        with open(logs / f"{key}.log", "ab") as out:
            return subprocess.Popen(
                [sys.executable, "-c", SCRIPT, engine.ref, "6"],
                stdout=out, stderr=subprocess.STDOUT, env=env,
            )  # fmt: skip

    def jobs(key: str, *, live: bool = False) -> list[str]:
        """The cluster's jobs of this run key (ids start with it); `live`: those not ended."""
        return sorted(
            j for j, s in engine.states().items()
            if j.startswith(f"{key}-") and (not live or s not in ENDED)
        )  # fmt: skip

    def six_running(key: str, proc: subprocess.Popen[bytes]) -> list[str]:
        def check() -> list[str] | None:
            assert proc.poll() is None, (logs / f"{key}.log").read_text()[-3000:]
            ids = [j for j, s in engine.states().items() if j.startswith(f"{key}-")
                   and s in engine.running]  # fmt: skip
            return sorted(ids) if len(ids) == 6 else None

        return wait_for(check, 180, f"six running jobs of {key}")

    def kill(proc: subprocess.Popen[bytes]) -> float:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        return time.monotonic()

    def stopping(verdicts: list[Verdict], ids: list[str]) -> list[Verdict]:
        return [v for v in verdicts if v.job_id in ids and v.stop]

    lost, again = (f"{what}-{uuid.uuid4().hex[:6]}" for what in ("lost", "again"))
    started: list[subprocess.Popen[bytes]] = []
    try:
        # both runs start together; the second lives on through step 1, whose sweeps must spare
        # a live run's jobs (and the scenario starts the script once less)
        started.append(proc := start(lost))
        started.append(first := start(again))
        killed = six_running(lost, proc)
        ids = six_running(again, first)
        # 1. killed, no retry: nothing stopped within the grace; then the sweeper stops all six
        killed_at = kill(proc)
        at_kill = jobs(lost)
        early = sweep([engine.block], lease_s=lease_s)
        assert not stopping(early, killed), "within the lease and the grace: nothing stopped"

        @flow(name="sweep-in-test")
        def sweeping() -> list[Verdict]:
            return sweep([engine.block], lease_s=lease_s)

        def swept() -> tuple[str, list[Verdict]] | None:
            state = sweeping(return_state=True)
            assert not stopping(state.result(), ids), "a live run's jobs are spared"
            mine = stopping(state.result(), killed)
            return (str(state.state_details.flow_run_id), mine) if mine else None

        sweep_run_id, mine = wait_for(swept, grace + 60, "the sweeper to stop them")
        assert sorted(v.job_id for v in mine) == killed, "all six in one sweep"
        assert {v.outcome for v in mine} == {"STOPPED"}, mine
        wait_for(lambda: not jobs(lost, live=True), 30, "the engine to show them stopped")
        stopped_after = time.monotonic() - killed_at
        print(f"sweep_{engine.block.get_block_type_slug()}_stopped_after_kill_s={stopped_after:.1f}")
        assert stopped_after <= grace + 60, stopped_after
        # an attempt that ended before the kill may stand beside the six (a job the cluster
        # failed, recovered as '-r1' while the run lived); none may come after it
        after = {j: s for j, s in engine.states().items() if j.startswith(f"{lost}-")}
        assert sorted(after) == at_kill, f"no job of that run key since the kill: {after}"

        # 2. killed, then run again within the grace (a longer one, RETRY_GRACE_S): the re-run
        # attaches; the sweeper, run again and again from the kill on (as `sweep_flow` does),
        # stops none of the six, and once the killed run's own signs of life are stale it spares
        # them because the re-run names them (a reason that holds whatever the grace)
        patient = engine.block.model_copy(update={"sweep_grace_s": RETRY_GRACE_S})
        killed_at = kill(first)
        started.append(retry := start(again))
        log = logs / f"{again}.log"
        # the moment the killed run's jobs would be dead if nobody had attached
        dead_at = killed_at + 2 * HEARTBEAT_S + EVENTS_DELAY_S

        def spared_by_the_rerun() -> list[Verdict] | None:
            judged_at = time.monotonic()
            verdicts = [v for v in sweep([patient], lease_s=lease_s) if v.job_id in ids]
            assert len(verdicts) == 6 and not [v for v in verdicts if v.stop], verdicts
            named = all("a run named it" in v.why for v in verdicts)
            attached = log.read_text().count("attached to existing job") >= 6
            return verdicts if named and attached and judged_at > dead_at + 2 else None

        wait_for(spared_by_the_rerun, RETRY_GRACE_S + 60, "the re-run to attach to the six jobs")
        assert jobs(again, live=True) == ids and jobs(again) == ids, "6 of 6 attached, no other"
        assert retry.poll() is None, "the re-run still waits on them"
        return Swept(killed, sweep_run_id, stopped_after)
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for key in (lost, again):
            for job_id in jobs(key, live=True):
                engine.stop(job_id)


def swept_report(flow_run_id: str, since: datetime) -> tuple[list[dict[str, Any]], list[Any]]:
    """From the Prefect API: the rows of the sweep run's table artifact, and every
    `prefect-nemo.job.swept` event since `since` (waiting a little for the event store)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                flow_run_id=ArtifactFilterFlowRunId(any_=[uuid.UUID(flow_run_id)])
            )
        )
        (table,) = [a for a in artifacts if a.type == "table"]
        rows = json.loads(table.data) if isinstance(table.data, str) else table.data
        body = {
            "filter": {
                "occurred": {"since": since.isoformat(), "until": datetime.now(UTC).isoformat()},
                "event": {"name": [SWEPT_EVENT]},
            },
            "limit": 50,
        }
        events = client.request("POST", "/events/filter", json=body).json()["events"]
    return rows, events


def assert_reported(swept: Swept, since: datetime) -> None:
    """Issue 17: "what the sweeper stopped is reported (an artifact and an event per job)":
    the sweep run's table artifact has a row per job it judged, and the API holds one
    `prefect-nemo.job.swept` event per stopped job, related to the sweep's flow run."""
    rows: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []

    def complete() -> bool:
        nonlocal rows, events
        rows, events = swept_report(swept.sweep_run_id, since)
        named = [e["resource"]["prefect.resource.name"] for e in events]
        return all(named.count(j) == 1 for j in swept.killed)

    wait_for(complete, 30, "one swept event per stopped job in the API")
    stopped = {r["job_id"]: r for r in rows if r["stop"]}
    assert sorted(stopped) == swept.killed, rows
    assert {r["outcome"] for r in stopped.values()} == {"STOPPED"}
    assert all("stopped saying it is alive" in r["why"] for r in stopped.values()), rows
    mine = [e for e in events if e["resource"]["prefect.resource.name"] in swept.killed]
    assert {e["payload"]["outcome"] for e in mine} == {"STOPPED"}
    assert {e["payload"]["owner"] for e in mine} == {stopped[swept.killed[0]]["owner"]}
    # the time each ran for its dead run, where the cluster says its start and end (issue 31)
    wasted = [e["payload"]["wasted_run_s"] for e in mine]
    assert all(s is None or s > 0 for s in wasted), wasted
    assert [stopped[e["resource"]["prefect.resource.name"]]["wasted_run_s"] for e in mine] == wasted
    for event in mine:
        runs = {r["prefect.resource.id"] for r in event.get("related") or []}
        assert f"prefect.flow-run.{swept.sweep_run_id}" in runs, event
