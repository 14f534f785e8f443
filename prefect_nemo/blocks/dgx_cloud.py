"""Block for DGX Cloud (run:ai): the API, the application's credentials, project and PVCs.

Field names follow NeMo-Run's ``DGXCloudExecutor`` where they match. Importing this module needs
no nemo-run; `backend()` does.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from pydantic import Field, SecretStr, field_validator, model_validator

from prefect_nemo.blocks.base import ClusterBlock

if TYPE_CHECKING:
    from prefect_nemo.backends.nemo_run.dgx_cloud import DGXCloudBackend
    from prefect_nemo.backends.nemo_run.ray_clusters import DGXCloudRayBackend


class DGXCloudCluster(ClusterBlock):
    """A DGX Cloud (run:ai) cluster: API URL, application credentials, project and PVCs."""

    _block_type_name = "DGX Cloud Cluster"
    _block_type_slug = "dgx-cloud-cluster"
    _shape_fields = ("nodes", "gpus_per_node")
    _logo_url = "https://www.nvidia.com/favicon.ico"  # type: ignore[assignment]
    _description = (
        "A DGX Cloud (run:ai) cluster reached through its REST API with an application's "
        "client id and secret, with the project, image and PVCs prefect-nemo jobs run with, "
        "submitted through NeMo-Run's DGXCloudExecutor."
    )
    _code_example = """
```python
from prefect import flow
from prefect_nemo import JobSpec, run_job
from prefect_nemo.blocks.dgx_cloud import DGXCloudCluster

cluster = DGXCloudCluster.load("BLOCK_NAME")

@flow
def train():
    run_job(JobSpec(entrypoint="python train.py", working_dir="."), cluster=cluster)
```
"""

    base_url: str = Field(
        description="The run:ai REST API base, e.g. https://<tenant>.run.ai/api/v1.",
    )
    kube_apiserver_url: str = Field(
        default="",
        description="The cluster's Kubernetes API URL (NeMo-Run keeps it; jobs do not need it).",
    )
    client_id: str = Field(description="The run:ai application's client id.")
    client_secret: SecretStr = Field(description="The run:ai application's client secret.")
    project_name: str = Field(
        description="The run:ai project jobs are submitted to (its quota is what they queue "
        "for); JobSpec.queue names another one for a job."
    )
    container_image: str = Field(
        default="nvcr.io/nvidia/nemo:25.07", description="Container image every pod runs."
    )
    pvc_nemo_run_dir: str = Field(
        description="Directory on a PVC where NeMo-Run keeps job directories (must lie under "
        "one of pvcs' path).",
    )
    pvcs: list[dict[str, Any]] = Field(
        description="PVCs mounted in every pod, run:ai style: each {'claimName': ..., "
        "'path': <mount path>, 'existingPvc': true, ...}.",
    )
    nodes: int = Field(default=1, ge=1, description="Nodes per job by default.")
    gpus_per_node: int = Field(
        default=1, ge=0, description="GPUs per node by default; 0 for CPU-only work."
    )
    nprocs_per_node: int = Field(
        default=1, ge=1, description="Processes per node when gpus_per_node is 0."
    )
    distributed_framework: str = Field(
        default="PyTorch", description="run:ai distributed framework of multi-node jobs."
    )
    custom_spec: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra run:ai workload spec fields (e.g. nodePools), merged last.",
    )
    priority_class: str | None = Field(
        default=None,
        description="run:ai priority class of the workloads (spec.priorityClass: very-low, low, "
        "medium-low, medium, medium-high, high, very-high, or build, train, inference, "
        "interactive-preemptible); JobSpec.priority overrides it; None = run:ai's default.",
    )
    env_vars: dict[str, str] = Field(
        default_factory=dict, description="Environment variables every job gets."
    )
    secret_env: dict[str, str] = Field(
        default_factory=dict,
        description="Environment variables read from Kubernetes secrets in the project's "
        "namespace: {'NAME': '<secret name>/<key>'}; values never pass through prefect-nemo.",
    )
    request_timeout_s: float = Field(
        default=30.0, gt=0, description="Timeout of each request to the run:ai API, seconds."
    )

    @field_validator("base_url")
    @classmethod
    def _url_ok(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError(
                f"'{value}' is not an http(s) URL: use the API base, e.g. "
                "https://<tenant>.run.ai/api/v1"
            )
        return value.rstrip("/")

    @field_validator("client_secret")
    @classmethod
    def _secret_ok(cls, value: SecretStr) -> SecretStr:
        if len(value.get_secret_value().strip()) < 4:
            raise ValueError("is empty or too short: paste the application's client secret")
        return value

    @field_validator("secret_env")
    @classmethod
    def _refs_ok(cls, value: dict[str, str]) -> dict[str, str]:
        for env, ref in value.items():
            name, _, key = ref.partition("/")
            if not name or not key:
                raise ValueError(
                    f"secret_env['{env}'] = '{ref}': write '<secret name>/<key>', e.g. "
                    "'wandb/api-key'"
                )
        return value

    @model_validator(mode="after")
    def _pvc_holds_the_job_dir(self) -> DGXCloudCluster:
        for i, pvc in enumerate(self.pvcs):
            if not pvc.get("path"):
                raise ValueError(f"pvcs[{i}] lacks 'path' (where the PVC is mounted in pods)")
        inside = [
            p
            for p in self.pvcs
            if os.path.commonpath(
                [os.path.abspath(p["path"]), os.path.abspath(self.pvc_nemo_run_dir)]
            )
            == os.path.abspath(p["path"])
        ]
        if not inside:
            raise ValueError(
                f"pvc_nemo_run_dir '{self.pvc_nemo_run_dir}' is on none of the pvcs (paths "
                f"{[p['path'] for p in self.pvcs]}): put it under one of them, or add its PVC"
            )
        return self

    def backend(self) -> DGXCloudBackend:
        """The NeMo-Run DGX Cloud backend for this cluster (needs prefect-nemo[nemo-run])."""
        from prefect_nemo.backends.nemo_run.base import config_from
        from prefect_nemo.backends.nemo_run.dgx_cloud import DGXCloudBackend
        from prefect_nemo.backends.nemo_run.runai import DGXCloudConfig

        return DGXCloudBackend(config_from(DGXCloudConfig, dict(self)))


class DGXCloudRayCluster(ClusterBlock):
    """Ray jobs on DGX Cloud: each job a distributed workload that bootstraps Ray (NeMo-Run)."""

    _block_type_name = "DGX Cloud Ray Cluster"
    _block_type_slug = "dgx-cloud-ray-cluster"
    _logo_url = "https://www.nvidia.com/favicon.ico"  # type: ignore[assignment]
    _description = (
        "Runs prefect-nemo jobs as Ray jobs on DGX Cloud (run:ai), for multi-node RL: each job "
        "is a distributed workload whose pods start Ray through NeMo-Run's bootstrap script "
        "and run the entrypoint on the head."
    )
    _code_example = """
```python
from prefect import flow
from prefect_nemo import JobSpec, run_job
from prefect_nemo.blocks.dgx_cloud import DGXCloudRayCluster

cluster = DGXCloudRayCluster.load("BLOCK_NAME")

@flow
def rl():
    run_job(JobSpec(entrypoint="python grpo.py", working_dir="."), cluster=cluster)
```
"""

    cluster: DGXCloudCluster = Field(
        description="The DGX Cloud cluster (credentials, project, PVCs, nodes per job)."
    )

    def backend(self) -> DGXCloudRayBackend:
        """The Ray-on-DGX-Cloud backend (needs prefect-nemo[nemo-run])."""
        from prefect_nemo.backends.nemo_run.base import config_from
        from prefect_nemo.backends.nemo_run.ray_clusters import DGXCloudRayBackend
        from prefect_nemo.backends.nemo_run.runai import DGXCloudConfig

        return DGXCloudRayBackend(config_from(DGXCloudConfig, dict(self.cluster)))
