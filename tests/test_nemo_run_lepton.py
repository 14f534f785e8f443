"""The Lepton backend against the loopback Lepton workspace, NeMo-Run and leptonai unchanged.

Lepton pods cannot run here (NeMo-Run's launch script fetches an init script from GitHub), so
the job's states are simulated; the code delivery is not: the pre-launch command NeMo-Run
wrote into the launch script is run, per replica, with the env the server received.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import threading
import time
import traceback
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from prefect import flow
from pydantic import SecretStr

from prefect_nemo import lifecycle
from prefect_nemo.backends.nemo_run.isolation import home_files
from prefect_nemo.backends.nemo_run.ray_clusters import RUN_LABEL
from prefect_nemo.blocks.lepton import LeptonWorkspace
from prefect_nemo.errors import AuthenticationFailed, BackendUnavailable, InvalidJobSpec
from prefect_nemo.jobs import JobSpec, JobState, Resources
from prefect_nemo.lifecycle import META_FLOW_RUN
from prefect_nemo.packaging import TransportTooLarge
from prefect_nemo.placement import PlacementSpec
from prefect_nemo.tasks import run_job
from prefect_nemo.testing.lepton import LeptonServer
from tests.test_nemo_run_dgx_cloud import (
    assert_close_ends_connections,
    files_text,
    prefect_haystacks,
    sample_source,
    wait_for,
)

pytestmark = pytest.mark.nemo_run

TOKEN = "lep-" + "7d41e0-t0ken-c93a"


@pytest.fixture
def lepton() -> Iterator[LeptonServer]:
    with LeptonServer(token=TOKEN, start_s=0.1, running_s=0.4) as server:
        yield server


def workspace_block(lepton: LeptonServer, tmp_path: Path, **extra: Any) -> LeptonWorkspace:
    """A LeptonWorkspace block on the loopback workspace, its shared mount under tmp_path."""
    shared = tmp_path / "shared"
    return LeptonWorkspace(
        workspace_id=lepton.workspace_id,
        workspace_url=lepton.api_url,
        token=lepton.token,
        node_group="nemo-nodes",
        nemo_run_dir=str(shared / "nemo-run"),
        mounts=[{"path": "/", "mount_path": str(shared), "from": "node-nfs:shared"}],
        **{"stop_timeout_s": 10, "max_poll_interval_s": 0.2, **extra},
    )


@pytest.fixture
def block(lepton: LeptonServer, tmp_path: Path) -> LeptonWorkspace:
    return workspace_block(lepton, tmp_path)


def job_posts(lepton: LeptonServer) -> list[Any]:
    """Job creations other than NeMo-Run's data movers."""
    return [
        r
        for r in lepton.requests.find("POST", "/jobs")
        if not r.body["metadata"]["id"].startswith("data-mover-")
    ]


def run_replicas(command: str, envs: list[dict[str, str]]) -> list[subprocess.CompletedProcess]:
    procs = [
        subprocess.Popen(
            ["/bin/sh", "-c", command],
            env={"PATH": os.environ["PATH"], **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for env in envs
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return results


@pytest.mark.slow
def test_run_job_on_lepton_through_prefect(
    prefect_api: str,
    lepton: LeptonServer,
    block: LeptonWorkspace,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    caplog.set_level(logging.DEBUG)
    since = datetime.now(UTC).isoformat()
    src = sample_source(tmp_path / "src", blob_bytes=200_000)  # > 128 KiB of base64
    spec = JobSpec(
        entrypoint="python3 train.py",
        name="lep-train",
        working_dir=src,
        placement=PlacementSpec(nodes=2, gpus_per_node=1, strategy="spread"),
    )

    @flow
    def train():
        return run_job(spec, cluster=block)

    state = train(return_state=True)
    result = state.result()
    assert result.state is JobState.SUCCEEDED and not result.attached
    job_id = result.handle.job_id
    assert len(job_id) <= 35

    (post,) = job_posts(lepton)
    assert post.body["metadata"]["id"] == job_id  # the Lepton job is named by our job id
    sent = post.body["spec"]
    assert sent["completions"] == sent["parallelism"] == 2
    assert sent["resource_shape"] == "gpu.1xh100-80gb"
    envs = {e["name"]: e["value"] for e in sent["envs"]}
    assert int(envs["PREFECT_NEMO_CODE_CHUNKS"]) == 3
    assert max(len(f"{k}={v}".encode()) for k, v in envs.items()) < 128 * 1024
    # NeMo-Run's data mover carried only the launch script, far below the argv limit.
    (mover,) = [r for r in lepton.requests.find("POST", "/jobs") if r not in job_posts(lepton)]
    assert len(mover.body["spec"]["container"]["command"][2]) < 8 * 1024

    # The launch script's pre-launch line unpacks the code on the shared mount, rank 0 only.
    backend = block.backend()
    script = (backend.local_experiment_dir(job_id) / job_id / "launch_script.sh").read_text()
    (setup,) = [line for line in script.splitlines() if line.endswith("|| exit 1")]
    job = lepton.jobs[job_id]
    results = run_replicas(setup, [lepton.pod_env(job, 1), lepton.pod_env(job, 0)])
    assert [r.returncode for r in results] == [0, 0], [r.stderr for r in results]
    (unpacked,) = Path(block.nemo_run_dir).rglob("train.py")
    assert unpacked.parent.name == "code"  # <lepton job dir>/code, where the script cd's
    assert (unpacked.parent / "pkg/blob.bin").read_bytes() == (src / "pkg/blob.bin").read_bytes()
    assert "cd /nemo_run/code\npython3 train.py" in script

    haystacks = prefect_haystacks(prefect_api, state.state_details.flow_run_id, since, "SUCCEEDED")
    haystacks.update(
        {
            "caplog": caplog.text,
            "stdout/stderr": "".join(capfd.readouterr()),
            "result": result.model_dump_json(),
            "NEMORUN_HOME": files_text(*{p.parent for p in home_files()}),
            "shared mount": files_text(tmp_path / "shared"),
            "job payloads": str([r.body for r in lepton.requests.entries]),
            "block": repr(block) + block.model_dump_json(),
            "environment": str(dict(os.environ)),
        }
    )
    assert "prefect-nemo.job.succeeded" in haystacks["events"]
    for where, text in haystacks.items():
        assert TOKEN not in text, f"the token leaked into {where}"


def test_rerun_attaches_and_a_new_run_does_not_collide(
    lepton: LeptonServer, block: LeptonWorkspace
) -> None:
    lepton.hold("")
    backend = block.backend()
    spec = JobSpec(entrypoint="sleep 30", name="train")
    first = lifecycle.submit_or_attach(backend, spec, scope="flow-run:a", key="train")
    again = lifecycle.submit_or_attach(backend, spec, scope="flow-run:a", key="train")
    other = lifecycle.submit_or_attach(backend, spec, scope="flow-run:b", key="train")
    assert not first.attached and again.attached
    assert again.handle.job_id == first.handle.job_id != other.handle.job_id
    assert sorted(r.body["metadata"]["id"] for r in job_posts(lepton)) == sorted(
        [first.handle.job_id, other.handle.job_id]
    )
    # Another machine (no local record) sees the job in the workspace and attaches.
    backend.release(first.handle.job_id)
    elsewhere = lifecycle.submit_or_attach(block.backend(), spec, scope="flow-run:a", key="train")
    assert elsewhere.attached and len(job_posts(lepton)) == 2
    for sub in (first, other):
        lifecycle.stop_and_confirm(backend, sub.handle.job_id, timeout_s=10)


def test_stop_patches_the_job_stopped(lepton: LeptonServer, block: LeptonWorkspace) -> None:
    lepton.hold("")
    backend = block.backend()
    sub = lifecycle.submit_or_attach(
        backend, JobSpec(entrypoint="sleep 30", name="held"), scope="flow-run:s", key="held"
    )
    job_id = sub.handle.job_id
    wait_for(lambda: backend.find(job_id).state is JobState.RUNNING)
    final = lifecycle.stop_and_confirm(backend, job_id, timeout_s=10, poll_s=0.05)
    assert final is not None and final.state is JobState.STOPPED
    patches = lepton.requests.find("PATCH", f"/jobs/{job_id}")
    assert patches and patches[0].body == {"spec": {"stopped": True}}
    assert job_id in lepton.jobs  # stopped, not deleted: its logs stay readable
    assert "is Stopped" in backend.logs(job_id)


def test_a_failed_job_is_retried_under_a_new_id(
    lepton: LeptonServer, block: LeptonWorkspace
) -> None:
    backend = block.backend()
    spec = JobSpec(entrypoint="exit 3", name="fails")
    lepton.set_outcome("", "Failed")  # every job (data movers aside) fails
    first = lifecycle.submit_or_attach(backend, spec, scope="flow-run:f", key="fails")
    wait_for(lambda: backend.find(first.handle.job_id).state is JobState.FAILED)
    retry = lifecycle.submit_or_attach(backend, spec, scope="flow-run:f", key="fails")
    assert retry.handle.job_id == first.handle.job_id + "-r1" and not retry.attached


def test_bad_token_and_node_group_are_clear_errors(
    lepton: LeptonServer, block: LeptonWorkspace
) -> None:
    wrong = block.model_copy(update={"token": SecretStr("not-" + TOKEN)})
    with pytest.raises(AuthenticationFailed) as info:
        wrong.backend().check_access()
    text = "".join(traceback.format_exception(info.value))
    assert "LeptonWorkspace.token" in text and TOKEN not in text
    with pytest.raises(InvalidJobSpec, match=r"node_group.*nemo-nodes"):
        block.model_copy(update={"node_group": "nope"}).backend().check_access()
    assert not lepton.requests.find("POST", "/jobs")


def test_bad_specs_are_refused_before_submit(
    lepton: LeptonServer, block: LeptonWorkspace, tmp_path: Path
) -> None:
    backend = block.backend()
    big = sample_source(tmp_path / "big", blob_bytes=1_200_000)
    with pytest.raises(TransportTooLarge, match="lepton transport"):
        backend.validate(JobSpec(entrypoint="python3 train.py", working_dir=big))
    with pytest.raises(InvalidJobSpec, match="secret_vars"):
        backend.validate(JobSpec(entrypoint="true", env={"KEY": SecretStr("s3cr3t-value")}))
    with pytest.raises(InvalidJobSpec, match=re.escape("JobSpec.env['HUGE']")):
        backend.validate(JobSpec(entrypoint="true", env={"HUGE": "x" * 131_072}))
    with pytest.raises(InvalidJobSpec, match="label_selector"):
        backend.validate(JobSpec(entrypoint="true", label_selector={"a": "b"}))
    # a fraction of a GPU used to be cut to 0: a CPU-only job nobody asked for
    with pytest.raises(InvalidJobSpec, match=r"JobSpec\.resources\.gpus=0\.5.*whole GPUs"):
        backend.validate(JobSpec(entrypoint="true", resources=Resources(gpus=0.5)))
    assert not lepton.requests.find("POST", "/jobs")


def test_cpu_only_and_secret_references(lepton: LeptonServer, block: LeptonWorkspace) -> None:
    backend = block.model_copy(update={"secret_vars": {"HF_TOKEN": "hf-token"}}).backend()
    spec = JobSpec(entrypoint="true", name="cpu", placement=PlacementSpec(gpus_per_node=0))
    lifecycle.submit_or_attach(backend, spec, scope="flow-run:cpu", key="cpu")
    (post,) = job_posts(lepton)
    assert post.body["spec"]["resource_shape"] == "cpu.small"
    assert {"name": "HF_TOKEN", "value_from": {"secret_name_ref": "hf-token"}} in post.body["spec"][
        "envs"
    ]
    assert not any(k.startswith("LEPTON_") for k in os.environ)  # set only around NeMo-Run


@pytest.mark.slow
def test_ray_on_lepton_runs_on_a_real_ray_behind_the_workspace_proxy(
    prefect_api: str, lepton: LeptonServer, block: LeptonWorkspace, own_ray_head: Any,
    tmp_path: Path,
) -> None:
    """NeMo-Run's LeptonRayCluster creates the cluster; the Ray jobs run on a real Ray head,
    reached (as on Lepton) through the workspace's /rayclusters/<name>/dashboard proxy. A head
    of the module's own: cleanup spares a cluster that runs any Ray job, and the shared head
    runs the other workers' jobs."""
    from prefect_nemo.blocks.lepton import LeptonRayCluster

    lepton.ray_dashboard(own_ray_head.dashboard_url, own_ray_head.token)
    ray_block = LeptonRayCluster(
        workspace=block,
        ray_cluster_name="rl-cluster",
        worker_nodes=2,
        head_resource_shape="cpu.large",
    )
    backend = ray_block.backend()
    backend.check_access()
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "driver.py").write_text(
        "import ray\nray.init()\nprint('cpus', ray.cluster_resources()['CPU'])\n"
    )
    spec = JobSpec(entrypoint="python driver.py", name="grpo", working_dir=tmp_path / "app")
    created_for = str(uuid.uuid4())  # the flow run the cluster is created for
    first = lifecycle.submit_or_attach(
        backend, spec, scope="flow-run:ray", key="grpo", metadata={META_FLOW_RUN: created_for}
    )
    again = lifecycle.submit_or_attach(backend, spec, scope="flow-run:ray", key="grpo")
    assert not first.attached and again.attached
    job_id = first.handle.job_id
    wait_for(lambda: backend.find(job_id).state.is_terminal(), timeout_s=120)
    assert backend.find(job_id).state is JobState.SUCCEEDED, backend.logs(job_id)
    assert "cpus" in backend.logs(job_id)

    (created,) = [r for r in lepton.requests.find("POST") if r.path.endswith("/rayclusters")]
    spec_sent = created.body["spec"]
    assert created.body["metadata"]["id"] == "rl-cluster"
    assert created.body["metadata"]["labels"] == {RUN_LABEL: created_for}
    assert spec_sent["worker_group_specs"][0]["min_replicas"] == 2
    assert spec_sent["head_group_spec"]["resource_shape"] == "cpu.large"
    proxied = lepton.requests.find(None, "/rayclusters/rl-cluster/dashboard/api/jobs")
    assert any(r.method == "POST" and r.status == 200 for r in proxied)  # submitted through it

    @flow
    def rl():
        return run_job(
            JobSpec(entrypoint="python driver.py", working_dir=tmp_path / "app"), ray_block
        )

    result = rl()  # through Prefect's task, on the same cluster (it exists: reused)
    assert result.state is JobState.SUCCEEDED and result.handle.backend == "lepton-ray"
    assert len([r for r in lepton.requests.find("POST") if r.path.endswith("/rayclusters")]) == 1

    sleeper = lifecycle.submit_or_attach(
        backend, JobSpec(entrypoint="sleep 60", name="sleeper"), scope="flow-run:ray", key="s"
    )
    wait_for(lambda: backend.find(sleeper.handle.job_id).state is JobState.RUNNING, 60)
    # Cleanup never deletes a cluster that runs a Ray job, even when its run is over.
    assert backend.cleanup(lambda run: True) == [] and "rl-cluster" in lepton.rayclusters
    final = lifecycle.stop_and_confirm(backend, sleeper.handle.job_id, timeout_s=30)
    assert final is not None and final.state is JobState.STOPPED
    assert backend.cleanup(lambda run: run == created_for) == [
        f"Lepton Ray cluster rl-cluster (created for flow run {created_for})"
    ]
    assert lepton.rayclusters == {} and backend.find(job_id) is None


def test_ray_cluster_start_errors_raise_but_already_exists_attaches(
    lepton: LeptonServer, block: LeptonWorkspace
) -> None:
    from prefect_nemo.blocks.lepton import LeptonRayCluster

    backend = LeptonRayCluster(workspace=block, ray_cluster_name="rl-a").backend()
    lepton.fail_next("POST", "/rayclusters", 400, "quota exceeded for shape gpu.1xh100-80gb")
    with pytest.raises(BackendUnavailable, match="quota exceeded"):
        backend.ensure_cluster(poll_s=0.05)
    assert lepton.rayclusters == {}
    # Someone else creates it between our look and our create: 409, which means attach.
    lepton.fail_next("POST", "/rayclusters", 409, "raycluster 'rl-a' already exists")
    with pytest.raises(BackendUnavailable, match="not ready"):
        LeptonRayCluster(
            workspace=block, ray_cluster_name="rl-a", ready_timeout_s=0.3
        ).backend().ensure_cluster(poll_s=0.05)  # attached, but nobody really made it
    backend.ensure_cluster(poll_s=0.05)  # now created for real, then ready
    backend.ensure_cluster(poll_s=0.05)  # exists: reused
    posts = [r for r in lepton.requests.find("POST") if r.path.endswith("/rayclusters")]
    assert [r.status for r in posts] == [400, 409, 200]

    # Status reads use the workspace client, not the process env: a launch that holds the env
    # (its data mover may poll for minutes) does not hold them up.
    from prefect_nemo.backends.nemo_run import lepton as lepton_backend

    got: list[Any] = []
    with lepton_backend._env_lock:
        reader = threading.Thread(target=lambda: got.append(backend.cluster_state()), daemon=True)
        reader.start()
        reader.join(30)
    assert got and got[0]["ray_ready"] and got[0]["state"] == "Ready"
    assert LeptonRayCluster(workspace=block, ray_cluster_name="rl-b").backend().find("x") is None


def test_logs_of_a_running_job_return_while_lepton_keeps_streaming(
    lepton: LeptonServer, block: LeptonWorkspace
) -> None:
    from prefect_nemo.backends.nemo_run.lepton import LOG_READ_S

    lepton.hold("")
    backend = block.backend()
    sub = lifecycle.submit_or_attach(
        backend, JobSpec(entrypoint="sleep 30", name="chatty"), scope="flow-run:l", key="chatty"
    )
    job_id = sub.handle.job_id
    wait_for(lambda: backend.find(job_id).state is JobState.RUNNING)
    lepton.set_log(job_id, "step 1\n")
    started = time.monotonic()
    text = backend.logs(job_id)
    assert time.monotonic() - started < LOG_READ_S + 3  # the endless stream was cut
    assert text.startswith("step 1\n") and "Running" in text
    lifecycle.stop_and_confirm(backend, job_id, timeout_s=10)
    assert backend.logs(job_id) == "step 1\n"  # an ended job's log is sent whole, at once


def test_close_ends_the_workspace_connections(lepton: LeptonServer, block: LeptonWorkspace) -> None:
    """close() closes the workspace client's connections; a later call opens a new client."""
    backend = block.backend()
    assert_close_ends_connections(backend, lepton.api_url)
    backend.check_access()


def test_a_ray_cluster_created_for_a_run_is_deleted_by_that_runs_teardown(
    lepton: LeptonServer, block: LeptonWorkspace
) -> None:
    """Issue 14 item 7: "Lepton Ray clusters we create are deleted when the run that created
    them ends unless the block says keep_cluster=True". The cluster carries its run's label
    from its create request on; `teardown_for(run)` is what the run's end calls: it deletes the
    cluster that run created, and only that one."""
    from prefect_nemo.blocks.lepton import LeptonRayCluster

    run, other = str(uuid.uuid4()), str(uuid.uuid4())
    backend = LeptonRayCluster(workspace=block, ray_cluster_name="rl-run").backend()
    backend.ensure_cluster(poll_s=0.05, owner=run)
    labels = lepton.rayclusters["rl-run"].body["metadata"]["labels"]
    assert labels == {RUN_LABEL: run}
    assert "kept" in backend.teardown_for(other)()  # another run's end leaves it alone
    assert "rl-run" in lepton.rayclusters
    assert backend.teardown_for(run)() == "Lepton Ray cluster rl-run deleted"
    assert "rl-run" not in lepton.rayclusters
    assert "already gone" in backend.teardown_for(run)()  # a second end is harmless

    # A cluster the run only reused (someone else's) is not the run's to delete.
    LeptonRayCluster(workspace=block, ray_cluster_name="rl-run").backend().ensure_cluster(
        poll_s=0.05, owner=other
    )
    backend.ensure_cluster(poll_s=0.05, owner=run)  # exists: reused, not relabelled
    assert "kept" in backend.teardown_for(run)() and "rl-run" in lepton.rayclusters


@pytest.mark.slow
def test_the_cluster_a_flow_created_goes_when_the_flow_ends_however_it_ends(
    prefect_api: str, lepton: LeptonServer, block: LeptonWorkspace, own_ray_head: Any,
    tmp_path: Path,
) -> None:
    """Issue 14 item 7: "Lepton Ray clusters we create are deleted when the run that created
    them ends unless the block says keep_cluster=True": a flow that completes, one that fails
    after its job, and one with keep_cluster=True, each on a cluster it created (on the
    module's own head: a cluster that runs any Ray job is spared)."""
    from prefect_nemo.blocks.lepton import LeptonRayCluster

    lepton.ray_dashboard(own_ray_head.dashboard_url, own_ray_head.token)

    def on_own_cluster(name: str, entrypoint: str, **extra: Any) -> Any:
        ray_block = LeptonRayCluster(workspace=block, ray_cluster_name=name, **extra)

        @flow(name=f"lepton-{name}")
        def uses_a_cluster() -> None:
            run_job(JobSpec(entrypoint=entrypoint, name="step"), ray_block)

        return uses_a_cluster(return_state=True)

    completed = on_own_cluster("rl-done", "echo done")
    assert completed.is_completed() and "rl-done" not in lepton.rayclusters
    failed = on_own_cluster("rl-failed", "exit 3")
    assert failed.is_failed() and "rl-failed" not in lepton.rayclusters
    kept = on_own_cluster("rl-kept-e2e", "echo done", keep_cluster=True)
    assert kept.is_completed() and "rl-kept-e2e" in lepton.rayclusters
    created = [r.body["metadata"]["id"] for r in lepton.requests.find("POST")
               if r.path.endswith("/rayclusters")]  # fmt: skip
    assert created == ["rl-done", "rl-failed", "rl-kept-e2e"], "each flow created its cluster"


def test_keep_cluster_leaves_no_run_label_and_no_teardown(
    lepton: LeptonServer, block: LeptonWorkspace
) -> None:
    """Issue 14 item 7: created clusters are deleted with their run "unless the block says
    keep_cluster=True": a kept cluster carries no run label (so cleanup never takes it) and its
    run has nothing to tear down."""
    from prefect_nemo.blocks.lepton import LeptonRayCluster

    backend = LeptonRayCluster(
        workspace=block, ray_cluster_name="rl-kept", keep_cluster=True
    ).backend()
    backend.ensure_cluster(poll_s=0.05, owner=str(uuid.uuid4()))
    assert not lepton.rayclusters["rl-kept"].body["metadata"].get("labels")
    assert backend.teardown_for(str(uuid.uuid4())) is None
    assert backend.cleanup(lambda run: True) == [] and "rl-kept" in lepton.rayclusters


def test_cleanup_deletes_the_clusters_of_runs_that_are_over(
    prefect_api: str, lepton: LeptonServer, block: LeptonWorkspace
) -> None:
    """Issue 14 item 7: "a crash leaves a label that `prefect-nemo cleanup` finds": the block's
    cleanup() asks the Prefect API about the run each labelled cluster names and deletes the
    clusters of runs that are over (a final state, or gone), never a live run's nor an
    unlabelled one."""
    from prefect.client.orchestration import get_client
    from prefect.states import Crashed, Running

    from prefect_nemo.blocks.lepton import LeptonRayCluster

    probe = flow(name="lepton-cleanup-probe")(lambda: None)
    runs = {}
    with get_client(sync_client=True) as client:
        for name, state in (("crashed", Crashed()), ("live", Running())):
            flow_run = client.create_flow_run(probe)
            client.set_flow_run_state(flow_run.id, state, force=True)
            runs[name] = str(flow_run.id)
    runs["gone"] = str(uuid.uuid4())  # deleted from the API: over too
    lepton.ray_ready_s = 3600.0  # no Ray up in them (a cluster with live Ray jobs is kept)

    def create(name: str, owner: str, **extra: Any) -> None:
        from leptonai.api.v1.types.raycluster import LeptonRayCluster as Request

        backend = LeptonRayCluster(workspace=block, ray_cluster_name=name, **extra).backend()
        request = backend.cluster_request(backend._node_group_id(), owner)
        backend.lepton.client.raycluster.create(Request.model_validate(request))

    for name, run in runs.items():
        create(f"rl-{name}", run)
    create("rl-kept", runs["crashed"], keep_cluster=True)
    create("rl-unlabelled", "")

    removed = LeptonRayCluster(workspace=block, ray_cluster_name="rl-any").cleanup()
    assert sorted(removed) == [
        f"Lepton Ray cluster rl-crashed (created for flow run {runs['crashed']})",
        f"Lepton Ray cluster rl-gone (created for flow run {runs['gone']})",
    ]
    assert sorted(lepton.rayclusters) == ["rl-kept", "rl-live", "rl-unlabelled"]
