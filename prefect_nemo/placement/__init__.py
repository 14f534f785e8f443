"""Placement on Ray: plan replica bundles, hold detached placement groups, run managed
subprocesses in them that die with their actor, and sweep up after crashed drivers.

A plain library (no Prefect): `prefect_nemo.tasks.replicas` is the Prefect side. `PlacementSpec` and
its translators are the backend-neutral way to say where work runs.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from prefect_nemo.placement.errors import (
    InsufficientCapacity,
    PlacementError,
    PlacementTimeout,
    ReplicaFailed,
)
from prefect_nemo.placement.plan import (
    BundleShape,
    NodeInfo,
    Topology,
    check_capacity,
    max_replicas,
    plan_replica_bundle_shape,
)
from prefect_nemo.placement.spec import (
    PlacementSpec,
    to_kubernetes,
    to_ray_bundles,
    to_ray_entrypoint,
    to_slurm,
)

# The parts that talk to Ray load on first use, so `placement.spec` and `placement.plan` (what
# JobSpec and the Kubernetes/Slurm backends need) import without importing Ray.
_LAZY = {
    "NAME_PREFIX": "groups",
    "NAMESPACE": "groups",
    "bundle_node": "groups",
    "connect": "groups",
    "create_group": "groups",
    "find_group": "groups",
    "remove_group": "groups",
    "wait_ready": "groups",
    "ManagedProcess": "process",
    "module_command": "process",
    "node_ip_and_free_port": "process",
    "spawn_actor": "process",
    "stop_many": "process",
    "SweepReport": "orphans",
    "sweep": "orphans",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(f"prefect_nemo.placement.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'prefect_nemo.placement' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "NAMESPACE",
    "NAME_PREFIX",
    "BundleShape",
    "InsufficientCapacity",
    "ManagedProcess",
    "NodeInfo",
    "PlacementError",
    "PlacementSpec",
    "PlacementTimeout",
    "ReplicaFailed",
    "SweepReport",
    "Topology",
    "bundle_node",
    "check_capacity",
    "connect",
    "create_group",
    "find_group",
    "max_replicas",
    "module_command",
    "node_ip_and_free_port",
    "plan_replica_bundle_shape",
    "remove_group",
    "spawn_actor",
    "stop_many",
    "sweep",
    "to_kubernetes",
    "to_ray_bundles",
    "to_ray_entrypoint",
    "to_slurm",
    "wait_ready",
]
