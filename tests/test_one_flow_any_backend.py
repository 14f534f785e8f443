"""One flow, any backend: the demo pipeline (flows/demo.py), unchanged, on local Ray (real),
KubeRay (loopback Kubernetes API + operator simulator in front of the real Ray) and Slurm
(real, through NeMo-Run's SSH tunnel), by swapping only the saved cluster block's name."""

from __future__ import annotations

import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr

from prefect_nemo import JobState

pytestmark = [pytest.mark.nemo_run, pytest.mark.slow]

BACKENDS = ["local-ray", "kuberay", "slurm"]


def _block(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    """The cluster block for `backend`; fixtures are looked up only for the backend in use."""
    ray_head = request.getfixturevalue("ray_head")
    if backend == "local-ray":
        return ray_head.block()
    if backend == "kuberay":
        from prefect_nemo.backends.kuberay import ensure_ray_cluster, wait_ray_cluster_ready
        from prefect_nemo.blocks import KubeRayCluster
        from tests.test_kuberay import cluster_spec

        request.getfixturevalue("kuberay")  # the operator simulator, backed by ray_head
        kube = request.getfixturevalue("kube_block")
        # a running RayCluster the jobs are submitted to (the demo ships its code as a Ray
        # working_dir, which a per-job inline cluster cannot take yet)
        ensure_ray_cluster(kube.api(), cluster_spec(), "demo")
        wait_ray_cluster_ready(kube.api(), "demo", timeout_s=60)
        return KubeRayCluster(kubernetes=kube, ray_token=ray_head.token, ray_cluster_name="demo")
    from prefect_nemo.blocks.slurm import SlurmCluster

    slurm = request.getfixturevalue("slurm")
    return SlurmCluster(
        host=slurm.host,
        port=slurm.port,
        user=slurm.user,
        identity_key=SecretStr(slurm.identity.read_text()),
        known_hosts=slurm.known_hosts.read_text(),
        job_dir=str(tmp_path / "slurm-jobs"),
        account=slurm.account,
        partition=slurm.partition,
        time="00:10:00",
        max_poll_interval_s=0.5,
        # the demo's jobs need numpy: the compute node (this machine) runs this env's python
        setup_lines=f"export PATH={Path(sys.executable).parent}:$PATH",
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_demo_pipeline_runs_unchanged(backend, request, prefect_api, tmp_path):
    from flows.demo import demo_pipeline

    block = _block(backend, request, tmp_path)
    name = f"any-{backend}-{uuid.uuid4().hex[:6]}"
    block.save(name)
    slug = type(block).get_block_type_slug()
    started = time.monotonic()
    outputs = demo_pipeline(run_dir=str(tmp_path / "run"), name=name, cluster=f"{slug}/{name}")
    took = time.monotonic() - started
    assert list(outputs) == [f"{name}-data-prep", f"{name}-train", f"{name}-eval"]
    jobs = [job for out in outputs.values() for job in out["jobs"]]
    assert len(jobs) == 2 + 2 + 5
    assert {job["state"] for job in jobs} == {JobState.SUCCEEDED.value}
    assert outputs[f"{name}-eval"]["accuracy"] > 0.8, "the trained model learned something"
    assert outputs[f"{name}-train"]["train_loss"] < 0.5
    print(f"demo pipeline (9 jobs, 3 experiments) on {backend}: {took:.1f}s")


def test_slurm_pipeline_on_lepton_by_swapping_the_block(prefect_api, tmp_path):
    """flows/slurm_pipeline on the loopback Lepton workspace (states simulated, NeMo-Run and
    leptonai unchanged): no native dependencies there, so the prep flow waits for its job and
    the SFT job is created only after the prep job completed."""
    from flows.slurm_pipeline import slurm_pipeline
    from prefect_nemo.blocks.lepton import LeptonWorkspace
    from prefect_nemo.testing.lepton import LeptonServer

    token = "lep-" + uuid.uuid4().hex[:12]
    shared = tmp_path / "shared"
    with LeptonServer(token=token, start_s=0.1, running_s=0.4) as lepton:
        block = LeptonWorkspace(
            workspace_id=lepton.workspace_id,
            workspace_url=lepton.api_url,
            token=token,
            node_group="nemo-nodes",
            nemo_run_dir=str(shared / "nemo-run"),
            mounts=[{"path": "/", "mount_path": str(shared), "from": "node-nfs:shared"}],
            max_poll_interval_s=0.2,
        )
        name = f"lep-{uuid.uuid4().hex[:6]}"
        block.save(name)
        slug = type(block).get_block_type_slug()
        outputs = slurm_pipeline(cluster=f"{slug}/{name}", run_dir=str(shared / "run"), name=name)
        jobs = {j.id: j for j in lepton.jobs.values() if not j.id.startswith("data-mover-")}
    prep = [j for j in jobs.values() if "prep" in j.id]
    sft = [j for j in jobs.values() if "sft" in j.id]
    assert len(prep) == 1 and len(sft) == 1, list(jobs)
    prep_done = max(start for start, phase in prep[0].phases if phase == "Completed")
    assert sft[0].created >= prep_done, "SFT was created only after prep completed (in Prefect)"
    assert outputs["sft"]["checkpoint_uri"].endswith("/checkpoint")


def test_slurm_pipeline_on_dgx_cloud_by_swapping_the_block(prefect_api, tmp_path):
    """flows/slurm_pipeline on the loopback run:ai API, which runs each workload's command
    here: prep then SFT really run, ordered in Prefect (no native dependencies)."""
    from flows.slurm_pipeline import slurm_pipeline
    from prefect_nemo.blocks.dgx_cloud import DGXCloudCluster
    from prefect_nemo.testing.runai import RunaiServer

    secret = "dgx-" + uuid.uuid4().hex[:12]
    pvc = tmp_path / "pvc"
    with RunaiServer(
        client_secret=secret, creating_s=0.05, initializing_s=0.05, running_s=0.3, execute=True
    ) as runai:
        block = DGXCloudCluster(
            base_url=runai.base_url,
            client_id=runai.client_id,
            client_secret=secret,
            project_name="nemo-project",
            pvc_nemo_run_dir=str(pvc / "nemo-run"),
            pvcs=[{"path": str(pvc), "claimName": "nemo-pvc", "existingPvc": True}],
            max_poll_interval_s=0.2,
        )
        name = f"dgx-{uuid.uuid4().hex[:6]}"
        block.save(name)
        slug = type(block).get_block_type_slug()
        outputs = slurm_pipeline(cluster=f"{slug}/{name}", run_dir=str(pvc / "run"), name=name)
    assert outputs["sft"]["examples"] > 100 and outputs["sft"]["accuracy"] == 1.0
