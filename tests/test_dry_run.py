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
CLUSTER_SECRET = f"wandb-{uuid.uuid4().hex}"


def _closed_port() -> int:
    """A port nothing listens on: a dry run that sent a request would fail."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_ray_jobs_dry_run_renders_the_submission_and_sends_nothing(tmp_path) -> None:
    """Besides the job's own fields, the rendering shows what the block adds, as NeMo-Skills'
    Ray backend does: the cluster-wide env in runtime_env.env_vars (its secret values masked)
    and the labels of the job's image joined to its selector ("Image-derived selectors only
    fill gaps; explicit entrypoint_label_selector keys win")."""
    (tmp_path / "train.py").write_text("print('hi')\n")
    cluster = RayJobsCluster(
        dashboard_url=f"http://127.0.0.1:{_closed_port()}",
        auth_token=TOKEN,
        env={"HF_HOME": "/models/hf"},
        secret_env={"WANDB_API_KEY": CLUSTER_SECRET},
        image_label_selectors={"nvcr.io/nvidia/nemo-rl:*": {"pool": "b", "nemo/workload": "rl"}},
    )
    spec = JobSpec(
        name="sft",
        entrypoint="python train.py",
        working_dir=tmp_path,
        env={"PLAIN": "1", "HF_TOKEN": SecretStr(SECRET)},
        placement=PlacementSpec(gpus_per_node=1, exclude_head=True, node_labels={"pool": "a"}),
        runtime_env={"image_uri": "nvcr.io/nvidia/nemo-rl:v0.6.0"},
    )
    dry = run_job.fn(spec, cluster, dry_run=True)
    assert isinstance(dry, DryRun) and dry.backend == "ray-jobs"
    [doc] = dry.documents
    request = doc["request"]
    assert request["submission_id"] == dry.job_id and request["entrypoint"] == "python train.py"
    env_vars = request["runtime_env"]["env_vars"]
    assert env_vars["PLAIN"] == "1" and env_vars["HF_HOME"] == "/models/hf"
    assert env_vars["HF_TOKEN"] == MASK and env_vars["WANDB_API_KEY"] == MASK
    assert request["entrypoint_num_gpus"] == 1
    selector = request["entrypoint_label_selector"]
    assert selector["pool"] == "a", "the job's own key wins over its image's"
    assert selector["nemo/workload"] == "rl", "the image's labels fill the gaps"
    assert "image_uri" not in request["runtime_env"], "the image picked nodes, not a container"
    assert "working_dir" in request["runtime_env"]
    for secret in (SECRET, TOKEN, CLUSTER_SECRET):
        assert secret not in dry.yaml and secret not in repr(dry)
    again = submit_job.fn(spec, cluster, dry_run=True)
    assert again.job_id == dry.job_id, "the same job renders the same id (what a run would use)"
