"""`owned_jobs()` of every NeMo-Run backend: the sweeper's view of a cluster, read from the
service itself (Slurm's queue on a real Slurm, Lepton's and run:ai's lists on the loopback
servers, Ray's job list behind the Lepton proxy, the local runner), never from the registry
under NEMORUN_HOME, which a sweeper on another machine does not share.

Issue 17: "Every job we submit already carries its flow run id. Build an out-of-process ...
way to find jobs whose flow run is dead and stop them, on every backend (Ray Jobs metadata,
Kubernetes labels, Slurm job comment/name, Lepton and run:ai labels)" and "it never touches ...
a job we did not submit". The brief's contract: "read FROM THE JOBS THEMSELVES ...: one
listing, no request per job, so a sweeper on any machine ... finds them; a job we did not
submit is never listed."
"""

from __future__ import annotations

import shutil
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import requests
from pydantic import SecretStr

from prefect_nemo.backends.nemo_run import slurm as slurm_backend
from prefect_nemo.backends.nemo_run.slurm import ssh
from prefect_nemo.blocks.dgx_cloud import DGXCloudRayCluster
from prefect_nemo.blocks.lepton import LeptonRayCluster
from prefect_nemo.blocks.slurm import SlurmCluster
from prefect_nemo.errors import InvalidJobSpec
from prefect_nemo.jobs import META_FLOW_RUN, JobSpec, JobState, OwnedJob
from prefect_nemo.kube import FLOW_RUN_LABEL, MANAGED_BY
from prefect_nemo.lifecycle import job_metadata, stop_and_confirm
from prefect_nemo.placement import PlacementSpec
from prefect_nemo.testing.lepton import LeptonServer
from prefect_nemo.testing.runai import RunaiServer
from tests.test_nemo_run_dgx_cloud import SECRET, cluster_block
from tests.test_nemo_run_lepton import TOKEN, job_posts, workspace_block
from tests.test_nemo_run_slurm import slurm_block, wait_rows

pytestmark = pytest.mark.nemo_run

HELD = "sleep 300"


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def meta(spec: JobSpec, owner: str | None) -> dict[str, str]:
    """The metadata lifecycle hands `submit` (a job outside a flow run has no owner)."""
    return job_metadata(spec, "test", spec.name or "job", {META_FLOW_RUN: owner or ""})


def owners(jobs: list[OwnedJob], ids: set[str]) -> dict[str, str | None]:
    """{job id: owner} of the listed jobs among `ids` (the cluster may hold other tests' jobs)."""
    return {j.job_id: j.flow_run_id for j in jobs if j.job_id in ids}


def wait_for(check: Any, timeout_s: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(0.1)
    raise AssertionError("condition not met in time")


def assert_listed_live(jobs: list[OwnedJob], ids: set[str], since: datetime) -> None:
    for job in (j for j in jobs if j.job_id in ids):
        assert job.state in (JobState.PENDING, JobState.QUEUED, JobState.RUNNING), job
        assert job.submitted_at is not None and job.submitted_at >= since - timedelta(seconds=2)


# -- Slurm: the owner in the job's comment, one squeue over the SSH connection ---------------


@pytest.fixture(scope="module")
def job_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This module's remote job dir (other modules' jobs on the shared Slurm are elsewhere)."""
    return tmp_path_factory.mktemp("slurm-owned")


def hand_sbatch(slurm: Any, *options: str) -> str:
    """A job sbatch'ed by hand on the cluster, as the same Slurm user: its Slurm id."""
    args = ["sbatch", "--parsable", "-A", slurm.account, "-p", slurm.partition, *options]
    return slurm.run([*args, "-o", "/dev/null", "--wrap", HELD]).stdout.strip()


@pytest.mark.slow
def test_slurm_lists_our_live_jobs_from_squeue_with_their_owners(slurm, job_root):
    """Issue 17: "find jobs whose flow run is dead and stop them, on every backend (... Slurm
    job comment/name ...)" and "it never touches ... a job we did not submit". Each job we
    sbatch carries ``--comment=prefect_nemo.flow_run_id=<owner>`` (shown in the dry run);
    `owned_jobs` is one squeue: our live jobs with their owners, not the jobs sbatch'ed by
    hand (no comment, or our comment on a script outside the block's job dir), not ended ones."""
    backend = slurm_block(slurm, job_root).backend()
    owner, since = str(uuid.uuid4()), datetime.now(UTC)
    held, plain = (JobSpec(entrypoint=HELD, name=unique(n)) for n in ("owned", "plain"))
    quick = JobSpec(entrypoint="true", name=unique("quick"))
    script = backend.render(held, held.name, meta(held, owner))[0]["script"]
    assert f"#SBATCH --comment=prefect_nemo.flow_run_id={owner}\n" in script
    # `quick` ends first: the debug partition runs only two one-CPU jobs at once on 2 cores
    # (squeue shows its OverSubscribe=FORCE:4 sharing no core beside the kit's preemption
    # settings), and the four held jobs below kept it PENDING for Resources
    backend.submit(quick, quick.name, meta(quick, owner))
    wait_rows(slurm, quick.name, "COMPLETED", timeout_s=120)
    for spec, who in ((held, owner), (plain, None)):
        backend.submit(spec, spec.name, meta(spec, who))
    hand, mimic = unique("hand"), unique("mimic")
    by_hand = [
        hand_sbatch(slurm, "-J", hand),
        hand_sbatch(slurm, "-J", mimic, f"--comment=prefect_nemo.flow_run_id={owner}"),
    ]
    try:
        jobs = backend.owned_jobs()
        ids = {held.name, plain.name, quick.name, hand, mimic}
        assert owners(jobs, ids) == {held.name: owner, plain.name: None}
        assert_listed_live(jobs, ids, since)
        assert sorted(j.job_id for j in jobs) == sorted([held.name, plain.name]), jobs
    finally:
        for job_id in (held.name, plain.name):
            backend.request_stop(job_id)
        slurm.run(["scancel", *by_hand], check=False)


def sacct_by_sid(slurm: Any, sid: str) -> list[dict[str, str]]:
    fields = ("JobID", "JobName", "State")
    out = slurm.run(["sacct", "-X", "-n", "-P", "-j", sid, "-o", ",".join(fields)], check=False)
    return [dict(zip(fields, line.split("|"), strict=False)) for line in out.stdout.splitlines()]


@pytest.mark.slow
def test_slurm_sweeper_stop_from_a_fresh_backend_is_cancelled_in_sacct(slurm, job_root):
    """Issue 17: a sweeper "on any machine" finds the job of a dead run and stops it. A fresh
    block (new SSH connection, no cached Slurm ids) lists the job from squeue, and
    `stop_and_confirm` on it ends CANCELLED in sacct; a job sbatch'ed by hand stays untouched."""
    job = JobSpec(entrypoint=HELD, name=unique("swept"))
    owner = str(uuid.uuid4())
    slurm_block(slurm, job_root).backend().submit(job, job.name, meta(job, owner))
    by_hand = hand_sbatch(slurm, "-J", unique("bystander"))
    try:
        ssh.close_all()  # cold: the sweeper's own connection, no Slurm ids known
        slurm_backend._slurm_ids.clear()
        fresh = slurm_block(slurm, job_root).backend()
        assert owners(fresh.owned_jobs(), {job.name}) == {job.name: owner}
        status = stop_and_confirm(fresh, job.name, timeout_s=60)
        assert status is not None and status.state is JobState.STOPPED
        assert [r["State"].split()[0] for r in wait_rows(slurm, job.name, "CANCELLED")] == [
            "CANCELLED"
        ]
        assert job.name not in {j.job_id for j in fresh.owned_jobs()}
        (row,) = sacct_by_sid(slurm, by_hand)
        assert row["State"] in ("PENDING", "RUNNING"), "a job we did not submit is untouched"
    finally:
        slurm.run(["scancel", by_hand], check=False)


def test_slurm_comment_is_ours_to_write() -> None:
    """The owner rides in the job's comment: a block that sets its own comment would hide the
    job from the sweeper, so it fails before anything is sent, naming the field."""
    block = SlurmCluster(
        host="127.0.0.1",
        port=1,  # nothing listens: no connection is made
        user="me",
        identity_key=SecretStr(
            "-----BEGIN OPENSSH PRIVATE KEY-----\nx\n-----END OPENSSH PRIVATE KEY-----"
        ),
        job_dir="/jobs",
        account="a",
        additional_parameters={"comment": "billing"},
    )
    with pytest.raises(InvalidJobSpec, match=r"SlurmCluster\.additional_parameters\['comment'\]"):
        block.backend().validate(JobSpec(entrypoint="true"))


# -- Lepton: labels on the job, one list by label selector -------------------------------------


@pytest.fixture
def lepton() -> Any:
    # four nodes: the tests hold two jobs while a third runs to its end
    with LeptonServer(
        token=TOKEN, start_s=0.1, running_s=0.4, node_groups={"nemo-nodes": 4}
    ) as server:
        yield server


def lepton_hand_job(lepton: LeptonServer, job_id: str, labels: dict[str, str]) -> None:
    """A job created in the workspace without prefect-nemo (its labels as given)."""
    body = {
        "metadata": {"id": job_id, "labels": labels},
        "spec": {"resource_shape": "cpu.small", "container": {"command": ["sleep", "300"]}},
    }
    headers = {"Authorization": f"Bearer {lepton.token}"}
    response = requests.post(f"{lepton.api_url}/jobs", json=body, headers=headers, timeout=10)
    assert response.status_code == 200, response.text


def test_lepton_lists_our_live_jobs_by_label(lepton: LeptonServer, tmp_path: Path) -> None:
    """Issue 17: "... on every backend (... Lepton and run:ai labels)" and "it never touches
    ... a job we did not submit". Each job NeMo-Run creates carries our labels (managed-by
    prefect-nemo, prefect.io/flow-run-id=<owner>; shown in the dry run); `owned_jobs` is one
    list call with leptonai's label selector (``query``): our live jobs with their owners, not
    jobs made without us (no labels, or only Prefect's flow-run label), not ended ones."""
    lepton.hold("own")
    backend = workspace_block(lepton, tmp_path).backend()
    owner, since = str(uuid.uuid4()), datetime.now(UTC)
    held, plain = (JobSpec(entrypoint=HELD, name=unique(n)) for n in ("own-a", "own-b"))
    quick = JobSpec(entrypoint="true", name=unique("quick"))
    (_, sent) = backend.render(held, held.name, meta(held, owner))
    assert sent["request"]["metadata"]["labels"] == {
        MANAGED_BY: "prefect-nemo",
        FLOW_RUN_LABEL: owner,
    }
    for spec, who in ((held, owner), (plain, None), (quick, owner)):
        backend.submit(spec, spec.name, meta(spec, who))
    lepton_hand_job(lepton, "own-hand", {})
    lepton_hand_job(lepton, "own-prefect", {FLOW_RUN_LABEL: owner})  # Prefect's own label only
    assert {p.body["metadata"]["id"]: p.body["metadata"].get("labels") for p in job_posts(lepton)}[
        plain.name
    ] == {MANAGED_BY: "prefect-nemo"}
    wait_for(lambda: lepton.jobs[quick.name].state(time.time()) == "Completed")
    lepton.requests.clear()
    jobs = backend.owned_jobs()
    assert owners(jobs, set(lepton.jobs)) == {held.name: owner, plain.name: None}
    assert_listed_live(jobs, {held.name, plain.name}, since)
    asked = lepton.requests.find("GET")
    assert {r.path for r in asked} == {f"/api/v2/workspaces/{lepton.workspace_id}/jobs"}
    assert asked[0].query["query"] == [f"{MANAGED_BY}=prefect-nemo"], "one list, no GET per job"


def test_lepton_sweeper_stop_from_a_fresh_backend(lepton: LeptonServer, tmp_path: Path) -> None:
    """Issue 17: the sweeper stops the job of a dead run from another machine: a fresh block
    with no registry (NEMORUN_HOME's entries removed) lists the job and stops it."""
    lepton.hold("own")
    job = JobSpec(entrypoint=HELD, name=unique("own-swept"))
    owner = str(uuid.uuid4())
    first = workspace_block(lepton, tmp_path).backend()
    first.submit(job, job.name, meta(job, owner))
    lepton_hand_job(lepton, "own-bystander", {})
    shutil.rmtree(first.registry_dir())
    fresh = workspace_block(lepton, tmp_path).backend()
    assert owners(fresh.owned_jobs(), {job.name}) == {job.name: owner}
    status = stop_and_confirm(fresh, job.name, timeout_s=10, poll_s=0.05)
    assert status is not None and status.state is JobState.STOPPED
    assert lepton.jobs[job.name].state(time.time()) == "Stopped"
    assert lepton.jobs["own-bystander"].state(time.time()) == "Running"
    assert fresh.owned_jobs() == []


# -- DGX Cloud (run:ai): labels and the owner variable on the workload, one workload list -----


@pytest.fixture
def runai() -> Any:
    with RunaiServer(client_secret=SECRET, creating_s=0.05, initializing_s=0.05) as server:
        yield server


def runai_hand_workload(runai: RunaiServer, name: str, spec: dict[str, Any]) -> None:
    """A training created in the project without prefect-nemo."""
    base = runai.base_url
    token = requests.post(
        f"{base}/token",
        json={
            "grantType": "client_credentials",
            "clientId": runai.client_id,
            "clientSecret": runai.client_secret,
        },
        timeout=10,
    ).json()["accessToken"]
    body = {
        "name": name,
        "projectId": runai.projects["nemo-project"],
        "clusterId": runai.cluster_id,
        "spec": {"image": "busybox", **spec},
    }
    response = requests.post(
        f"{base}/workloads/trainings",
        json=body,
        headers={"Authorization": f"Bearer {token}"},
        timeout=10,
    )
    assert response.status_code == 202, response.text


def test_runai_lists_our_live_workloads_with_their_owners(
    runai: RunaiServer, tmp_path: Path
) -> None:
    """Issue 17: "... on every backend (... Lepton and run:ai labels)" and "it never touches
    ... a job we did not submit". Each training or distributed workload carries our run:ai
    labels (``spec.labels``, which run:ai's API documents as "Set of labels to populate into
    the container running the workload") and PREFECT_NEMO_FLOW_RUN_ID; `owned_jobs` is one
    ``GET /workloads`` of the project, whose items run:ai documents with their
    ``environmentVariables`` (not their labels): our live workloads with their owners."""
    runai.hold("own")
    backend = cluster_block(runai, tmp_path / "pvc").backend()
    owner, since = str(uuid.uuid4()), datetime.now(UTC)
    held = JobSpec(entrypoint=HELD, name=unique("own-a"))
    plain = JobSpec(
        entrypoint=HELD,
        name=unique("own-b"),
        placement=PlacementSpec(nodes=2, gpus_per_node=1, strategy="spread"),  # distributed
    )
    quick = JobSpec(entrypoint="true", name=unique("quick"))
    (sent,) = backend.render(held, held.name, meta(held, owner))
    assert {"name": FLOW_RUN_LABEL, "value": owner} in sent["request"]["spec"]["labels"]
    for spec, who in ((held, owner), (plain, None), (quick, owner)):
        backend.submit(spec, spec.name, meta(spec, who))
    runai_hand_workload(runai, "own-hand", {})
    runai_hand_workload(
        runai, "own-labelled", {"labels": [{"name": FLOW_RUN_LABEL, "value": owner}]}
    )
    (made,) = runai.by_name(held.name)
    assert {"name": MANAGED_BY, "value": "prefect-nemo"} in made.spec["labels"]
    assert made.env()["PREFECT_NEMO_FLOW_RUN_ID"] == owner
    wait_for(lambda: runai.by_name(quick.name)[0].phase(time.time()) == "Completed")
    runai.requests.clear()
    jobs = backend.owned_jobs()
    assert owners(jobs, {held.name, plain.name, quick.name, "own-hand", "own-labelled"}) == {
        held.name: owner,
        plain.name: None,
    }
    assert len(jobs) == 2
    assert_listed_live(jobs, {held.name, plain.name}, since)
    assert [r.path for r in runai.requests.find("GET")] == ["/api/v1/workloads"]


def test_runai_sweeper_stop_from_a_fresh_backend(runai: RunaiServer, tmp_path: Path) -> None:
    """Issue 17: the sweeper stops the job of a dead run from another machine: a fresh block
    with no registry lists the workload and stops it (run:ai's documented suspend)."""
    runai.hold("own")
    job = JobSpec(entrypoint=HELD, name=unique("own-swept"))
    owner = str(uuid.uuid4())
    first = cluster_block(runai, tmp_path / "pvc").backend()
    first.submit(job, job.name, meta(job, owner))
    runai_hand_workload(runai, "own-bystander", {})
    shutil.rmtree(first.registry_dir())
    fresh = cluster_block(runai, tmp_path / "pvc").backend()
    assert owners(fresh.owned_jobs(), {job.name}) == {job.name: owner}
    status = stop_and_confirm(fresh, job.name, timeout_s=10, poll_s=0.05)
    assert status is not None and status.state is JobState.STOPPED
    (bystander,) = runai.by_name("own-bystander")
    assert bystander.phase(time.time()) == "Running"
    assert fresh.owned_jobs() == []


def test_dgx_cloud_ray_workload_carries_its_owner(runai: RunaiServer, tmp_path: Path) -> None:
    """Issue 17, Ray on DGX Cloud: each Ray job is a distributed workload carrying its owner
    as the DGX Cloud backend's do, so the same one listing finds it."""
    runai.hold("own")
    backend = DGXCloudRayCluster(cluster=cluster_block(runai, tmp_path / "pvc")).backend()
    job = JobSpec(entrypoint="python grpo.py", name=unique("own-rl"))
    owner = str(uuid.uuid4())
    backend.submit(job, job.name, meta(job, owner))
    (made,) = runai.by_name(job.name)
    assert (
        made.kind == "distributed"
        and {"name": FLOW_RUN_LABEL, "value": owner} in made.spec["labels"]
    )
    assert owners(backend.owned_jobs(), {job.name}) == {job.name: owner}


# -- Ray on Lepton: our Ray Jobs backend on the proxied dashboard -----------------------------


@pytest.mark.slow
def test_lepton_ray_lists_our_ray_jobs_through_the_proxy(
    lepton: LeptonServer, ray_head: Any, ray_client: Any, tmp_path: Path
) -> None:
    """Issue 17, Ray on Lepton: "Ray Jobs metadata" through the workspace's dashboard proxy:
    our Ray jobs with their owners, not a Ray job submitted without us."""
    lepton.ray_dashboard(ray_head.dashboard_url, ray_head.token)
    block = LeptonRayCluster(workspace=workspace_block(lepton, tmp_path), ray_cluster_name="own")
    backend = block.backend()
    owner = str(uuid.uuid4())
    ours = [JobSpec(entrypoint="sleep 60", name=unique(n)) for n in ("ray-a", "ray-b")]
    for spec, who in zip(ours, (owner, None), strict=True):
        backend.submit(spec, spec.name, meta(spec, who))
    theirs = ray_client.submit_job(entrypoint="sleep 60")
    try:
        ids = {s.name for s in ours} | {theirs}
        assert owners(backend.owned_jobs(), ids) == {ours[0].name: owner, ours[1].name: None}
    finally:
        for spec in ours:
            backend.request_stop(spec.name)
        ray_client.stop_job(theirs)


# -- local: the live jobs of this process's runner, the owner in each process's environment ---


def test_local_lists_the_runners_live_jobs_with_their_owners() -> None:
    """Issue 17, local: NeMo-Run's local scheduler holds its processes in this process; its
    live jobs are listed with the owner each process carries in its environment, ended ones
    are not, and a stop through the listing ends the job."""
    from prefect_nemo.backends.nemo_run.local import NemoRunLocalBackend

    backend = NemoRunLocalBackend()
    owner, since = str(uuid.uuid4()), datetime.now(UTC)
    held, plain = (JobSpec(entrypoint="sleep 30", name=unique(n)) for n in ("local-a", "local-b"))
    quick = JobSpec(entrypoint="true", name=unique("quick"))
    for spec, who in ((held, owner), (plain, None), (quick, owner)):
        backend.submit(spec, spec.name, meta(spec, who))
    wait_for(lambda: backend.find(quick.name).state.is_terminal())
    ids = {held.name, plain.name, quick.name}
    jobs = backend.owned_jobs()
    assert owners(jobs, ids) == {held.name: owner, plain.name: None}
    assert_listed_live(jobs, {held.name, plain.name}, since)
    for job_id in (held.name, plain.name):
        assert stop_and_confirm(backend, job_id, timeout_s=30).state is JobState.STOPPED
    assert owners(backend.owned_jobs(), ids) == {}
