"""Kubeflow Trainer runtimes built from a block's config: the node shape (image, nodes, GPUs,
CPU/memory, PVC mounts, one node per host), checked before any API call, as a
ClusterTrainingRuntime (or a namespaced TrainingRuntime) named by a hash of its spec, so equal
configs share one runtime and a changed config gets a new one. No Prefect import.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from pydantic import SecretStr

from prefect_nemo.backends._kueue import check_block_labels
from prefect_nemo.errors import InvalidJobSpec
from prefect_nemo.kube import CLUSTER_TRAINING_RUNTIME, TRAINING_RUNTIME, Kind, managed_labels
from prefect_nemo.names import is_dns1035_label, is_dns1123_subdomain, resource_name, stable_hash
from prefect_nemo.placement.spec import PlacementSpec

NODE = "node"  # the stock torch runtime's replicatedJob and container name
GPU_RESOURCE = "nvidia.com/gpu"
HOSTNAME_TOPOLOGY = "kubernetes.io/hostname"
JOBSET_NAME = "jobset.sigs.k8s.io/jobset-name"
REPLICATED_JOB_NAME = "jobset.sigs.k8s.io/replicatedjob-name"
ANCESTOR = "trainer.kubeflow.org/trainjob-ancestor-step"
RUNTIME_PREFIX_LABEL = "prefect-nemo.io/runtime-prefix"  # which block prefix made a runtime

_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi|E|Ei)?$")
_PACKAGE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-\[\],<>=!~+* ]*$")
_URL = re.compile(r"^https?://[^\s/]+(/\S*)?$")
_HOST = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?(:[0-9]{1,5})?$")


# -------------------------------------------------------------------------------------------
# Configuration and validation (pure: no API calls)


@dataclass(frozen=True)
class PvcMount:
    """A PersistentVolumeClaim mounted on every node; created if missing, never deleted."""

    name: str
    mount_path: str
    size: str = "10Gi"
    storage_class: str | None = None
    access_modes: tuple[str, ...] = ("ReadWriteMany",)
    read_only: bool = False


@dataclass(frozen=True)
class TrainerConfig:
    """How every TrainJob of a block runs: the runtime's shape and the trainer command's parts."""

    image: str
    num_nodes: int = 1
    gpus_per_node: int = 0
    procs_per_node: int | None = None  # torchrun processes per node; default GPUs, or 1 on CPU
    cpus_per_node: str | None = None
    memory_per_node: str | None = None
    pvc_mounts: tuple[PvcMount, ...] = ()
    extra_packages: tuple[str, ...] = ()
    torchrun: bool = True
    code_dir: str = "/workspace/code"
    runtime_prefix: str = "prefect-nemo"
    namespaced_runtime: bool = False  # a TrainingRuntime in the job's namespace (no cluster RBAC)
    pip_index_url: str | None = None  # may hold credentials: travels in the job's Secret
    pip_extra_index_urls: tuple[str, ...] = ()
    pip_trusted_hosts: tuple[str, ...] = ()
    queue_name: str | None = None  # Kueue LocalQueue (the queue-name label; not in the runtime)
    priority_class: str | None = None  # Kueue WorkloadPriorityClass (the priority-class label)

    def __post_init__(self) -> None:
        check_config(self)

    @property
    def runtime_kind(self) -> Kind:
        """ClusterTrainingRuntime, or TrainingRuntime when namespaced_runtime is set."""
        return TRAINING_RUNTIME if self.namespaced_runtime else CLUSTER_TRAINING_RUNTIME

    @property
    def nproc_per_node(self) -> int:
        """torchrun processes per node: as set, else one per GPU, else one (CPU-only)."""
        return self.procs_per_node or self.gpus_per_node or 1

    @property
    def code_on_shared_volume(self) -> bool:
        """True when code_dir lies on a PVC: all nodes then share one copy (rank 0 unpacks)."""
        return any(_under(self.code_dir, m.mount_path) for m in self.pvc_mounts)


def _under(path: str, root: str) -> bool:
    root = root.rstrip("/") or "/"
    return path == root or path.startswith(root + "/") or root == "/"


def check_config(config: TrainerConfig) -> None:
    """Raise InvalidJobSpec naming the field and the fix for a config Trainer would reject."""
    where = "KubeflowTrainerCluster"
    check_block_labels(config.queue_name, config.priority_class, where)
    if not isinstance(config.image, str) or not config.image.strip() or " " in config.image:
        raise InvalidJobSpec(
            f"{where}.image: set the container image every node runs, e.g. "
            "'nvcr.io/nvidia/pytorch:25.01-py3' (no spaces)"
        )
    if not isinstance(config.num_nodes, int) or config.num_nodes < 1:
        raise InvalidJobSpec(f"{where}.num_nodes: must be an integer >= 1 (pods of the job)")
    if config.num_nodes > 10_000:
        raise InvalidJobSpec(f"{where}.num_nodes: at most 10000 nodes per TrainJob")
    if not isinstance(config.gpus_per_node, int) or config.gpus_per_node < 0:
        raise InvalidJobSpec(
            f"{where}.gpus_per_node: must be an integer >= 0 (0 runs CPU-only, no GPU requested)"
        )
    if config.procs_per_node is not None and (
        not isinstance(config.procs_per_node, int) or config.procs_per_node < 1
    ):
        raise InvalidJobSpec(
            f"{where}.procs_per_node: must be an integer >= 1, or empty for one per GPU"
        )
    for name in ("cpus_per_node", "memory_per_node"):
        value = getattr(config, name)
        if value is not None and not (isinstance(value, str) and _QUANTITY.match(value)):
            raise InvalidJobSpec(
                f"{where}.{name}: {value!r} is not a Kubernetes quantity: use e.g. '4', '500m', "
                "'16Gi'"
            )
    if not config.code_dir.startswith("/") or config.code_dir.rstrip("/") == "":
        raise InvalidJobSpec(
            f"{where}.code_dir: {config.code_dir!r} must be an absolute path other than '/', "
            "e.g. '/workspace/code'"
        )
    seen_names: set[str] = set()
    for i, mount in enumerate(config.pvc_mounts):
        at = f"{where}.pvc_mounts[{i}]"
        if not is_dns1123_subdomain(mount.name, 63):
            raise InvalidJobSpec(
                f"{at}.name: {mount.name!r} is not a PVC name: lowercase letters, digits, '-', "
                "at most 63 characters"
            )
        if mount.name in seen_names:
            raise InvalidJobSpec(f"{at}.name: {mount.name!r} is mounted twice: mount it once")
        seen_names.add(mount.name)
        if not mount.mount_path.startswith("/") or mount.mount_path.rstrip("/") == "":
            raise InvalidJobSpec(f"{at}.mount_path: must be an absolute path other than '/'")
        if not _QUANTITY.match(mount.size):
            raise InvalidJobSpec(f"{at}.size: {mount.size!r} is not a quantity, e.g. '100Gi'")
        modes = {"ReadWriteOnce", "ReadOnlyMany", "ReadWriteMany", "ReadWriteOncePod"}
        if not mount.access_modes or not set(mount.access_modes) <= modes:
            raise InvalidJobSpec(f"{at}.access_modes: use some of {', '.join(sorted(modes))}")
        single_host = {"ReadWriteOnce", "ReadWriteOncePod"}
        if config.num_nodes > 1 and set(mount.access_modes) & single_host:
            raise InvalidJobSpec(
                f"{at}.access_modes: {config.num_nodes} nodes on different hosts cannot share a "
                "ReadWriteOnce volume: use ReadWriteMany (e.g. an NFS storage class)"
            )
    for pkg in config.extra_packages:
        if not isinstance(pkg, str) or not _PACKAGE.match(pkg):
            raise InvalidJobSpec(
                f"{where}.extra_packages: {pkg!r} is not a pip requirement: use e.g. "
                "'numpy==2.1.0' (one requirement per entry)"
            )
    for field, urls in (
        ("pip_index_url", [config.pip_index_url] if config.pip_index_url else []),
        ("pip_extra_index_urls", config.pip_extra_index_urls),
    ):
        for url in urls:
            if not _URL.match(url):  # never echo it: it may carry a token
                raise InvalidJobSpec(
                    f"{where}.{field}: not an http(s) URL without spaces: give e.g. "
                    "'https://pypi.example.com/simple'"
                )
    for host in config.pip_trusted_hosts:
        if not _HOST.match(host):
            raise InvalidJobSpec(
                f"{where}.pip_trusted_hosts: {host!r} is not a host name: give e.g. "
                "'pypi.example.com' or 'pypi.example.com:8080'"
            )
    if not is_dns1035_label(config.runtime_prefix, 40):
        raise InvalidJobSpec(
            f"{where}.runtime_prefix: {config.runtime_prefix!r} must be a DNS label of at most "
            "40 characters (the runtime name adds a hash)"
        )


def check_placement(placement: PlacementSpec, config: TrainerConfig) -> None:
    """The block is the one source of a TrainJob's shape (its runtime, named by a hash of it);
    a placement must agree with it on nodes and GPUs (and CPUs, when the block sets them), and
    adds where: node_labels become the pods' nodeSelector / node affinity. exclude_head has no
    meaning without a Ray head and is ignored."""
    fix = "make them equal (the block sets the runtime's shape; placement says where)"
    if placement.nodes != config.num_nodes:
        raise InvalidJobSpec(
            f"JobSpec.placement.nodes: {placement.nodes}, but the KubeflowTrainerCluster's "
            f"num_nodes is {config.num_nodes}: {fix}"
        )
    if placement.gpus_per_node != config.gpus_per_node:
        raise InvalidJobSpec(
            f"JobSpec.placement.gpus_per_node: {placement.gpus_per_node}, but the "
            f"KubeflowTrainerCluster's gpus_per_node is {config.gpus_per_node}: {fix}"
        )
    block_cpus = _cpu_cores(config.cpus_per_node)
    if block_cpus is not None and placement.cpus_per_node != block_cpus:
        raise InvalidJobSpec(
            f"JobSpec.placement.cpus_per_node: {placement.cpus_per_node:g}, but the "
            f"KubeflowTrainerCluster's cpus_per_node is {config.cpus_per_node!r}: {fix}"
        )


def _cpu_cores(quantity: str | None) -> float | None:
    """'2' -> 2.0, '500m' -> 0.5; None (or a form we do not parse) -> None."""
    if not quantity:
        return None
    try:
        return float(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)
    except ValueError:
        return None


# -------------------------------------------------------------------------------------------
# Manifests (pure)


def runtime_body(config: TrainerConfig) -> dict[str, Any]:
    """The ClusterTrainingRuntime's spec for a config (what its name hashes)."""
    container: dict[str, Any] = {"name": NODE, "image": config.image}
    resources = node_resources(config)
    if resources:
        container["resources"] = resources
    mounts = [
        {"name": _pvc_volume(m), "mountPath": m.mount_path, **({"readOnly": True}
                                                               if m.read_only else {})}
        for m in config.pvc_mounts
    ]  # fmt: skip
    if mounts:
        container["volumeMounts"] = mounts
    pod: dict[str, Any] = {"containers": [container]}
    if config.pvc_mounts:
        pod["volumes"] = [
            {"name": _pvc_volume(m), "persistentVolumeClaim": {"claimName": m.name,
                                                               "readOnly": m.read_only}}
            for m in config.pvc_mounts
        ]  # fmt: skip
    if config.num_nodes > 1:
        # one node per host: the node pods of *this* job repel each other (matchLabelKeys adds
        # the pod's own jobset-name to the selector; Kubernetes >= 1.29). The selector may not
        # name that key itself: the API server refuses such pods ("exists in both matchLabelKeys
        # and labelSelector"), so it selects the replicated job instead
        pod["affinity"] = {
            "podAntiAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "labelSelector": {
                            "matchLabels": {REPLICATED_JOB_NAME: NODE},
                        },
                        "matchLabelKeys": [JOBSET_NAME],
                        "topologyKey": HOSTNAME_TOPOLOGY,
                    }
                ]
            }
        }
    return {
        "mlPolicy": {"numNodes": config.num_nodes, "torch": {}},
        "template": {
            "spec": {
                "replicatedJobs": [
                    {
                        "name": NODE,
                        "template": {
                            "metadata": {"labels": {ANCESTOR: "trainer"}},
                            "spec": {
                                # a failed node fails the job; prefect-nemo's retries make a
                                # new TrainJob (-r1), so Kubernetes does not retry pods itself
                                "backoffLimit": 0,
                                "template": {
                                    "metadata": {"labels": managed_labels()},
                                    "spec": pod,
                                },
                            },
                        },
                    }
                ]
            }
        },
    }


def node_resources(config: TrainerConfig) -> dict[str, Any]:
    """Per-node requests/limits: GPUs only when gpus_per_node > 0 (0 = CPU-only)."""
    limits: dict[str, Any] = {}
    requests: dict[str, Any] = {}
    if config.gpus_per_node > 0:
        limits[GPU_RESOURCE] = config.gpus_per_node
    if config.cpus_per_node:
        requests["cpu"] = limits["cpu"] = config.cpus_per_node
    if config.memory_per_node:
        requests["memory"] = limits["memory"] = config.memory_per_node
    out: dict[str, Any] = {}
    if limits:
        out["limits"] = limits
    if requests:
        out["requests"] = requests
    return out


def _pvc_volume(mount: PvcMount) -> str:
    return resource_name(f"pvc-{mount.name}")


def runtime_name(config: TrainerConfig) -> str:
    """The runtime's name: prefix + a hash of its spec (equal configs share one runtime)."""
    digest = stable_hash(json.dumps(runtime_body(config), sort_keys=True), length=12)
    return resource_name(f"{config.runtime_prefix}-torch-{digest}")


def runtime_manifest(config: TrainerConfig, namespace: str = "default") -> dict[str, Any]:
    """The config's ClusterTrainingRuntime (shared by every namespace's TrainJobs of that
    config), or its TrainingRuntime in `namespace` when config.namespaced_runtime is set."""
    kind = config.runtime_kind
    metadata: dict[str, Any] = {
        "name": runtime_name(config),
        "labels": {
            **managed_labels(),
            "trainer.kubeflow.org/framework": "torch",
            RUNTIME_PREFIX_LABEL: config.runtime_prefix,
        },
    }
    if kind.namespaced:
        metadata["namespace"] = namespace
    return {
        "apiVersion": kind.api_version,
        "kind": kind.kind,
        "metadata": metadata,
        "spec": runtime_body(config),
    }


def pip_env(config: TrainerConfig) -> dict[str, str | SecretStr]:
    """pip's index options as the environment variables pip reads ("PIP_<UPPER_LONG_NAME>",
    several values separated by whitespace); the URLs as secrets (they may hold a token)."""
    env: dict[str, str | SecretStr] = {}
    if config.pip_index_url:
        env["PIP_INDEX_URL"] = SecretStr(config.pip_index_url)
    if config.pip_extra_index_urls:
        env["PIP_EXTRA_INDEX_URL"] = SecretStr(" ".join(config.pip_extra_index_urls))
    if config.pip_trusted_hosts:
        env["PIP_TRUSTED_HOST"] = " ".join(config.pip_trusted_hosts)
    return env


def pvc_manifest(mount: PvcMount, namespace: str) -> dict[str, Any]:
    """A PVC for a mount that does not exist yet (we create it, we never delete it)."""
    spec: dict[str, Any] = {
        "accessModes": list(mount.access_modes),
        "resources": {"requests": {"storage": mount.size}},
    }
    if mount.storage_class:
        spec["storageClassName"] = mount.storage_class
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": mount.name, "namespace": namespace, "labels": managed_labels()},
        "spec": spec,
    }
