"""Placement on Ray: plan replica bundles, hold detached placement groups, run managed
subprocesses in them that die with their actor, and sweep up after crashed drivers.

A plain library (no Prefect): `prefect_nemo.serving` is the Prefect side. `PlacementSpec` and
its translators are the backend-neutral way to say where work runs.
"""

from __future__ import annotations

from prefect_nemo.placement.errors import (
    InsufficientCapacity,
    PlacementError,
    PlacementTimeout,
    ReplicaFailed,
)
from prefect_nemo.placement.groups import (
    NAME_PREFIX,
    NAMESPACE,
    bundle_node,
    connect,
    create_group,
    find_group,
    node_ip_and_free_port,
    remove_group,
    wait_ready,
)
from prefect_nemo.placement.plan import (
    BundleShape,
    NodeInfo,
    Topology,
    check_capacity,
    max_replicas,
    plan_replica_bundle_shape,
)
from prefect_nemo.placement.process import ManagedProcess, module_command, spawn_actor, stop_many
from prefect_nemo.placement.spec import (
    PlacementSpec,
    to_kubernetes,
    to_ray_bundles,
    to_ray_entrypoint,
    to_slurm,
)
from prefect_nemo.placement.sweep import SweepReport, sweep

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
