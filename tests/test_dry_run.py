"""Dry runs (issue 14 item 4): "Give run_job/submit_job ... a dry_run option on every backend that
returns what would be submitted (Ray request body, RayJob/RayCluster/DGD/TrainJob/ConfigMap/Secret
manifests, sbatch script, Lepton/run:ai payloads) with secrets redacted, and submits nothing"."""

from __future__ import annotations

import socket
import uuid

from pydantic import SecretStr

from prefect_nemo import DryRun, JobSpec, PlacementSpec
from prefect_nemo.blocks import RayJobsCluster
from prefect_nemo.redaction import MASK
from prefect_nemo.tasks.jobs import run_job, submit_job

SECRET = f"s3cret-{uuid.uuid4().hex}"
TOKEN = f"tok-{uuid.uuid4().hex}"


def _closed_port() -> int:
    """A port nothing listens on: a dry run that sent a request would fail."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_ray_jobs_dry_run_renders_the_submission_and_sends_nothing(tmp_path) -> None:
    (tmp_path / "train.py").write_text("print('hi')\n")
    cluster = RayJobsCluster(dashboard_url=f"http://127.0.0.1:{_closed_port()}", auth_token=TOKEN)
    spec = JobSpec(
        name="sft",
        entrypoint="python train.py",
        working_dir=tmp_path,
        env={"PLAIN": "1", "HF_TOKEN": SecretStr(SECRET)},
        placement=PlacementSpec(gpus_per_node=1, exclude_head=True, node_labels={"pool": "a"}),
    )
    dry = run_job.fn(spec, cluster, dry_run=True)
    assert isinstance(dry, DryRun) and dry.backend == "ray-jobs"
    [doc] = dry.documents
    request = doc["request"]
    assert request["submission_id"] == dry.job_id and request["entrypoint"] == "python train.py"
    assert request["runtime_env"]["env_vars"]["PLAIN"] == "1"
    assert request["runtime_env"]["env_vars"]["HF_TOKEN"] == MASK
    assert request["entrypoint_num_gpus"] == 1
    assert request["entrypoint_label_selector"]["pool"] == "a"
    assert "working_dir" in request["runtime_env"]
    assert SECRET not in dry.yaml and TOKEN not in dry.yaml
    again = submit_job.fn(spec, cluster, dry_run=True)
    assert again.job_id == dry.job_id, "the same job renders the same id (what a run would use)"
