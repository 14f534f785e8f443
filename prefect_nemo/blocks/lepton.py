"""Block for DGX Cloud Lepton: a workspace (id, URL, token) and where its jobs run.

Field names follow NeMo-Run's ``LeptonExecutor`` where they match. Importing this module needs
no nemo-run; `backend()` does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from uuid import UUID

from pydantic import Field, SecretStr, field_validator

from prefect_nemo.blocks.base import ClusterBlock

if TYPE_CHECKING:
    from prefect_nemo.backends.nemo_run.lepton import LeptonBackend
    from prefect_nemo.backends.nemo_run.ray_clusters import LeptonRayBackend


class LeptonWorkspace(ClusterBlock):
    """A DGX Cloud Lepton workspace and the node group, shape, image and mounts jobs use."""

    _block_type_name = "Lepton Workspace"
    _block_type_slug = "lepton-workspace"
    _shape_fields = ("nodes", "gpus_per_node")
    _logo_url = "https://www.nvidia.com/favicon.ico"  # type: ignore[assignment]
    _description = (
        "A DGX Cloud Lepton workspace (id, API URL, token) with the dedicated node group, "
        "resource shape, container image and shared mounts prefect-nemo jobs run with, "
        "submitted through NeMo-Run's LeptonExecutor."
    )
    _code_example = """
```python
from prefect import flow
from prefect_nemo import JobSpec, run_job
from prefect_nemo.blocks.lepton import LeptonWorkspace

workspace = LeptonWorkspace.load("BLOCK_NAME")

@flow
def train():
    run_job(JobSpec(entrypoint="python train.py", working_dir="."), cluster=workspace)
```
"""

    workspace_id: str = Field(description="The Lepton workspace id (LEPTON_WORKSPACE_ID).")
    workspace_url: str | None = Field(
        default=None,
        description="The workspace API URL (LEPTON_WORKSPACE_URL), e.g. "
        "https://gateway.dgxc-lepton.nvidia.com/api/v2/workspaces/<id>; empty to let leptonai "
        "derive it from workspace_id.",
    )
    token: SecretStr = Field(
        description="The workspace token (LEPTON_WORKSPACE_TOKEN), from the dashboard's "
        "credentials page.",
    )
    node_group: str = Field(
        description="Name of the dedicated node group jobs run on (and queue for when it is "
        "full); JobSpec.queue names another one for a job."
    )
    priority_class: str | None = Field(
        default=None,
        description="Lepton priority class of the jobs in their node group's queue (low-1000, "
        "low-2000, low-3000, mid-4000, mid-5000, mid-6000, high-7000, high-8000, high-9000; "
        "or low, mid, high); JobSpec.priority overrides it; None = Lepton's default.",
    )
    resource_shape: str = Field(
        default="gpu.1xh100-80gb",
        description="Lepton resource shape of each replica, e.g. gpu.8xh100-80gb or cpu.small.",
    )
    cpu_resource_shape: str = Field(
        default="cpu.small",
        description="Resource shape of replicas of CPU-only jobs (placement gpus_per_node=0).",
    )
    container_image: str = Field(
        default="nvcr.io/nvidia/nemo:25.07",
        description="Container image every replica runs.",
    )
    nemo_run_dir: str = Field(
        default="/nemo-workspace/nemo-run",
        description="Directory on the shared mount where NeMo-Run keeps job directories "
        "(must lie under one of mounts' mount_path).",
    )
    mounts: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Shared storage mounts, NeMo-Run style: each {'path': <storage path>, "
        "'mount_path': <path in the pod>, 'from': <storage, e.g. node-nfs:shared>}.",
    )
    nodes: int = Field(default=1, ge=1, description="Replicas (nodes) per job by default.")
    gpus_per_node: int = Field(
        default=1, ge=0, description="GPUs per node by default; 0 for CPU-only work."
    )
    shared_memory_size: int = Field(
        default=65536, ge=0, description="Shared memory of each replica, MiB."
    )
    image_pull_secrets: list[str] = Field(
        default_factory=list, description="Workspace secrets used to pull the image."
    )
    node_reservation: str = Field(
        default="", description="Node reservation id to run in; empty for none."
    )
    env_vars: dict[str, str] = Field(
        default_factory=dict, description="Environment variables every job gets."
    )
    secret_vars: dict[str, str] = Field(
        default_factory=dict,
        description="Environment variables read from workspace secrets: {'NAME': '<secret "
        "name>'}; values never pass through prefect-nemo.",
    )
    request_timeout_s: float = Field(
        default=30.0, gt=0, description="Timeout of each request to the workspace API, seconds."
    )

    @field_validator("workspace_url")
    @classmethod
    def _url_ok(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError(
                f"'{value}' is not an http(s) URL: use the workspace API URL, e.g. "
                "https://gateway.dgxc-lepton.nvidia.com/api/v2/workspaces/<id>"
            )
        return value.rstrip("/") if value else value

    @field_validator("token")
    @classmethod
    def _token_ok(cls, value: SecretStr) -> SecretStr:
        if len(value.get_secret_value().strip()) < 4:
            raise ValueError("is empty or too short: paste the workspace token")
        return value

    @field_validator("mounts")
    @classmethod
    def _mounts_ok(cls, value: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for i, mount in enumerate(value):
            missing = [k for k in ("path", "mount_path") if not mount.get(k)]
            if missing:
                raise ValueError(
                    f"mounts[{i}] lacks {' and '.join(missing)}: give each mount 'path' (on "
                    "the storage), 'mount_path' (in the pod) and 'from'"
                )
        return value

    def backend(self) -> LeptonBackend:
        """The NeMo-Run Lepton backend for this workspace (needs prefect-nemo[nemo-run])."""
        from prefect_nemo.backends.nemo_run.base import config_from
        from prefect_nemo.backends.nemo_run.lepton import LeptonBackend, LeptonConfig

        return LeptonBackend(config_from(LeptonConfig, dict(self)))


class LeptonRayCluster(ClusterBlock):
    """A Ray cluster on DGX Cloud Lepton (created by NeMo-Run unless it exists) for Ray jobs."""

    _block_type_name = "Lepton Ray Cluster"
    _block_type_slug = "lepton-ray-cluster"
    _logo_url = "https://www.nvidia.com/favicon.ico"  # type: ignore[assignment]
    _description = (
        "Runs prefect-nemo jobs as Ray jobs on a Lepton RayCluster (multi-node RL): the "
        "cluster is created with NeMo-Run's LeptonRayCluster request unless one by that name "
        "exists (and deleted when the run that created it ends, unless kept), and jobs reach "
        "its dashboard through the workspace's proxy."
    )
    _code_example = """
```python
from prefect import flow
from prefect_nemo import JobSpec, run_job
from prefect_nemo.blocks.lepton import LeptonRayCluster

cluster = LeptonRayCluster.load("BLOCK_NAME")

@flow
def rl():
    run_job(JobSpec(entrypoint="python grpo.py", working_dir="."), cluster=cluster)
```
"""

    workspace: LeptonWorkspace = Field(
        description="The Lepton workspace (credentials, node group, image, worker shape)."
    )
    ray_cluster_name: str = Field(
        description="Name of the RayCluster: reused if it exists, else created (at most 35 "
        "lowercase letters, digits and '-'). A cluster created for a flow run is deleted "
        "when that run ends, however it ends, unless keep_cluster is set."
    )
    keep_cluster: bool = Field(
        default=False,
        description="Keep a Ray cluster this block creates after the run that created it "
        "ends (it keeps its nodes until deleted). Off: the run deletes it at its end, and "
        "`prefect-nemo cleanup` deletes one a crashed run left behind.",
    )
    worker_nodes: int | None = Field(
        default=None, ge=0, description="Ray worker replicas; empty for workspace.nodes."
    )
    head_resource_shape: str = Field(
        default="", description="Resource shape of the Ray head; empty for the worker shape."
    )
    ray_version: str | None = Field(
        default=None, description="Lepton Ray image version; empty for leptonai's default."
    )
    ready_timeout_s: float = Field(
        default=1800.0, gt=0, description="Seconds to wait for a new cluster to become ready."
    )

    def backend(self) -> LeptonRayBackend:
        """The Ray-on-Lepton backend (needs prefect-nemo[nemo-run])."""
        from prefect_nemo.backends.nemo_run.base import config_from
        from prefect_nemo.backends.nemo_run.lepton import LeptonConfig
        from prefect_nemo.backends.nemo_run.ray_clusters import LeptonRayBackend

        return LeptonRayBackend(
            config_from(LeptonConfig, dict(self.workspace)),
            cluster_name=self.ray_cluster_name,
            head_resource_shape=self.head_resource_shape,
            ray_version=self.ray_version,
            worker_nodes=self.worker_nodes,
            ready_timeout_s=self.ready_timeout_s,
            keep_cluster=self.keep_cluster,
        )

    def cleanup(self) -> list[str]:
        """Delete the workspace's Ray clusters created for flow runs that are over (a crashed
        run leaves its cluster behind, labelled with the run) and running no Ray job; returns
        what was removed. Clusters kept with keep_cluster carry no run label: never removed."""
        backend = self.backend()
        try:
            return backend.cleanup(_flow_run_is_over)
        finally:
            backend.close()


def _flow_run_is_over(flow_run_id: str) -> bool:
    """True when the flow run has ended (a final state) or no longer exists."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    try:
        run_id = UUID(flow_run_id)
    except ValueError:
        return False  # not a run id: not ours to judge
    with get_client(sync_client=True) as client:
        try:
            run = client.read_flow_run(run_id)
        except ObjectNotFound:
            return True
    return run.state is not None and run.state.is_final()
