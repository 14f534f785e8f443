"""Block for running jobs as Kubeflow Trainer TrainJobs (torchrun on every node)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from prefect_nemo.backends.kubeflow import KubeflowTrainerBackend, PvcMount, TrainerConfig
from prefect_nemo.blocks.base import ClusterBlock
from prefect_nemo.blocks.kubernetes import (
    KubernetesCluster,
    KueuePriorityClass,
    KueueQueueName,
    Namespace,
)
from prefect_nemo.errors import InvalidJobSpec


class PvcMountConfig(BaseModel):
    """A PersistentVolumeClaim mounted on every node (created if missing, never deleted)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="Name of the PersistentVolumeClaim in the job's namespace.")
    mount_path: str = Field(description="Where the volume appears in every node, e.g. /data.")
    size: str = Field(default="10Gi", description="Size to request if the PVC is created.")
    storage_class: str | None = Field(
        default=None,
        description="Storage class if the PVC is created; empty for the cluster's default.",
    )
    access_modes: list[str] = Field(
        default_factory=lambda: ["ReadWriteMany"],
        description="Access modes if the PVC is created (multi-node jobs need ReadWriteMany).",
    )
    read_only: bool = Field(default=False, description="Mount the volume read-only.")

    def to_mount(self) -> PvcMount:
        """The backend's form of this mount."""
        return PvcMount(
            name=self.name,
            mount_path=self.mount_path,
            size=self.size,
            storage_class=self.storage_class,
            access_modes=tuple(self.access_modes),
            read_only=self.read_only,
        )


class KubeflowTrainerCluster(ClusterBlock):
    """Where TrainJobs run: a Kubernetes cluster with Kubeflow Trainer, and each node's shape."""

    _block_type_name = "Kubeflow Trainer Cluster"
    _block_type_slug = "kubeflow-trainer-cluster"
    _shape_fields = ("num_nodes", "gpus_per_node")
    _logo_url = "https://www.kubeflow.org/favicon.ico"  # type: ignore[assignment]
    _description = (
        "Runs prefect-nemo jobs as Kubeflow Trainer TrainJobs: the local code shipped in "
        "ConfigMaps, torchrun across num_nodes pods, on a ClusterTrainingRuntime built from "
        "these fields (named by their hash, shared by equal configs)."
    )
    _code_example = """
```python
from prefect import flow
from prefect_nemo import JobSpec, run_job
from prefect_nemo.blocks import KubeflowTrainerCluster

cluster = KubeflowTrainerCluster.load("BLOCK_NAME")

@flow
def sft():
    run_job(JobSpec(entrypoint="python train.py", working_dir="."), cluster=cluster)
```
"""

    kubernetes: KubernetesCluster = Field(
        description="The Kubernetes cluster (credentials, context, namespace) Trainer runs in.",
    )
    namespace: Namespace | None = Field(
        default=None,
        description="Namespace of the TrainJobs; empty for the Kubernetes block's namespace.",
    )
    image: str = Field(
        description="Container image every node runs (it needs python, and torchrun when "
        "torchrun is on), e.g. nvcr.io/nvidia/pytorch:25.01-py3.",
    )
    num_nodes: int = Field(default=1, ge=1, description="Pods (nodes) of each TrainJob.")
    gpus_per_node: int = Field(
        default=0,
        ge=0,
        description="nvidia.com/gpu per node; 0 runs CPU-only (no GPU is requested).",
    )
    procs_per_node: int | None = Field(
        default=None,
        ge=1,
        description="torchrun processes per node; empty for one per GPU (one on CPU-only).",
    )
    cpus_per_node: str | None = Field(
        default=None, description="CPU per node as a Kubernetes quantity, e.g. '8' or '500m'."
    )
    memory_per_node: str | None = Field(
        default=None, description="Memory per node as a Kubernetes quantity, e.g. '64Gi'."
    )
    pvc_mounts: list[PvcMountConfig] = Field(
        default_factory=list,
        description="PersistentVolumeClaims mounted on every node (created if missing).",
    )
    extra_packages: list[str] = Field(
        default_factory=list,
        description="pip requirements installed on every node before the job starts.",
    )
    pip_index_url: SecretStr | None = Field(
        default=None,
        description="pip's --index-url for extra_packages (and anything the job installs): a "
        "secret, as it may hold credentials; reaches the pods as PIP_INDEX_URL from the job's "
        "Secret.",
    )
    pip_extra_index_urls: list[SecretStr] = Field(
        default_factory=list,
        description="pip's --extra-index-url values (secrets), as PIP_EXTRA_INDEX_URL.",
    )
    pip_trusted_hosts: list[str] = Field(
        default_factory=list,
        description="pip's --trusted-host values (host or host:port), as PIP_TRUSTED_HOST.",
    )
    torchrun: bool = Field(
        default=True,
        description="Allow JobSpec.launcher='torchrun' (a `python ...` entrypoint then runs "
        "under torchrun with the nodes' rendezvous); off refuses it. A job without a launcher "
        "runs its entrypoint as is on every node.",
    )
    code_dir: str = Field(
        default="/workspace/code",
        description="Where the job's working_dir is unpacked on every node (the job runs there).",
    )
    queue_name: KueueQueueName = None
    priority_class: KueuePriorityClass = None
    runtime_prefix: str = Field(
        default="prefect-nemo",
        description="Name prefix of the ClusterTrainingRuntimes this block creates.",
    )
    namespaced_runtime: bool = Field(
        default=False,
        description="Create the runtime as a TrainingRuntime in the job's namespace instead of "
        "a ClusterTrainingRuntime (for accounts without cluster-scoped permissions).",
    )
    max_code_bytes: int | None = Field(
        default=None,
        gt=0,
        description="Largest compressed working_dir to ship in ConfigMaps; empty for the "
        "packaging library's default ceiling.",
    )

    code_chunk_bytes: int | None = Field(
        default=None,
        gt=0,
        description="Archive bytes per code ConfigMap (each holds at most 1 MiB); empty for the "
        "packaging library's default.",
    )

    @model_validator(mode="after")
    def _config_ok(self) -> KubeflowTrainerCluster:
        try:
            self._config()  # checks itself
        except InvalidJobSpec as exc:
            raise ValueError(str(exc)) from None
        return self

    def _config(self) -> TrainerConfig:
        return TrainerConfig(
            image=self.image,
            num_nodes=self.num_nodes,
            gpus_per_node=self.gpus_per_node,
            procs_per_node=self.procs_per_node,
            cpus_per_node=self.cpus_per_node,
            memory_per_node=self.memory_per_node,
            pvc_mounts=tuple(m.to_mount() for m in self.pvc_mounts),
            extra_packages=tuple(self.extra_packages),
            torchrun=self.torchrun,
            code_dir=self.code_dir,
            runtime_prefix=self.runtime_prefix,
            namespaced_runtime=self.namespaced_runtime,
            pip_index_url=self.pip_index_url.get_secret_value() if self.pip_index_url else None,
            pip_extra_index_urls=tuple(u.get_secret_value() for u in self.pip_extra_index_urls),
            pip_trusted_hosts=tuple(self.pip_trusted_hosts),
            queue_name=self.queue_name,
            priority_class=self.priority_class,
        )

    def target_namespace(self) -> str:
        """Where this block puts everything it creates: `namespace`, else its Kubernetes block's
        (the one answer for every caller: its backend, flows that look its objects up)."""
        return self.namespace or self.kubernetes.namespace

    def cleanup(self) -> list[str]:
        """Remove the runtimes of this block's runtime_prefix that no TrainJob uses any more
        (and no submit took in the last 10 minutes); returns them as 'Kind/name'."""
        return self.backend().cleanup()

    def backend(self) -> KubeflowTrainerBackend:
        """The Kubeflow Trainer backend for this cluster."""
        api = self.kubernetes.api()
        return KubeflowTrainerBackend(
            api,
            self._config(),
            namespace=self.target_namespace(),
            chunk_bytes=self.code_chunk_bytes,
            max_code_bytes=self.max_code_bytes,
        )
