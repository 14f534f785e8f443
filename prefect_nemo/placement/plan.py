"""Replica planning: how many GPUs on how many nodes one tensor-parallel replica takes, and
whether a set of replicas can ever fit the cluster (so we fail fast instead of waiting on a
placement group that never becomes ready)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from prefect_nemo.placement.errors import InsufficientCapacity, PlacementError

HEAD_RESOURCE = "node:__internal_head__"
NODE_ID_LABEL = "ray.io/node-id"
Strategy = Literal["STRICT_PACK", "STRICT_SPREAD"]


@dataclass(frozen=True)
class NodeInfo:
    """One alive Ray node as the planner sees it."""

    node_id: str
    ip: str
    gpus: int
    cpus: float
    labels: Mapping[str, str] = field(default_factory=dict)
    is_head: bool = False


@dataclass(frozen=True)
class Topology:
    """The alive nodes of a cluster (or the ones a replica may use)."""

    nodes: tuple[NodeInfo, ...]

    @classmethod
    def from_ray_nodes(cls, nodes: Iterable[Mapping[str, Any]]) -> Topology:
        """Build from `ray.nodes()` output; dead nodes are left out."""
        infos = []
        for node in nodes:
            if not node.get("Alive"):
                continue
            res = node.get("Resources") or {}
            infos.append(
                NodeInfo(
                    node_id=node["NodeID"],
                    ip=node.get("NodeManagerAddress", ""),
                    gpus=int(res.get("GPU", 0)),
                    cpus=float(res.get("CPU", 0)),
                    labels=dict(node.get("Labels") or {}),
                    is_head=HEAD_RESOURCE in res,
                )
            )
        return cls(tuple(infos))

    @classmethod
    def from_state_nodes(cls, rows: Iterable[Mapping[str, Any]]) -> Topology:
        """Build from the dashboard's state API (`GET /api/v0/nodes`: data.result.result), for
        callers that reach the cluster only through its dashboard (the Ray Jobs backend)."""
        return cls.from_ray_nodes(
            {
                "NodeID": row["node_id"],
                "Alive": row.get("state") == "ALIVE",
                "NodeManagerAddress": row.get("node_ip", ""),
                "Resources": {
                    **(row.get("resources_total") or {}),
                    **({HEAD_RESOURCE: 1.0} if row.get("is_head_node") else {}),
                },
                "Labels": row.get("labels") or {},
            }
            for row in rows
        )

    @classmethod
    def from_ray(cls) -> Topology:
        """The topology of the cluster this process is connected to."""
        import ray

        return cls.from_ray_nodes(ray.nodes())

    @property
    def head(self) -> NodeInfo | None:
        """The head node, if it is among these nodes."""
        return next((n for n in self.nodes if n.is_head), None)

    def eligible(
        self, *, exclude_head: bool = False, labels: Mapping[str, str] | None = None
    ) -> Topology:
        """The nodes a replica may use: without the head if asked, matching the label selector."""
        return Topology(
            tuple(
                n
                for n in self.nodes
                if not (exclude_head and n.is_head)
                and all(label_matches(n.labels.get(k), v) for k, v in (labels or {}).items())
            )
        )


def label_matches(value: str | None, selector: str) -> bool:
    """Ray's label selector semantics: 'v', '!v', 'in(a,b)', '!in(a,b)'."""
    negate = selector.startswith("!")
    body = selector[1:] if negate else selector
    if body.startswith("in(") and body.endswith(")"):
        hit = value in {v.strip() for v in body[3:-1].split(",")}
    else:
        hit = value == body
    return hit != negate


@dataclass(frozen=True)
class BundleShape:
    """One replica's placement group: `nodes` bundles of `gpus_per_node` GPUs each."""

    nodes: int
    gpus_per_node: int
    strategy: Strategy

    @property
    def tp_size(self) -> int:
        """GPUs per replica."""
        return self.nodes * self.gpus_per_node


def plan_replica_bundle_shape(tp_size: int, topology: Topology) -> BundleShape:
    """The bundle shape of one replica of `tp_size` GPUs on this topology.

    A replica that fits one node is one STRICT_PACK bundle. Otherwise it spreads (STRICT_SPREAD)
    over the fewest nodes that take an equal share each: tensor-parallel engines such as vLLM need
    the same local world size on every node, so an unequal split is refused.
    """
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise PlacementError(
            f"tp_size={tp_size!r}: a replica needs at least one GPU; pass tp_size >= 1 "
            "(serve_replicas takes tp_size=0 for CPU-only replicas)"
        )
    gpus = sorted((n.gpus for n in topology.nodes if n.gpus > 0), reverse=True)
    if not gpus:
        raise InsufficientCapacity(
            f"tp_size={tp_size}: no eligible node has a GPU ({_describe(topology)}); add GPU "
            "nodes, relax the node labels or allow the head node"
        )
    if tp_size <= gpus[0]:
        return BundleShape(1, tp_size, "STRICT_PACK")
    for nodes in range(2, len(gpus) + 1):
        if tp_size % nodes == 0 and gpus[nodes - 1] >= tp_size // nodes:
            return BundleShape(nodes, tp_size // nodes, "STRICT_SPREAD")
    raise PlacementError(
        f"tp_size={tp_size} cannot be split equally over the eligible nodes "
        f"({_describe(topology)}): a multi-node replica needs N nodes with tp_size/N GPUs "
        "each; pick a tp_size that is a multiple of the GPUs per node, or add nodes"
    )


def max_replicas(shape: BundleShape, topology: Topology) -> int:
    """How many replicas of this shape the topology holds when empty.

    Each replica takes `shape.nodes` distinct nodes; a node with g GPUs holds g // per bundles.
    R replicas fit iff sum(min(slots_i, R)) >= nodes * R (each replica uses a node at most once).
    """
    slots = [n.gpus // shape.gpus_per_node for n in topology.nodes]
    best, r = 0, 1
    while sum(min(s, r) for s in slots) >= shape.nodes * r:
        best, r = r, r + 1
    return best


def check_capacity(
    shape: BundleShape | None,
    replicas: int,
    topology: Topology,
    *,
    cpus_per_bundle: float = 0.0,
) -> None:
    """Fail fast when `replicas` replicas can never fit, whatever else finishes."""
    if replicas < 1:
        raise PlacementError(f"replicas={replicas}: pass replicas >= 1")
    if not topology.nodes:
        raise InsufficientCapacity("no eligible node: relax the node labels or allow the head")
    if shape is not None:
        fits = max_replicas(shape, topology)
        if fits < replicas:
            raise InsufficientCapacity(
                f"{replicas} replica(s) of {shape.tp_size} GPU(s) ({shape.nodes} node(s) x "
                f"{shape.gpus_per_node} GPU(s), {shape.strategy}) cannot fit: the eligible nodes "
                f"({_describe(topology)}) hold at most {fits}; lower replicas or tp_size, or add "
                "GPU nodes"
            )
    bundles = replicas * (shape.nodes if shape else 1)
    total_cpus = sum(n.cpus for n in topology.nodes)
    if cpus_per_bundle > 0 and bundles * cpus_per_bundle > total_cpus + 1e-9:
        raise InsufficientCapacity(
            f"{bundles} bundle(s) of {cpus_per_bundle:g} CPU(s) cannot fit in the eligible "
            f"nodes' {total_cpus:g} CPUs ({_describe(topology)}); lower cpus_per_replica"
        )


def _describe(topology: Topology) -> str:
    if not topology.nodes:
        return "no nodes"
    parts = [
        f"{n.node_id[:8]}{' (head)' if n.is_head else ''}: {n.gpus} GPU, {n.cpus:g} CPU"
        for n in topology.nodes
    ]
    return "; ".join(parts)
