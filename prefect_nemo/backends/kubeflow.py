"""The Kubeflow Trainer backend: one TrainJob per job, through the Kubernetes API.

No Prefect import here.

What the NeMo-Run KubeflowExecutor does, made crash-safe:

- A ClusterTrainingRuntime (or, with `namespaced_runtime`, a TrainingRuntime in the job's
  namespace, for accounts without cluster-scoped RBAC) built from the block's config (image,
  nodes, GPUs, CPU/memory, PVC mounts, anti-affinity) and named by a hash of that config: equal
  configs share one runtime, a changed config gets a new name; a runtime is never changed in
  place (`apply_or_attach`). Unlike the executor, the runtime does not carry the code: the
  code travels per job, so one runtime serves every job of a config.
- A TrainJob named after the job id, created once: a taken name is `JobAlreadyExists`, so the
  lifecycle attaches to the running job (never delete-and-recreate).
- The local code (``JobSpec.working_dir``) goes through the packaging plan's ConfigMaps, mounted
  into the ``node`` container with a ``runtimePatches`` entry (the v2.3 TrainJob field); the
  trainer command reassembles it, ``cd``s into it and runs the entrypoint under torchrun with the
  rendezvous the Torch plugin hands every node in ``PET_*`` env vars.
- ``JobSpec.placement``: the block stays the one source of the shape (nodes, GPUs, CPUs per
  node: the runtime), so a placement must agree with it (`check_placement`); its node labels
  (and, for several nodes, its one-pod-per-host anti-affinity) reach the node pods through a
  second ``runtimePatches`` entry, per job, without a new runtime.
- Secret env values (SecretStr in JobSpec.env) go into a Secret we own, read through
  ``valueFrom.secretKeyRef``; nothing we write (TrainJob, ConfigMap, log line) holds them.
- Secret and ConfigMaps exist before the TrainJob (its pods need them at start) and are owned
  by it afterwards, so deleting the TrainJob deletes them. PVCs are created if missing and never
  deleted by us.

Status, from one watch-fed cache of TrainJobs and one of their pods per namespace:

===================================  =======================================================
TrainJob / pods                      JobState (message)
===================================  =======================================================
condition Complete=True              SUCCEEDED
condition Failed=True                FAILED ("<reason>: <message> (node <i> exited with code
                                     <c>)"; exit code of the node that failed first)
condition Suspended=True             STOPPED
no condition, a pod Running          RUNNING (Trainer has no Running condition)
no condition, pods ended             RUNNING (the JobSet is about to say how it ended)
no condition, no pod running yet     PENDING
(TrainJob gone)                      STOPPED if we deleted it, else absent
===================================  =======================================================

The job id is at most 50 characters, not 63: JobSet gives every pod the hostname
``<trainjob>-node-0-<index>``, which must be a DNS label (≤ 63) too.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
import shlex
import threading
from collections.abc import AsyncGenerator, Callable, Collection
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import SecretStr

from prefect_nemo.errors import (
    AuthenticationFailed,
    BackendClosed,
    BackendUnavailable,
    InvalidJobSpec,
    JobAlreadyExists,
)
from prefect_nemo.jobs import RESERVED_PREFIX, JobHandle, JobSpec, JobState, JobStatus
from prefect_nemo.kube import (
    CLUSTER_TRAINING_RUNTIME,
    CONFIGMAP,
    MANAGED_BY,
    POD,
    PVC,
    SECRET,
    TRAIN_JOB,
    TRAINING_RUNTIME,
    AlreadyExists,
    Informer,
    Invalid,
    Kind,
    KubeApi,
    NotFound,
    add_owner_reference,
    apply_or_attach,
    managed_labels,
    wait_for,
)
from prefect_nemo.kube.jobspec import check_labels, parse_time, secret_manifest, secret_name
from prefect_nemo.kube.memory import JobMemory, Subscribers
from prefect_nemo.names import (
    is_dns1035_label,
    is_dns1123_subdomain,
    label_value,
    resource_name,
    stable_hash,
)
from prefect_nemo.placement.spec import PlacementSpec, to_kubernetes

if TYPE_CHECKING:
    from prefect_nemo.packaging import TransportPlan

# JobSet names each pod's hostname <trainjob>-node-0-<index>: keep it a DNS label up to 10^4 nodes
MAX_TRAINJOB_NAME = 50
NODE = "node"  # the stock torch runtime's replicatedJob and container name
GPU_RESOURCE = "nvidia.com/gpu"
HOSTNAME_TOPOLOGY = "kubernetes.io/hostname"
ANNOTATION_PREFIX = "prefect-nemo.io/"
METADATA_ANNOTATION = "prefect-nemo.io/metadata"
OBJECTS_ANNOTATION = "prefect-nemo.io/owned-objects"  # Secret/ConfigMaps this TrainJob owns
PATCH_MANAGER = "prefect-nemo.io/code"  # our runtimePatches entry for the code
PLACEMENT_MANAGER = "prefect-nemo.io/placement"  # ... and for JobSpec.placement
PLACEMENT_GROUP_LABEL = "prefect-nemo/placement-group"  # what to_kubernetes' anti-affinity selects
MAX_OBJECT_BYTES = 1_000_000

JOBSET_NAME = "jobset.sigs.k8s.io/jobset-name"
REPLICATED_JOB = "jobset.sigs.k8s.io/replicatedjob-name"
JOB_INDEX = "jobset.sigs.k8s.io/job-index"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
ANCESTOR = "trainer.kubeflow.org/trainjob-ancestor-step"

# The Torch plugin sets these and its webhook refuses a TrainJob that sets them itself.
PET_ENV = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR",
           "PET_MASTER_PORT")  # fmt: skip
TORCHRUN_FLAGS = (
    '--nnodes="$PET_NNODES" --nproc-per-node="$PET_NPROC_PER_NODE" '
    '--node-rank="$PET_NODE_RANK" --master-addr="$PET_MASTER_ADDR" '
    '--master-port="$PET_MASTER_PORT"'
)

_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi|E|Ei)?$")
_PACKAGE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-\[\],<>=!~+* ]*$")
_PYTHON = re.compile(r"^(python3?(\.[0-9]+)?)\s+")


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
    if not is_dns1035_label(config.runtime_prefix, 40):
        raise InvalidJobSpec(
            f"{where}.runtime_prefix: {config.runtime_prefix!r} must be a DNS label of at most "
            "40 characters (the runtime name adds a hash)"
        )


def check_job_id(job_id: str) -> None:
    """TrainJob names are DNS-1035 labels; ours stay short enough for JobSet's pod hostnames."""
    if not is_dns1035_label(job_id, MAX_TRAINJOB_NAME):
        raise InvalidJobSpec(
            f"job id '{job_id}' cannot name a TrainJob: use a DNS-1035 label of at most "
            f"{MAX_TRAINJOB_NAME} characters (JobSet's pod hostnames add '-node-0-<index>'): "
            "use a shorter JobSpec.name or experiment name"
        )


def check_spec(spec: JobSpec, config: TrainerConfig) -> None:
    """Raise InvalidJobSpec for what a TrainJob cannot carry; sends nothing."""
    res = spec.resources
    if res.cpus is not None or res.gpus is not None or res.memory_bytes is not None or res.custom:
        raise InvalidJobSpec(
            "JobSpec.resources: a TrainJob's resources are per node: set gpus_per_node, "
            "cpus_per_node and memory_per_node on the KubeflowTrainerCluster block instead"
        )
    if spec.label_selector:
        raise InvalidJobSpec(
            "JobSpec.label_selector: Ray label selectors do not apply to TrainJobs: drop it"
        )
    if spec.placement is not None:
        check_placement(spec.placement, config)
    if spec.runtime_env:
        raise InvalidJobSpec(
            "JobSpec.runtime_env: a Ray runtime_env does not apply to TrainJobs: ship code with "
            "working_dir and packages with KubeflowTrainerCluster.extra_packages"
        )
    reserved = sorted(set(spec.env) & set(PET_ENV))
    if reserved:
        raise InvalidJobSpec(
            f"JobSpec.env: {', '.join(reserved)} are set by Kubeflow Trainer's torch plugin "
            "(its webhook rejects them): drop them"
        )
    check_labels(spec.labels)
    if spec.working_dir is not None and not Path(spec.working_dir).is_dir():
        raise InvalidJobSpec(
            f"JobSpec.working_dir: {spec.working_dir} is not a directory on this machine"
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
        # one node per host: the pods of *this* job repel each other (matchLabelKeys adds the
        # pod's own jobset-name to the selector; Kubernetes >= 1.29)
        pod["affinity"] = {
            "podAntiAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "labelSelector": {
                            "matchExpressions": [{"key": JOBSET_NAME, "operator": "Exists"}]
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
        "labels": {**managed_labels(), "trainer.kubeflow.org/framework": "torch"},
    }
    if kind.namespaced:
        metadata["namespace"] = namespace
    return {
        "apiVersion": kind.api_version,
        "kind": kind.kind,
        "metadata": metadata,
        "spec": runtime_body(config),
    }


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


def trainer_env(spec: JobSpec, job_id: str) -> list[dict[str, Any]]:
    """Plain values inline; secret ones by reference to the job's Secret."""
    env: list[dict[str, Any]] = []
    for key, value in spec.env.items():
        if isinstance(value, SecretStr):
            ref = {"name": secret_name(job_id), "key": key}
            env.append({"name": key, "valueFrom": {"secretKeyRef": ref}})
        else:
            env.append({"name": key, "value": value})
    return env


def trainer_command(spec: JobSpec, config: TrainerConfig, setup: str | None = None) -> list[str]:
    """`sh -c` script: unpack the code, cd into it, install extras, run (under torchrun).

    torchrun gets its rendezvous from the PET_* env the Torch plugin sets on every node; an
    entrypoint that is not a Python program (no leading `python`) runs as is.
    """
    lines = ["set -e", 'export NODE_RANK="${NODE_RANK:-${PET_NODE_RANK:-0}}"']
    if setup:
        lines.append(setup)
        lines.append(f"cd {shlex.quote(config.code_dir)}")
    if config.extra_packages:
        pkgs = " ".join(shlex.quote(p) for p in config.extra_packages)
        lines.append(f"python -m pip install --quiet --disable-pip-version-check {pkgs}")
    # the entrypoint runs under the shell's usual rules (its last command's status is the job's)
    lines += ["set +e", torchrun_entrypoint(spec.entrypoint, config)]
    return ["sh", "-c", "\n".join(lines)]


def torchrun_entrypoint(entrypoint: str, config: TrainerConfig) -> str:
    """`python x.py a` → `torchrun <rendezvous flags> x.py a` (also `python -m mod a`); any
    other command (`python -c ...`, a shell script), or torchrun off, is left as is."""
    match = _PYTHON.match(entrypoint)
    if not config.torchrun or match is None:
        return entrypoint
    rest = entrypoint[match.end() :]
    try:
        first = shlex.split(rest)[0] if rest.strip() else ""
    except ValueError:
        return entrypoint
    if first != "-m" and not first.endswith(".py"):
        return entrypoint
    return f"torchrun {TORCHRUN_FLAGS} {rest}"


def code_patch(plan: TransportPlan) -> dict[str, Any]:
    """The runtimePatches entry mounting the code ConfigMaps into the node container."""
    pod = {
        "volumes": copy.deepcopy(list(plan.volumes)),
        "containers": [{"name": NODE, "volumeMounts": copy.deepcopy(list(plan.volume_mounts))}],
    }
    return {
        "manager": PATCH_MANAGER,
        "trainingRuntimeSpec": {
            "template": {
                "spec": {
                    "replicatedJobs": [
                        {"name": NODE, "template": {"spec": {"template": {"spec": pod}}}}
                    ]
                }
            }
        },
    }


def placement_patch(placement: PlacementSpec, job_id: str) -> dict[str, Any] | None:
    """The runtimePatches entry putting JobSpec.placement's scheduling on the node pods
    (nodeSelector, node affinity; for nodes > 1 the pod anti-affinity, with the group label it
    selects on), or None when it constrains nothing. Resources come from the runtime, which
    check_placement made agree. A patched `affinity` replaces the runtime's (Trainer applies
    patches field by field), so the anti-affinity is repeated here, not left to the runtime."""
    pod = to_kubernetes(placement, group=job_id)
    spec: dict[str, Any] = {}
    if pod["nodeSelector"]:
        spec["nodeSelector"] = pod["nodeSelector"]
    if pod["affinity"]:
        spec["affinity"] = pod["affinity"]
    if not spec:
        return None
    template: dict[str, Any] = {"spec": spec}
    if "podAntiAffinity" in pod["affinity"]:
        template["metadata"] = {"labels": {PLACEMENT_GROUP_LABEL: job_id}}
    return {
        "manager": PLACEMENT_MANAGER,
        "trainingRuntimeSpec": {
            "template": {
                "spec": {
                    "replicatedJobs": [{"name": NODE, "template": {"spec": {"template": template}}}]
                }
            }
        },
    }


def trainjob_manifest(
    spec: JobSpec,
    job_id: str,
    metadata: dict[str, str],
    config: TrainerConfig,
    *,
    namespace: str,
    plan: TransportPlan | None = None,
) -> dict[str, Any]:
    """The TrainJob for a job: everything but secret env values, which go to `secret_manifest`."""
    flow_run_id = metadata.get(f"{RESERVED_PREFIX}flow_run_id") or None
    labels = {k: label_value(v) for k, v in spec.labels.items()}
    labels.update(managed_labels(flow_run_id))
    annotations = {
        f"{ANNOTATION_PREFIX}{k.removeprefix(RESERVED_PREFIX)}": v
        for k, v in metadata.items()
        if k.startswith(RESERVED_PREFIX)
    }
    if spec.metadata:
        annotations[METADATA_ANNOTATION] = json.dumps(spec.metadata, sort_keys=True)
    owned = owned_objects(spec, job_id, plan)
    if owned:
        annotations[OBJECTS_ANNOTATION] = json.dumps(owned)
    setup = None
    if plan is not None:
        setup = plan.setup_command(config.code_dir, shared=config.code_on_shared_volume)
    trainer: dict[str, Any] = {
        "image": config.image,
        "command": trainer_command(spec, config, setup),
        "numNodes": config.num_nodes,
        "numProcPerNode": config.nproc_per_node,
    }
    env = trainer_env(spec, job_id)
    if env:
        trainer["env"] = env
    resources = node_resources(config)
    if resources:
        trainer["resourcesPerNode"] = resources
    body: dict[str, Any] = {
        "runtimeRef": {
            "apiGroup": TRAIN_JOB.group,
            "kind": config.runtime_kind.kind,
            "name": runtime_name(config),
        },
        "trainer": trainer,
    }
    patches = [code_patch(plan)] if plan is not None else []
    placed = placement_patch(spec.placement, job_id) if spec.placement is not None else None
    if placed is not None:
        patches.append(placed)
    if patches:
        body["runtimePatches"] = patches
    manifest = {
        "apiVersion": TRAIN_JOB.api_version,
        "kind": TRAIN_JOB.kind,
        "metadata": {
            "name": job_id,
            "namespace": namespace,
            "labels": labels,
            "annotations": annotations,
        },
        "spec": body,
    }
    size = len(json.dumps(manifest))
    if size > MAX_OBJECT_BYTES:
        raise InvalidJobSpec(
            f"the TrainJob for this job would be {size} bytes; Kubernetes objects must stay "
            "under ~1 MB: shrink JobSpec.entrypoint/env/metadata"
        )
    return manifest


def owned_objects(spec: JobSpec, job_id: str, plan: TransportPlan | None) -> dict[str, list[str]]:
    """Names of the Secret and ConfigMaps a TrainJob owns (kept on it, to adopt after a crash)."""
    out: dict[str, list[str]] = {}
    if spec.secret_values():
        out["secrets"] = [secret_name(job_id)]
    if plan is not None:
        out["configmaps"] = [cm["metadata"]["name"] for cm in plan.configmaps]
    return out


# -------------------------------------------------------------------------------------------
# Status mapping (pure)


def _condition(obj: dict[str, Any], type_: str) -> dict[str, Any] | None:
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if cond.get("type") == type_ and cond.get("status") == "True":
            return cond
    return None


def _failed_node(pods: list[dict[str, Any]]) -> tuple[int, int] | None:
    """(node index, exit code) of the node that failed first: a code other than 137/143 (the
    SIGKILL/SIGTERM a node gets when a sibling fails) wins, then the earliest, then node-0."""
    failed = []
    for pod in pods:
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            term = (cs.get("state") or {}).get("terminated") or {}
            if cs.get("name") == NODE and term.get("exitCode"):
                code = int(term["exitCode"])
                when = str(term.get("finishedAt") or "")
                failed.append((code in (137, 143), when, _pod_index(pod), code))
    if not failed:
        return None
    _, _, index, code = min(failed)
    return index, code


def _pod_index(pod: dict[str, Any]) -> int:
    try:
        return int((pod["metadata"].get("labels") or {}).get(COMPLETION_INDEX, 0))
    except ValueError:
        return 0


def status_from_trainjob(obj: dict[str, Any], pods: list[dict[str, Any]]) -> JobStatus:
    """Our JobStatus from a TrainJob and its pods (the table in the module docstring)."""
    meta = obj.get("metadata") or {}
    name = meta.get("name", "")
    phases = [(p.get("status") or {}).get("phase") for p in pods]
    exit_code: int | None = None
    end: datetime | None = None
    if cond := _condition(obj, "Complete"):
        state, message = JobState.SUCCEEDED, cond.get("message") or ""
        end = parse_time(cond.get("lastTransitionTime"))
    elif cond := _condition(obj, "Failed"):
        state = JobState.FAILED
        reason, text = cond.get("reason") or "", cond.get("message") or ""
        message = ": ".join(p for p in (reason, text) if p) or f"TrainJob {name} failed"
        if (failed := _failed_node(pods)) is not None:
            exit_code = failed[1]
            message += f" (node {failed[0]} exited with code {failed[1]})"
        end = parse_time(cond.get("lastTransitionTime"))
    elif cond := _condition(obj, "Suspended"):
        state = JobState.STOPPED
        message = cond.get("message") or f"TrainJob {name} is suspended"
        end = parse_time(cond.get("lastTransitionTime"))
    elif "Running" in phases or any(ph in ("Succeeded", "Failed") for ph in phases):
        state, message = JobState.RUNNING, ""
    else:
        state, message = JobState.PENDING, ""
    if meta.get("deletionTimestamp") and not state.is_terminal():
        message = f"TrainJob {name} is being deleted"
    starts = [t for p in pods if (t := parse_time((p.get("status") or {}).get("startTime")))]
    metadata: dict[str, str] = {}
    annotations = meta.get("annotations") or {}
    try:
        metadata.update(json.loads(annotations.get(METADATA_ANNOTATION) or "{}"))
    except ValueError:
        pass
    for key, value in annotations.items():
        if key.startswith(ANNOTATION_PREFIX) and key not in (METADATA_ANNOTATION,
                                                              OBJECTS_ANNOTATION):  # fmt: skip
            metadata[RESERVED_PREFIX + key.removeprefix(ANNOTATION_PREFIX)] = value
    return JobStatus(
        job_id=name,
        state=state,
        message=message,
        start_time=min(starts) if starts else None,
        end_time=end,
        exit_code=exit_code,
        metadata=metadata,
    )


# -------------------------------------------------------------------------------------------
# Process-wide bookkeeping shared by the backend instances of one namespace

_memory = JobMemory()  # TrainJobs we deleted to stop them; last logs read


# -------------------------------------------------------------------------------------------
# The backend


class KubeflowTrainerBackend:
    """Run jobs as Kubeflow Trainer TrainJobs: submit, watch (informers), stop, logs."""

    kind: ClassVar[str] = "kubeflow-trainer"
    max_job_id_len: ClassVar[int] = MAX_TRAINJOB_NAME

    def __init__(
        self,
        api: KubeApi,
        config: TrainerConfig,
        *,
        namespace: str | None = None,
        chunk_bytes: int | None = None,
        max_code_bytes: int | None = None,
    ) -> None:
        self.api = api
        self.config = config
        self.namespace = namespace or api.namespace
        self.chunk_bytes = chunk_bytes
        self.max_code_bytes = max_code_bytes
        self._jobs: Informer | None = None
        self._pods: Informer | None = None
        self._subscribers = Subscribers()
        self._lock = threading.Lock()
        self._closed = False

    # -- identity ------------------------------------------------------------------------------

    @property
    def cluster(self) -> str:
        """API server and namespace: one watcher (and one pair of informers) per namespace."""
        return f"{self.api.host}/namespaces/{self.namespace}/trainjobs"

    @property
    def secrets(self) -> list[str]:
        """The API credentials, for redaction."""
        return list(self.api.secrets)

    def trainjob_url(self, job_id: str) -> str:
        """The TrainJob's path on the API server."""
        return (
            f"{self.api.host}/apis/{TRAIN_JOB.group}/{TRAIN_JOB.version}/namespaces/"
            f"{self.namespace}/{TRAIN_JOB.plural}/{job_id}"
        )

    def handle(self, job_id: str) -> JobHandle:
        """The handle with the TrainJob's API path."""
        return JobHandle(
            backend=self.kind,
            cluster=self.cluster,
            job_id=job_id,
            links={"trainjob": self.trainjob_url(job_id)},
        )

    # -- Backend protocol -----------------------------------------------------------------------

    def validate(self, spec: JobSpec) -> None:
        """Everything we can check without the API server: names, sizes, env, the code's size."""
        check_spec(spec, self.config)
        plan = self._plan(spec, "j" * MAX_TRAINJOB_NAME) if spec.working_dir else None
        trainjob_manifest(
            spec, "j" * MAX_TRAINJOB_NAME, {}, self.config, namespace=self.namespace, plan=plan
        )

    def check_access(self) -> None:
        """Reach the API server and prove we may list TrainJobs (Kubeflow Trainer installed)."""
        try:
            self.api.list(
                TRAIN_JOB, self.namespace, label_selector=f"{MANAGED_BY}=prefect-nemo", limit=1
            )
        except NotFound:
            raise BackendUnavailable(
                f"the API server at {self.api.host} does not serve {TRAIN_JOB.plural}."
                f"{TRAIN_JOB.group}/{TRAIN_JOB.version}: install Kubeflow Trainer (v2.3+) in "
                "the cluster"
            ) from None

    def find(self, job_id: str) -> JobStatus | None:
        """The TrainJob's status (a GET and a pod list), STOPPED if we deleted it, else None."""
        obj = self.api.get(TRAIN_JOB, job_id, self.namespace)
        if obj is None:
            return self._deleted_status(job_id)
        pods, _ = self.api.list(POD, self.namespace, label_selector=f"{JOBSET_NAME}={job_id}")
        return status_from_trainjob(obj, pods)

    def submit(self, spec: JobSpec, job_id: str, metadata: dict[str, str]) -> JobHandle:
        """Create PVCs, runtime, Secret, ConfigMaps, then the TrainJob (which then owns the
        Secret and ConfigMaps); JobAlreadyExists if a TrainJob has the name."""
        check_job_id(job_id)
        check_spec(spec, self.config)
        flow_run_id = metadata.get(f"{RESERVED_PREFIX}flow_run_id") or None
        plan = self._plan(spec, job_id) if spec.working_dir is not None else None
        manifest = trainjob_manifest(
            spec, job_id, metadata, self.config, namespace=self.namespace, plan=plan
        )
        secret = secret_manifest(spec, job_id, namespace=self.namespace, flow_run_id=flow_run_id)
        existing = self.api.get(TRAIN_JOB, job_id, self.namespace)
        if existing is not None:  # attach: leave its objects alone, but adopt any orphan
            self._adopt(existing)
            raise JobAlreadyExists(f"TrainJob '{job_id}' already exists")
        self._ensure_pvcs()
        self._ensure_runtime()
        owned: list[tuple[Any, dict[str, Any]]] = []
        if secret is not None:
            owned.append((SECRET, secret))
        for cm in plan.configmaps if plan is not None else []:
            cm = copy.deepcopy(cm)
            meta = cm.setdefault("metadata", {})
            meta["namespace"] = self.namespace
            meta["labels"] = {**(meta.get("labels") or {}), **managed_labels(flow_run_id)}
            meta.pop("ownerReferences", None)
            owned.append((CONFIGMAP, cm))
        for kind, obj in owned:
            self._create_fresh(kind, obj)
        _memory.forget_deleted((self.cluster, job_id))
        try:
            created = self.api.create(TRAIN_JOB, manifest, self.namespace)
        except AlreadyExists:
            raise JobAlreadyExists(f"TrainJob '{job_id}' already exists") from None
        except (Invalid, AuthenticationFailed) as exc:
            # a definite no: nothing will own the Secret and ConfigMaps, so they go now (not on
            # a timeout, where the TrainJob may exist and need them)
            for kind, obj in owned:
                self.api.delete(kind, obj["metadata"]["name"], self.namespace)
            if isinstance(exc, AuthenticationFailed):
                raise
            raise InvalidJobSpec(
                f"the API server rejected TrainJob '{job_id}': {exc}. Check the "
                "KubeflowTrainerCluster fields and the JobSpec fields it names"
            ) from None
        self._adopt(created)
        return self.handle(job_id)

    def statuses(self, job_ids: Collection[str]) -> dict[str, JobStatus]:
        """From the informers' caches; one GET only for ids the cache has not seen yet."""
        if self._closed:
            raise BackendClosed(f"the Kubeflow Trainer backend of {self.cluster} was closed")
        jobs, pods = self._ensure_informers()
        for informer in (jobs, pods):
            if informer.error is not None:
                raise BackendUnavailable(
                    f"watch of {informer.kind.plural} in {self.namespace} on {self.api.host} "
                    f"broke: {informer.error}"
                )
        synced = jobs.synced.is_set() and pods.synced.is_set()
        out: dict[str, JobStatus] = {}
        for job_id in job_ids:
            obj = jobs.get(job_id) if synced else None
            if obj is None:
                found = self.find(job_id)
                if found is not None:
                    out[job_id] = found
                continue
            out[job_id] = status_from_trainjob(obj, self._cached_pods(pods, job_id))
        return out

    def subscribe(self, wake: Callable[[], None]) -> Callable[[], None]:
        """Wake the watcher on every change of a managed TrainJob or of a TrainJob's pod."""
        self._subscribers.add(wake)
        self._ensure_informers()

        def unsubscribe() -> None:
            if self._subscribers.remove(wake):
                with self._lock:
                    informers, self._jobs, self._pods = (self._jobs, self._pods), None, None
                for informer in informers:
                    if informer is not None:
                        informer.stop()

        return unsubscribe

    def close(self) -> None:
        """Stop the informers (their watches are cut at once) and wake the subscribed watchers,
        whose next poll then raises BackendClosed."""
        with self._lock:
            self._closed = True
            informers, self._jobs, self._pods = (self._jobs, self._pods), None, None
        for informer in informers:
            if informer is not None:
                informer.stop()
        self._subscribers.wake_all()

    def request_stop(self, job_id: str) -> None:
        """Delete the TrainJob (foreground: its JobSet and pods go first, then its Secret and
        ConfigMaps by ownership); lifecycle.stop_and_confirm waits until it is gone."""
        _memory.mark_deleted((self.cluster, job_id))
        self.api.delete(TRAIN_JOB, job_id, self.namespace, propagation="Foreground")

    def logs(self, job_id: str) -> str:
        """The node-0 pod's whole log; the last read once the pod is gone."""
        key = (self.cluster, job_id)
        pod = self._node0(job_id)
        if pod is None:
            return _memory.last_log(key) or ""
        try:
            text = self._read_log(pod)
        except (BackendUnavailable, NotFound):
            cached = _memory.last_log(key)
            if cached is not None:
                return cached
            raise
        return _memory.remember_log(key, text)

    async def tail_logs(self, job_id: str) -> AsyncGenerator[str, None]:
        """Poll node-0's log with a growing offset; ends when the job ends."""
        sent = 0
        while True:
            status = await asyncio.to_thread(self._status_now, job_id)
            done = status is None or status.state.is_terminal()
            try:
                text = await asyncio.to_thread(self.logs, job_id)
            except (BackendUnavailable, NotFound):
                text = ""
            if len(text) > sent:
                yield text[sent:]
                sent = len(text)
            if done:
                return
            await asyncio.sleep(0.5)

    # -- helpers ----------------------------------------------------------------------------------

    def _plan(self, spec: JobSpec, job_id: str) -> TransportPlan:
        """The ConfigMap transport of working_dir. build_archive reuses an unchanged tree's
        archive (by content hash), so planning again at submit costs only the file walk."""
        from prefect_nemo.packaging import build_archive, plan_for

        assert spec.working_dir is not None
        archive = build_archive(Path(spec.working_dir), exclude=tuple(spec.exclude))
        return plan_for(
            "kubernetes", archive, name=job_id,
            chunk_bytes=self.chunk_bytes, max_bytes=self.max_code_bytes,
        )  # fmt: skip

    def _ensure_pvcs(self) -> None:
        for mount in self.config.pvc_mounts:
            if self.api.get(PVC, mount.name, self.namespace) is not None:
                continue
            try:
                self.api.create(PVC, pvc_manifest(mount, self.namespace), self.namespace)
            except AlreadyExists:
                pass  # created meanwhile: fine, we only need it to exist

    def _ensure_runtime(self) -> None:
        """Create the config's runtime or reuse the one of that name (never changed in place)."""
        try:
            manifest = runtime_manifest(self.config, self.namespace)
            apply_or_attach(self.api, manifest, namespace=self.namespace)
        except Invalid as exc:
            raise InvalidJobSpec(
                f"the API server rejected {manifest['kind']} {runtime_name(self.config)}: "
                f"{exc}. Check the KubeflowTrainerCluster fields it names"
            ) from None

    def _create_fresh(self, kind: Any, obj: dict[str, Any]) -> None:
        """Create an object the TrainJob will own. One left by a submit that died before the
        TrainJob existed is reused if it is a code ConfigMap (immutable, named by its content)
        and replaced if it is the Secret (its values may have changed); one still owned by an
        earlier TrainJob of this name (being garbage-collected) is waited out and recreated."""
        name = obj["metadata"]["name"]
        try:
            self.api.create(kind, obj, self.namespace)
            return
        except AlreadyExists:
            existing = self.api.get(kind, name, self.namespace) or {}
        meta = existing.get("metadata") or {}
        if (
            kind is CONFIGMAP
            and not meta.get("ownerReferences")
            and not meta.get("deletionTimestamp")
        ):
            return
        self.api.delete(kind, name, self.namespace)
        wait_for(
            self.api, kind, name, lambda o: o is None, namespace=self.namespace,
            timeout_s=60, what=f"deletion of the leftover {kind.kind} {name}",
        )  # fmt: skip
        self.api.create(kind, obj, self.namespace)

    def _adopt(self, trainjob: dict[str, Any]) -> None:
        """Make the TrainJob the owner of its Secret and ConfigMaps (idempotent), so deleting
        it deletes them; also repairs a submit that died between create and this step."""
        annotations = (trainjob.get("metadata") or {}).get("annotations") or {}
        try:
            owned = json.loads(annotations.get(OBJECTS_ANNOTATION) or "{}")
        except ValueError:
            return
        kinds = {"secrets": SECRET, "configmaps": CONFIGMAP}
        for plural, names in owned.items():
            for name in names:
                try:
                    add_owner_reference(self.api, kinds[plural], name, trainjob, self.namespace)
                except (NotFound, KeyError):
                    continue

    def _deleted_status(self, job_id: str) -> JobStatus | None:
        return _memory.stopped_status(
            self.cluster, job_id, "stopped: the TrainJob and its pods were deleted"
        )

    def _ensure_informers(self) -> tuple[Informer, Informer]:
        with self._lock:
            if self._jobs is None or self._pods is None:
                self._jobs = Informer(
                    self.api, TRAIN_JOB, self.namespace,
                    label_selector=f"{MANAGED_BY}=prefect-nemo",
                    on_change=self._subscribers.wake_all,
                ).start()  # fmt: skip
                self._pods = Informer(
                    self.api, POD, self.namespace,
                    label_selector=f"{MANAGED_BY}=prefect-nemo,{JOBSET_NAME}",
                    on_change=self._subscribers.wake_all,
                ).start()  # fmt: skip
            return self._jobs, self._pods

    @staticmethod
    def _cached_pods(pods: Informer, job_id: str) -> list[dict[str, Any]]:
        return [
            pod
            for pod in pods.items()
            if (pod["metadata"].get("labels") or {}).get(JOBSET_NAME) == job_id
        ]

    def _status_now(self, job_id: str) -> JobStatus | None:
        """From the cache when the informers run (no request), else one find()."""
        with self._lock:
            jobs, pods = self._jobs, self._pods
        if jobs is not None and pods is not None and jobs.synced.is_set():
            obj = jobs.get(job_id)
            if obj is not None:
                return status_from_trainjob(obj, self._cached_pods(pods, job_id))
        return self.find(job_id)

    def _node0(self, job_id: str) -> dict[str, Any] | None:
        """The pod of replicatedJob `node`, job index 0, completion index 0 (torchrun rank 0)."""
        selector = ",".join(
            [f"{JOBSET_NAME}={job_id}", f"{REPLICATED_JOB}={NODE}", f"{JOB_INDEX}=0",
             f"{COMPLETION_INDEX}=0"]
        )  # fmt: skip
        pods, _ = self.api.list(POD, self.namespace, label_selector=selector)
        live = [p for p in pods if not p["metadata"].get("deletionTimestamp")] or pods
        if not live:
            return None
        return max(live, key=lambda p: p["metadata"].get("creationTimestamp") or "")

    def _read_log(self, pod: dict[str, Any]) -> str:
        return self.api.pod_log(pod["metadata"]["name"], self.namespace, container=NODE)


__all__ = [
    "MAX_TRAINJOB_NAME",
    "KubeflowTrainerBackend",
    "PvcMount",
    "TrainerConfig",
    "check_config",
    "check_job_id",
    "check_spec",
    "code_patch",
    "pvc_manifest",
    "runtime_manifest",
    "runtime_name",
    "secret_manifest",
    "status_from_trainjob",
    "trainer_command",
    "trainjob_manifest",
]
