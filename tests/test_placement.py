"""The placement library without a cluster: planner, capacity check, PlacementSpec, translators."""

from __future__ import annotations

import sys

import pytest
from pydantic import ValidationError

from prefect_nemo.placement import (
    BundleShape,
    InsufficientCapacity,
    NodeInfo,
    PlacementError,
    PlacementSpec,
    Topology,
    check_capacity,
    max_replicas,
    plan_replica_bundle_shape,
    to_kubernetes,
    to_ray_bundles,
    to_ray_entrypoint,
    to_slurm,
)
from prefect_nemo.placement.plan import label_matches


def topo(*gpus: int, head_gpus: int | None = None) -> Topology:
    nodes = [NodeInfo(f"node{i}", f"10.0.0.{i}", g, 8.0) for i, g in enumerate(gpus)]
    if head_gpus is not None:
        nodes.insert(0, NodeInfo("head", "10.0.0.100", head_gpus, 8.0, is_head=True))
    return Topology(tuple(nodes))


@pytest.mark.parametrize(
    ("gpus", "tp", "expected"),
    [
        ((8,), 1, BundleShape(1, 1, "STRICT_PACK")),  # single node
        ((8,), 8, BundleShape(1, 8, "STRICT_PACK")),
        ((4, 4), 4, BundleShape(1, 4, "STRICT_PACK")),  # 2x4
        ((4, 4), 8, BundleShape(2, 4, "STRICT_SPREAD")),
        ((2, 2, 2, 2), 2, BundleShape(1, 2, "STRICT_PACK")),  # 4x2
        ((2, 2, 2, 2), 4, BundleShape(2, 2, "STRICT_SPREAD")),
        ((2, 2, 2, 2), 6, BundleShape(3, 2, "STRICT_SPREAD")),
        ((2, 2, 2, 2), 8, BundleShape(4, 2, "STRICT_SPREAD")),
        ((8, 2), 6, BundleShape(1, 6, "STRICT_PACK")),  # asymmetric nodes, fits the big one
    ],
)
def test_planner_table(gpus, tp, expected):
    assert plan_replica_bundle_shape(tp, topo(*gpus)) == expected


@pytest.mark.parametrize(
    ("gpus", "tp", "fragment"),
    [
        ((4, 2), 6, "cannot be split equally"),  # asymmetric: 4+2 only
        ((4, 4), 12, "cannot be split equally"),  # more than the cluster
        ((2, 2, 2, 2), 5, "cannot be split equally"),  # prime over 2-GPU nodes
        ((4, 4), 0, "at least one GPU"),  # tp=0
        ((4, 4), -1, "at least one GPU"),
    ],
)
def test_planner_rejects(gpus, tp, fragment):
    with pytest.raises(PlacementError, match=fragment):
        plan_replica_bundle_shape(tp, topo(*gpus))


def test_planner_needs_gpus():
    with pytest.raises(InsufficientCapacity, match="no eligible node has a GPU"):
        plan_replica_bundle_shape(1, topo(0, 0))


def test_head_exclusion_and_labels_shape_the_topology():
    t = Topology(
        (
            NodeInfo("head", "h", 8, 8, {"pool": "a"}, is_head=True),
            NodeInfo("w1", "a", 2, 8, {"pool": "a"}),
            NodeInfo("w2", "b", 2, 8, {"pool": "b"}),
        )
    )
    assert plan_replica_bundle_shape(8, t).strategy == "STRICT_PACK"  # the head fits it
    workers = t.eligible(exclude_head=True)
    assert [n.node_id for n in workers.nodes] == ["w1", "w2"]
    assert plan_replica_bundle_shape(4, workers) == BundleShape(2, 2, "STRICT_SPREAD")
    assert [n.node_id for n in t.eligible(labels={"pool": "!a"}).nodes] == ["w2"]
    assert [n.node_id for n in t.eligible(labels={"pool": "in(a,b)"}).nodes] == ["head", "w1", "w2"]


@pytest.mark.parametrize(
    ("value", "selector", "hit"),
    [
        ("a", "a", True),
        ("a", "!a", False),
        (None, "!a", True),
        ("b", "in(a, b)", True),
        ("c", "!in(a,b)", True),
        (None, "a", False),
    ],
)
def test_label_matches(value, selector, hit):
    assert label_matches(value, selector) is hit


def test_capacity_check_counts_distinct_nodes():
    spread = BundleShape(2, 2, "STRICT_SPREAD")
    # 3 nodes of 4 GPUs hold 2-per-node slots 2,2,2: three replicas of 2 nodes x 2 GPUs.
    assert max_replicas(spread, topo(4, 4, 4)) == 3
    # One big node cannot host both halves of a spread replica.
    assert max_replicas(spread, topo(8, 0)) == 0
    assert max_replicas(BundleShape(1, 2, "STRICT_PACK"), topo(4, 3)) == 3
    check_capacity(spread, 3, topo(4, 4, 4))
    with pytest.raises(InsufficientCapacity, match="hold at most 3"):
        check_capacity(spread, 4, topo(4, 4, 4))
    with pytest.raises(InsufficientCapacity, match="CPU"):
        check_capacity(None, 5, topo(0, 0), cpus_per_bundle=4)
    with pytest.raises(PlacementError, match="replicas=0"):
        check_capacity(None, 0, topo(1))


def test_topology_from_ray_nodes():
    nodes = [
        {
            "NodeID": "h",
            "Alive": True,
            "NodeManagerAddress": "1.1.1.1",
            "Resources": {"CPU": 4.0, "GPU": 2.0, "node:__internal_head__": 1.0},
            "Labels": {"ray.io/node-id": "h"},
        },
        {"NodeID": "w", "Alive": True, "NodeManagerAddress": "1.1.1.2", "Resources": {"CPU": 2}},
        {"NodeID": "dead", "Alive": False, "Resources": {"GPU": 8}},
    ]
    t = Topology.from_ray_nodes(nodes)
    assert [n.node_id for n in t.nodes] == ["h", "w"]
    assert t.head is not None and t.head.gpus == 2 and t.nodes[1].gpus == 0


def test_topology_from_state_api_rows():
    rows = [
        {
            "node_id": "h",
            "node_ip": "1.1.1.1",
            "is_head_node": True,
            "state": "ALIVE",
            "resources_total": {"CPU": 4.0, "GPU": 1.0},
            "labels": {"ray.io/node-id": "h"},
        },
        {
            "node_id": "w",
            "node_ip": "1.1.1.2",
            "is_head_node": False,
            "state": "ALIVE",
            "resources_total": {"CPU": 8.0, "GPU": 4.0},
            "labels": {"pool": "a"},
        },
        {
            "node_id": "x",
            "node_ip": "1.1.1.3",
            "is_head_node": False,
            "state": "DEAD",
            "resources_total": {"GPU": 8.0},
            "labels": {},
        },
    ]
    t = Topology.from_state_nodes(rows)
    assert [(n.node_id, n.is_head, n.gpus) for n in t.nodes] == [("h", True, 1), ("w", False, 4)]
    assert t.nodes[1].labels == {"pool": "a"}


# ---------------------------------------------------------------------------------------------
# PlacementSpec


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"nodes": 0}, "nodes"),
        ({"gpus_per_node": -1}, "gpus_per_node"),
        ({"nodes": 2}, "use strategy='spread'"),
        ({"strategy": "scatter"}, "strategy"),
        ({"node_labels": {"pool": "in(a"}}, "write a selector as"),
        ({"node_labels": {"bad key!": "a"}}, "not a valid label name"),
        ({"exclude_head": True, "node_labels": {"ray.io/node-id": "x"}}, "drop one"),
        ({"gpus": 2}, "gpus"),  # unknown field: extra is forbidden
    ],
)
def test_spec_validation_names_field_and_fix(kwargs, fragment):
    with pytest.raises(ValidationError, match=fragment.replace("(", r"\(")):
        PlacementSpec(**kwargs)


def test_spec_to_ray_bundles():
    spec = PlacementSpec(nodes=2, gpus_per_node=4, cpus_per_node=8, strategy="spread")
    assert to_ray_bundles(spec) == ([{"CPU": 8.0, "GPU": 4.0}] * 2, "STRICT_SPREAD", None)
    packed = PlacementSpec(gpus_per_node=2, node_labels={"pool": "a"}, exclude_head=True)
    bundles, strategy, selectors = to_ray_bundles(packed, head_node_id="abc")
    assert (bundles, strategy) == ([{"CPU": 1.0, "GPU": 2.0}], "STRICT_PACK")
    assert selectors == [{"pool": "a", "ray.io/node-id": "!abc"}]
    with pytest.raises(PlacementError, match="head_node_id"):
        to_ray_bundles(packed)
    with pytest.raises(PlacementError, match="cpus_per_node > 0"):
        to_ray_bundles(PlacementSpec(cpus_per_node=0))


def test_spec_to_ray_entrypoint():
    spec = PlacementSpec(gpus_per_node=1, cpus_per_node=2, node_labels={"zone": "in(a,b)"})
    assert to_ray_entrypoint(spec) == (
        {"entrypoint_num_cpus": 2.0, "entrypoint_num_gpus": 1.0},
        {"zone": "in(a,b)"},
    )
    assert to_ray_entrypoint(PlacementSpec(exclude_head=True), head_node_id="h")[1] == {
        "ray.io/node-id": "!h"
    }
    with pytest.raises(PlacementError, match="one node"):
        to_ray_entrypoint(PlacementSpec(nodes=2, strategy="spread"))


def test_spec_to_kubernetes():
    spec = PlacementSpec(
        nodes=2,
        gpus_per_node=8,
        cpus_per_node=16,
        strategy="spread",
        node_labels={"pool": "gpu", "zone": "!in(z1,z2)"},
    )
    out = to_kubernetes(spec, group="sft-1")
    assert out["nodeSelector"] == {"pool": "gpu"}
    terms = out["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"][0]["matchExpressions"] == [
        {"key": "zone", "operator": "NotIn", "values": ["z1", "z2"]}
    ]
    anti = out["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["topologyKey"] == "kubernetes.io/hostname"
    assert anti[0]["labelSelector"]["matchLabels"] == {"prefect-nemo/placement-group": "sft-1"}
    assert out["resources"]["limits"] == {"cpu": "16", "nvidia.com/gpu": "8"}
    single = to_kubernetes(PlacementSpec(cpus_per_node=0.5))
    assert single == {
        "nodeSelector": {},
        "affinity": {},
        "resources": {"requests": {"cpu": "0.5"}, "limits": {"cpu": "0.5"}},
    }
    with pytest.raises(PlacementError, match="group="):
        to_kubernetes(spec)


def test_spec_to_slurm():
    spec = PlacementSpec(
        nodes=4,
        gpus_per_node=8,
        cpus_per_node=32,
        strategy="spread",
        node_labels={"gpu": "h100", "rack": "in(r1,r2)"},
    )
    assert to_slurm(spec) == {
        "nodes": 4,
        "gpus_per_node": 8,
        "cpus_per_task": 32,
        "constraint": "h100&[r1|r2]",
    }
    with pytest.raises(PlacementError, match="cannot exclude"):
        to_slurm(PlacementSpec(node_labels={"gpu": "!a100"}))


def test_placement_imports_neither_prefect_nor_ray_until_needed():
    import subprocess

    code = (
        "import sys, prefect_nemo.placement as p; print('prefect' in sys.modules, "
        "'ray' in sys.modules); p.sweep; print('prefect' in sys.modules, 'ray' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False", "False", "True"]
