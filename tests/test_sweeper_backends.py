"""The sweeper (issue 17 item 1) beyond Ray Jobs: its bad inputs, its report, and the kill -9
scenario (tests/sweep_scenario.py) on KubeRay (loopback API server, KubeRay simulator, real
Ray) and a real Slurm.

Issue 17, "Must hold": "The sweeper's own bad inputs (unknown block, unreachable backend, a job
without our labels) give a clear message and stop nothing they should not", and "kill -9 of a
flow process with 6 running Ray jobs ..., no retry: 0 jobs of the killed run still running
`sweep_grace_s + 60 s` after the kill; with a retry inside the grace period, 6 of 6 attached
and 0 stopped. The same for KubeRay and Slurm (loopback API / real Slurm)."
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prefect import flow
from prefect.client.schemas.objects import StateType

from prefect_nemo import InvalidJobSpec, JobSpec
from prefect_nemo.backends.kuberay import rayjob_manifest
from prefect_nemo.blocks import KubeRayCluster
from prefect_nemo.blocks.kubernetes import KubernetesCluster
from prefect_nemo.jobs import META_FLOW_RUN, JobState, OwnedJob
from prefect_nemo.kube import RAY_JOB
from prefect_nemo.lifecycle import job_metadata
from prefect_nemo.tasks.sweeper import (
    LEASE_S,
    Beat,
    Evidence,
    Verdict,
    judge,
    sweep,
)
from tests.conftest import subprocess_env
from tests.sweep_scenario import Engine, assert_reported, kill_9_scenario, wait_for
from tests.test_kuberay import cluster_spec

# ---------------------------------------------------------------------------------------------
# Bad inputs, on the loopback Kubernetes API: RayJobs on a RayCluster that does not exist stay
# PENDING (nothing runs), which is all the sweeper looks at.


def pending_block(kube_block: KubernetesCluster, **kw: Any) -> KubeRayCluster:
    """RayJobs on a RayCluster nobody creates: they stay PENDING; a sweep stops at once."""
    kw.setdefault("sweep_grace_s", 0)
    return KubeRayCluster(kubernetes=kube_block, ray_cluster_name="never-there", **kw)


def submit(block: KubeRayCluster, owner: str | None) -> str:
    """A RayJob as prefect-nemo submits it for flow run `owner` (None: outside any run)."""
    spec = JobSpec(entrypoint="sleep 120", name=f"j-{uuid.uuid4().hex[:6]}")
    job_id = spec.name or ""
    meta = job_metadata(spec, "test", job_id, {META_FLOW_RUN: owner or ""})
    block.backend().submit(spec, job_id, meta)
    return job_id


def live(block: KubeRayCluster, job_id: str) -> bool:
    status = block.backend().find(job_id)
    return status is not None and not status.state.is_terminal()


def cli(prefect_api: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`prefect-nemo ARGS` against the session's Prefect API."""
    return subprocess.run(
        [sys.executable, "-m", "prefect_nemo.cli", *args],
        env=subprocess_env(prefect_api), capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_an_unknown_block_fails_before_anything_is_stopped(
    prefect_api: str, kube_server: Any, kube_block: KubernetesCluster
) -> None:
    """An unknown block name is bad input: it fails before any job is judged or stopped (the
    project's rule: "Bad input fails before anything is submitted or applied, with an error
    naming the field and the fix"), and `prefect-nemo sweep` exits non-zero saying so."""
    block = pending_block(kube_block)
    dead = submit(block, str(uuid.uuid4()))  # a run that no longer exists: stopped by a sweep
    with pytest.raises(InvalidJobSpec) as info:
        sweep(["kube-ray-cluster/no-such-block", block])
    message = str(info.value)
    assert "'kube-ray-cluster/no-such-block': no such block document" in message
    assert "prefect-nemo blocks apply" in message, "the fix"
    with pytest.raises(InvalidJobSpec, match="name a saved block as '<block-type-slug>/<name>'"):
        sweep(["no-slash", block])
    assert live(block, dead), "nothing was stopped"

    done = cli(prefect_api, "sweep", "kube-ray-cluster/no-such-block")
    assert done.returncode == 2
    assert "error: blocks='kube-ray-cluster/no-such-block': no such block document" in done.stderr
    assert live(block, dead)
    block.backend().request_stop(dead)


def test_an_unreachable_cluster_is_reported_and_the_others_are_swept(
    prefect_api: str, kube_server: Any, kube_block: KubernetesCluster
) -> None:
    """"a block whose cluster is unreachable": said in the sweep run's log in the Prefect API
    (which block, why, that none of its jobs was touched), and the clusters that answer are
    still swept."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    block = pending_block(kube_block)
    dead = submit(block, str(uuid.uuid4()))
    config = kube_server.kubeconfig()
    config["clusters"][0]["cluster"]["server"] = "http://127.0.0.1:9"  # nothing listens there
    away = pending_block(KubernetesCluster(kubeconfig=config, request_timeout_s=2))

    @flow(name="sweep-in-test")
    def sweeping() -> list[Verdict]:
        return sweep([away, block])

    state = sweeping(return_state=True)
    verdicts = state.result()
    assert [(v.job_id, v.stop, v.outcome) for v in verdicts] == [(dead, True, "STOPPED")]
    assert not live(block, dead)
    only = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[state.state_details.flow_run_id]))
    with get_client(sync_client=True) as client:
        said = "\n".join(log.message for log in client.read_logs(log_filter=only))
    assert (
        "sweep: cannot list the jobs of KubeRayCluster, so none of them was judged or stopped "
        "(the other clusters are swept): cannot reach the Kubernetes API at http://127.0.0.1:9"
    ) in said, said


def test_a_job_without_our_labels_or_owner_is_left_alone(
    prefect_api: str, kube_server: Any, kube_block: KubernetesCluster
) -> None:
    """"it never touches ... a job we did not submit": a RayJob made by hand (no labels of
    ours) is never listed; one we submitted outside any flow run (no owner) is listed, kept,
    and the verdict says why."""
    block = pending_block(kube_block)
    hand = f"hand-{uuid.uuid4().hex[:6]}"
    manifest = rayjob_manifest(
        JobSpec(entrypoint="sleep 120"), hand, {}, block._config(), namespace="default"
    )
    manifest["metadata"]["labels"] = {}  # made by someone else
    kube_block.api().create(RAY_JOB, manifest)
    orphan = submit(block, None)
    verdicts = {v.job_id: v for v in sweep([block])}
    assert hand not in verdicts
    assert not verdicts[orphan].stop
    assert verdicts[orphan].why == "it names no flow run (submitted outside any run)"
    assert live(block, hand) and live(block, orphan)
    for job_id in (hand, orphan):
        block.backend().request_stop(job_id)


def test_dry_run_stops_nothing_and_says_what_it_would_stop(
    prefect_api: str, kube_server: Any, kube_block: KubernetesCluster
) -> None:
    """`prefect-nemo sweep --dry-run BLOCK` judges, stops nothing, and names each job it
    would stop with the reason."""
    block = pending_block(kube_block)
    name = f"sweep-dry-{uuid.uuid4().hex[:6]}"
    block.save(name)
    dead = submit(block, str(uuid.uuid4()))
    done = cli(prefect_api, "sweep", "--dry-run", f"kube-ray-cluster/{name}")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    line = f"kube-ray-cluster/{name}: {dead}: its flow run no longer exists"
    assert f"{line} (" in out and "-> would stop\n" in out, out
    assert "would stop 1" in out
    assert live(block, dead)
    assert block.backend().find(dead).state is JobState.PENDING
    block.backend().request_stop(dead)


def test_a_run_killed_just_after_it_submitted_is_dead_once_its_heartbeats_lapse() -> None:
    """Issue 17: "0 jobs of the killed run still running `sweep_grace_s + 60 s` after the
    kill". A run renewing a 30 s lease is killed 5 s after it submitted: the job's submission
    (which counts LEASE_S, 90 s, while no heartbeat has named the job) does not outlast the
    heartbeats that did name it."""
    grace, killed = 300.0, datetime(2026, 11, 25, 12, 0, tzinfo=UTC)
    submitted = killed - timedelta(seconds=5)
    job = OwnedJob(
        job_id="job-1", state=JobState.RUNNING, flow_run_id="run-a", submitted_at=submitted
    )
    beat = Beat(killed - timedelta(seconds=1), killed + timedelta(seconds=29))
    run = SimpleNamespace(state=SimpleNamespace(type=StateType.RUNNING, timestamp=job.submitted_at))
    now = killed + timedelta(seconds=grace + 60)
    evidence = Evidence(now, {("c", "job-1"): beat}, {"run-a": beat}, {}, {"run-a": run})
    verdict = judge("b", "c", job, evidence, grace, LEASE_S)
    assert verdict.stop and "stopped saying it is alive" in verdict.why, verdict


@pytest.fixture(scope="module")
def shared_raycluster(kube_block: KubernetesCluster, kuberay: Any) -> str:
    """An existing RayCluster the scenario's RayJobs run on (the KubeRay simulator brings it
    up; every simulated cluster runs on the session's one real Ray)."""
    from prefect_nemo.backends.kuberay import ensure_ray_cluster, wait_ray_cluster_ready
    ensure_ray_cluster(kube_block.api(), cluster_spec(), "sweep-shared")
    wait_ray_cluster_ready(kube_block.api(), "sweep-shared", timeout_s=60)
    return "sweep-shared"


@pytest.mark.slow
def test_kuberay_kill_9_the_sweeper_stops_the_dead_runs_rayjobs_and_spares_a_rerun(
    prefect_api: str, kube_block: KubernetesCluster, shared_raycluster: str, ray_head: Any,
    tmp_path: Path,
) -> None:  # fmt: skip
    """The kill -9 scenario (`kill_9_scenario`) on KubeRay: RayJobs on the loopback API server,
    run by the KubeRay simulator on a real Ray; a RayJob made by hand on the same cluster is
    never touched; what the sweeper stopped is reported (`assert_reported`)."""
    since = datetime.now(UTC)
    block = KubeRayCluster(
        kubernetes=kube_block, ray_cluster_name=shared_raycluster, ray_token=ray_head.token,
        sweep_grace_s=5, stop_timeout_s=30,
    )  # fmt: skip
    name = f"sweep-e2e-{uuid.uuid4().hex[:6]}"
    block.save(name)
    api = kube_block.api()

    def states() -> dict[str, str]:
        items, _ = api.list(RAY_JOB, "default")
        return {
            o["metadata"]["name"]: (o.get("status") or {}).get("jobStatus") or "PENDING"
            for o in items
        }

    hand = f"hand-{uuid.uuid4().hex[:6]}"  # made by someone else on the same RayCluster
    manifest = rayjob_manifest(
        JobSpec(entrypoint="sleep 600"), hand, {}, block._config(), namespace="default"
    )
    manifest["metadata"]["labels"] = {}
    api.create(RAY_JOB, manifest)
    engine = Engine(block, f"kube-ray-cluster/{name}", states, block.backend().request_stop)
    try:
        wait_for(lambda: states()[hand] == "RUNNING", 60, "the hand-made RayJob to run")
        swept = kill_9_scenario(engine, prefect_api, tmp_path)
        assert states()[hand] == "RUNNING", "a RayJob we did not submit is never touched"
    finally:
        engine.stop(hand)
    assert_reported(swept, since)


@pytest.mark.slow
@pytest.mark.nemo_run
def test_slurm_kill_9_the_sweeper_scancels_the_dead_runs_jobs_and_spares_a_rerun(
    prefect_api: str, slurm: Any, tmp_path: Path
) -> None:
    """The kill -9 scenario (`kill_9_scenario`) on a real Slurm (sbatch through NeMo-Run over
    SSH; the owner rides in each job's comment); a job sbatch'ed by hand as the same user is
    never touched."""
    from tests.test_nemo_run_slurm import slurm_block

    job_dir = tmp_path / "jobs"
    job_dir.mkdir()
    block = slurm_block(slurm, job_dir)
    block.sweep_grace_s = 5
    name = f"sweep-e2e-{uuid.uuid4().hex[:6]}"
    block.save(name)

    def states() -> dict[str, str]:
        out = slurm.run(["squeue", "-h", "-t", "all", "-o", "%j|%T|%i"]).stdout
        return {line.split("|")[0]: line.split("|")[1] for line in out.splitlines() if line}

    hand = f"hand-{uuid.uuid4().hex[:6]}"  # held: it takes no slot of the small test cluster
    sid = slurm.run(
        ["sbatch", "--parsable", "--hold", "-A", slurm.account, "-p", slurm.partition,
         "-J", hand, "-o", "/dev/null", "--wrap", "sleep 600"]
    ).stdout.strip()  # fmt: skip
    # other tests' jobs may hold slots of the shared 2-core test cluster: a job of ours may
    # wait PENDING, and the sweeper must stop it all the same
    engine = Engine(
        block, f"slurm-cluster/{name}", states, block.backend().request_stop,
        running=frozenset({"RUNNING", "PENDING"}),
    )  # fmt: skip
    try:
        swept = kill_9_scenario(engine, prefect_api, tmp_path)
        assert states()[hand] == "PENDING", "a job we did not sbatch is untouched"
    finally:
        slurm.run(["scancel", sid], check=False)
    assert len(swept.killed) == 6
