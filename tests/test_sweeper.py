"""The sweeper (issue 17 item 1): "Build an out-of-process, Prefect-native way to find jobs whose
flow run is dead and stop them": "a run is dead when Prefect says it is terminal/CRASHED, or when
it stops proving it is alive (a lease/heartbeat the run renews while it waits on jobs ...)";
"a grace period (block setting) during which a retry of the crashed run attaches instead (no
stop, no duplicate)"; "a stop we asked for but could not confirm ... is recorded and finished by
the sweeper once the backend answers again"; "it never touches a job whose run is alive or a job
we did not submit"."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from prefect_nemo.jobs import JobState, OwnedJob
from prefect_nemo.tasks.sweeper import Beat, Evidence, judge

NOW = datetime(2026, 11, 25, 12, 0, tzinfo=UTC)
LEASE, GRACE = 30.0, 300.0
CLUSTER = "http://ray:8265"


def _job(owner: str | None = "run-a", age_s: float = 600) -> OwnedJob:
    return OwnedJob(
        job_id="job-1",
        state=JobState.RUNNING,
        flow_run_id=owner,
        submitted_at=NOW - timedelta(seconds=age_s),
    )


def _run(state: str, seconds_ago: float = 0) -> Any:
    return SimpleNamespace(
        state=SimpleNamespace(
            type=__import__("prefect.client.schemas.objects", fromlist=["StateType"]).StateType(
                state
            ),
            timestamp=NOW - timedelta(seconds=seconds_ago),
        )
    )


def _evidence(
    *, beat_s: float | None = None, run: Any = None, pending_s: float | None = None
) -> Evidence:
    at = NOW - timedelta(seconds=beat_s or 0)
    beats = {} if beat_s is None else {(CLUSTER, "job-1"): Beat(at, at + timedelta(seconds=LEASE))}
    pending = {} if pending_s is None else {(CLUSTER, "job-1"): NOW - timedelta(seconds=pending_s)}
    return Evidence(NOW, beats, {}, pending, {} if run is None else {"run-a": run})


def verdict(job: OwnedJob, evidence: Evidence) -> Any:
    return judge("ray-jobs-cluster/x", CLUSTER, job, evidence, GRACE, LEASE)


def test_a_job_named_by_a_recent_heartbeat_is_kept_whatever_its_owner_says() -> None:
    """A retry of a crashed run (or a re-run) that attached renews the job's lease: kept."""
    v = verdict(_job(), _evidence(beat_s=10, run=_run("CRASHED", 3600)))
    assert not v.stop and "named it 10s ago" in v.why


def test_a_completed_run_left_its_jobs_running_on_purpose() -> None:
    v = verdict(_job(), _evidence(run=_run("COMPLETED", 3600)))
    assert not v.stop and "completed" in v.why


def test_a_crashed_run_is_dead_but_its_jobs_wait_for_the_grace() -> None:
    """ "a grace period (block setting) during which a retry of the crashed run attaches
    instead (no stop, no duplicate)"."""
    assert not verdict(_job(), _evidence(run=_run("CRASHED", 60))).stop
    v = verdict(_job(), _evidence(run=_run("CRASHED", GRACE + 1)))
    assert v.stop and "CRASHED" in v.why and "past the grace" in v.why


def test_a_running_run_that_stopped_renewing_its_lease_is_dead() -> None:
    """ "or when it stops proving it is alive": kill -9 leaves Prefect saying RUNNING."""
    assert not verdict(_job(), _evidence(beat_s=LEASE + 60, run=_run("RUNNING"))).stop
    v = verdict(_job(), _evidence(beat_s=LEASE + GRACE + 1, run=_run("RUNNING")))
    assert v.stop and "stopped saying it is alive" in v.why


def test_a_dead_runs_jobs_are_judged_together_however_far_apart_they_were_submitted() -> None:
    """ "0 jobs of the killed run still running": with no heartbeat readable yet, a run's newest
    submission is its last sign of life for all its jobs, so one sweep stops all of them (each
    job's own submission time had the first-submitted stopped sweeps before the last; CI saw 4
    of 6 in one sweep on a loaded machine)."""
    first, last = _job(age_s=LEASE + GRACE + 20), _job(age_s=LEASE + GRACE - 20)
    assert first.submitted_at is not None and last.submitted_at is not None
    evidence = Evidence(NOW, {}, {}, {}, {"run-a": _run("RUNNING")}, {"run-a": last.submitted_at})
    assert not verdict(first, evidence).stop and not verdict(last, evidence).stop
    later = Evidence(
        NOW + timedelta(seconds=40), {}, {}, {}, {"run-a": _run("RUNNING")},
        {"run-a": last.submitted_at},
    )  # fmt: skip
    assert verdict(first, later).stop and verdict(last, later).stop


def test_a_gone_run_is_dead_and_a_job_without_an_owner_is_left_alone() -> None:
    assert verdict(_job(age_s=LEASE + GRACE + 60), _evidence()).stop
    assert not verdict(_job(owner=None), _evidence()).stop


def test_an_unconfirmed_stop_is_finished_whatever_the_owner_says() -> None:
    """ "a stop we asked for but could not confirm (backend unreachable) is recorded and
    finished by the sweeper once the backend answers again"."""
    v = verdict(_job(), _evidence(pending_s=5, run=_run("COMPLETED")))
    assert v.stop and "never confirmed" in v.why
    assert not verdict(_job(), _evidence(pending_s=60, beat_s=5, run=_run("RUNNING"))).stop


@pytest.fixture(scope="module")
def ray_head(own_ray_head: Any) -> Any:
    """A head of this module's own (conftest's `own_ray_head`): its sweeps judge every job."""
    return own_ray_head


# ---------------------------------------------------------------------------------------------
# Against a real Ray cluster (token auth) and a real Prefect API


@pytest.mark.slow
def test_kill_9_then_the_sweeper_stops_every_job_of_the_dead_run_and_spares_a_retry(
    prefect_api: str, ray_head: Any, ray_client: Any, tmp_path: Path
) -> None:
    """kill -9 of a flow process with 6 running Ray jobs (token auth on), no retry: 0 jobs of the
    killed run still running sweep_grace_s + 60 s after the kill; with a retry (the same plain
    script run again with its run key, $PREFECT_NEMO_RUN_KEY) inside the grace, 6 of 6
    attached and 0 stopped (`kill_9_scenario`, shared with KubeRay and Slurm). A job submitted
    by hand is never touched."""
    from prefect_nemo import RayJobsCluster
    from tests.sweep_scenario import Engine, kill_9_scenario

    block = RayJobsCluster(
        dashboard_url=ray_head.dashboard_url, auth_token=ray_head.token, sweep_grace_s=5
    )
    name = f"sweep-e2e-{uuid.uuid4().hex[:6]}"
    block.save(name)
    stranger = f"stranger-{uuid.uuid4().hex[:6]}"  # submitted by hand: never ours to stop
    ray_client.submit_job(entrypoint="sleep 600", submission_id=stranger)

    def states() -> dict[str, str]:
        return {j.submission_id: j.status.value for j in ray_client.list_jobs() if j.submission_id}

    try:
        engine = Engine(block, f"ray-jobs-cluster/{name}", states, ray_client.stop_job)
        kill_9_scenario(engine, prefect_api, tmp_path)
        assert ray_client.get_job_status(stranger).value == "RUNNING", "not ours: never touched"
    finally:
        ray_client.stop_job(stranger)


def test_a_dead_runs_gpu_job_is_swept_with_its_wasted_gpu_hours_and_cost(
    prefect_api: str, ray_head: Any, ray_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 31, item 4: "'wasted' GPU-hours counted apart (failed and stopped attempts, time a
    dead run's jobs ran until the sweeper stopped them)". A 1-GPU job submitted (not waited
    for) by a run that then crashed is stopped by the sweeper, and its `prefect-nemo.job.swept`
    event and verdict carry the GPU-hours of the time it ran (1 GPU x wasted_run_s) and their
    cost at the block's price."""
    import time

    import httpx
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.states import Crashed

    from prefect_nemo import JobSpec, RayJobsCluster, submit_job
    from prefect_nemo.jobs import Resources
    from prefect_nemo.tasks.sweeper import SWEPT_EVENT, sweep

    monkeypatch.setenv("PREFECT_NEMO_HEARTBEAT_S", "0.5")  # its run's leases end at once
    block = RayJobsCluster(dashboard_url=ray_head.dashboard_url, auth_token=ray_head.token,
                           sweep_grace_s=1, gpu_hour_price=4.0)  # fmt: skip
    since = datetime.now(UTC).isoformat()

    @flow
    def leaves_a_gpu_job() -> Any:
        spec = JobSpec(entrypoint="sleep 300", name="gpu-left", resources=Resources(gpus=1))
        return submit_job(spec, block)

    state = leaves_a_gpu_job(return_state=True)
    job_id = state.result().job_id
    with get_client(sync_client=True) as client:  # the run dies after all: it crashed
        client.set_flow_run_state(state.state_details.flow_run_id, Crashed(), force=True)

    def events_of_the_job(name: str) -> list[dict[str, Any]]:
        resource = {"id": [f"prefect-nemo.job.ray-jobs.{job_id}"]}
        body = {"filter": {"occurred": {"since": since}, "event": {"name": [name]},
                           "resource": resource}}  # fmt: skip
        deadline, found = time.monotonic() + 30, []
        while not found and time.monotonic() < deadline:
            found = httpx.post(f"{prefect_api}/events/filter", json=body).json()["events"]
            time.sleep(0.5)
        return found

    # Prefect persists events in batches (up to 5 s late): a real sweep comes a lease and a
    # grace after the run's end, so its submission event is readable by then; here, wait for it
    assert events_of_the_job("prefect-nemo.job.submitted"), "no submitted event"
    try:
        deadline, mine = time.monotonic() + 90, None
        while mine is None and time.monotonic() < deadline:
            time.sleep(2)
            mine = next((v for v in sweep([block], lease_s=1) if v.job_id == job_id and v.stop),
                        None)  # fmt: skip
        assert mine is not None, "the dead run's job was not swept"
        assert mine.wasted_run_s is not None and mine.wasted_run_s > 0
        assert mine.wasted_gpu_hours == pytest.approx(mine.wasted_run_s / 3600)
        assert mine.wasted_cost == pytest.approx(mine.wasted_gpu_hours * 4.0)
        assert ray_client.get_job_status(job_id).value == "STOPPED"
        swept = events_of_the_job(SWEPT_EVENT)
        assert swept, "no swept event"
        payload = swept[0]["payload"]
        assert payload["wasted_gpu_hours"] == pytest.approx(mine.wasted_gpu_hours)
        assert payload["wasted_cost"] == pytest.approx(mine.wasted_cost)
    finally:
        ray_client.stop_job(job_id)
