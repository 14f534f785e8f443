"""One way to say "where": a backend-neutral placement spec and its pure translators.

`PlacementSpec` says how many nodes, how many GPUs/CPUs on each, packed on one node or spread
one per node, which node labels to require, and whether to stay off the Ray head. Each backend
translates it with a pure function here (no cluster calls), so the translations are tested once.
Label selectors use Ray's syntax everywhere: 'v', '!v', 'in(a,b)', '!in(a,b)'.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from prefect_nemo.placement.errors import PlacementError
from prefect_nemo.placement.plan import NODE_ID_LABEL

_SELECTOR = re.compile(r"^!?(in\([^(),]+(,[^(),]+)*\)|[^!(),][^(),]*)$")
_LABEL_KEY = re.compile(r"^([a-zA-Z0-9.-]+/)?[a-zA-Z0-9]([a-zA-Z0-9._-]*[a-zA-Z0-9])?$")


class PlacementSpec(BaseModel):
    """Where a piece of work runs: nodes x (GPUs, CPUs), pack or spread, label constraints."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    nodes: int = Field(1, ge=1, description="How many nodes the work spans (one bundle/pod each).")
    gpus_per_node: int = Field(0, ge=0, description="GPUs on each node.")
    cpus_per_node: float = Field(
        1.0, ge=0, allow_inf_nan=False, description="CPU cores on each node."
    )
    strategy: Literal["pack", "spread"] = Field(
        "pack", description="'pack': everything on one node; 'spread': one share per node."
    )
    node_labels: dict[str, str] = Field(
        default_factory=dict,
        description="Node label constraints, Ray syntax: {'pool': 'a'}, {'zone': 'in(a,b)'}, "
        "{'role': '!head'}.",
    )
    exclude_head: bool = Field(False, description="Keep the work off the Ray head node.")

    @field_validator("node_labels")
    @classmethod
    def _labels(cls, value: dict[str, str]) -> dict[str, str]:
        for key, selector in value.items():
            if not _LABEL_KEY.match(key):
                raise ValueError(
                    f"label key {key!r} is not a valid label name: use [prefix/]name with "
                    "letters, digits, '-', '_', '.'"
                )
            if not _SELECTOR.match(selector.strip()):
                raise ValueError(
                    f"{key}={selector!r}: write a selector as 'v', '!v', 'in(a,b)' or '!in(a,b)'"
                )
        return {k: v.strip() for k, v in value.items()}

    @model_validator(mode="after")
    def _shape(self) -> PlacementSpec:
        if self.strategy == "pack" and self.nodes > 1:
            raise ValueError(
                f"strategy='pack' puts everything on one node but nodes={self.nodes}: use "
                "strategy='spread' (one share per node) or nodes=1"
            )
        if self.exclude_head and NODE_ID_LABEL in self.node_labels:
            raise ValueError(
                f"exclude_head=True and node_labels[{NODE_ID_LABEL!r}] both constrain the node "
                "id: drop one (exclude the head through a worker label instead)"
            )
        return self

    @property
    def total_gpus(self) -> int:
        """GPUs over all nodes."""
        return self.nodes * self.gpus_per_node


def _parse(selector: str) -> tuple[bool, list[str]]:
    """('!in(a,b)') -> (negated, values)."""
    negate = selector.startswith("!")
    body = selector[1:] if negate else selector
    if body.startswith("in(") and body.endswith(")"):
        return negate, [v.strip() for v in body[3:-1].split(",")]
    return negate, [body]


def _ray_selector(spec: PlacementSpec, head_node_id: str | None) -> dict[str, str]:
    selector = dict(spec.node_labels)
    if spec.exclude_head:
        if not head_node_id:
            raise PlacementError(
                "exclude_head=True: Ray has no head label, so pass head_node_id "
                "(Topology.from_ray().head.node_id) or put a worker label in node_labels"
            )
        selector[NODE_ID_LABEL] = f"!{head_node_id}"
    return selector


def to_ray_bundles(
    spec: PlacementSpec, *, head_node_id: str | None = None
) -> tuple[list[dict[str, float]], str, list[dict[str, str]] | None]:
    """Placement-group arguments: (bundles, strategy, bundle_label_selector or None)."""
    bundle: dict[str, float] = {}
    if spec.cpus_per_node:
        bundle["CPU"] = float(spec.cpus_per_node)
    if spec.gpus_per_node:
        bundle["GPU"] = float(spec.gpus_per_node)
    if not bundle:
        raise PlacementError(
            "gpus_per_node=0 and cpus_per_node=0: a Ray bundle must reserve something; set "
            "cpus_per_node > 0"
        )
    strategy = "STRICT_PACK" if spec.strategy == "pack" else "STRICT_SPREAD"
    selector = _ray_selector(spec, head_node_id)
    selectors = [dict(selector) for _ in range(spec.nodes)] if selector else None
    return [dict(bundle) for _ in range(spec.nodes)], strategy, selectors


def to_ray_entrypoint(
    spec: PlacementSpec, *, head_node_id: str | None = None
) -> tuple[dict[str, float], dict[str, str]]:
    """Ray Jobs submit arguments: ({'entrypoint_num_cpus', 'entrypoint_num_gpus'}, label selector).

    A job's entrypoint is one process on one node, so the spec must be single-node.
    """
    if spec.nodes != 1:
        raise PlacementError(
            f"nodes={spec.nodes}: a Ray job entrypoint runs on one node; use nodes=1 and let the "
            "job's own Ray tasks spread (or use to_ray_bundles for a placement group)"
        )
    resources: dict[str, float] = {}
    if spec.cpus_per_node:
        resources["entrypoint_num_cpus"] = float(spec.cpus_per_node)
    if spec.gpus_per_node:
        resources["entrypoint_num_gpus"] = float(spec.gpus_per_node)
    return resources, _ray_selector(spec, head_node_id)


def to_kubernetes(spec: PlacementSpec, *, group: str | None = None) -> dict[str, Any]:
    """Pod scheduling fields: {'nodeSelector', 'affinity', 'resources'} for each of `nodes` pods.

    Equality labels go to nodeSelector, the rest to required node affinity. 'spread' adds a
    required podAntiAffinity on hostname against pods labelled `prefect-nemo/placement-group:
    <group>` (put that label on the pods). exclude_head has no meaning outside Ray: ignored.
    """
    node_selector: dict[str, str] = {}
    expressions: list[dict[str, Any]] = []
    for key, selector in spec.node_labels.items():
        negate, values = _parse(selector)
        if not negate and len(values) == 1:
            node_selector[key] = values[0]
        else:
            expressions.append(
                {"key": key, "operator": "NotIn" if negate else "In", "values": values}
            )
    affinity: dict[str, Any] = {}
    if expressions:
        affinity["nodeAffinity"] = {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": expressions}]
            }
        }
    if spec.strategy == "spread" and spec.nodes > 1:
        if not group:
            raise PlacementError(
                "strategy='spread' on Kubernetes needs group=<name>: the pods' shared label "
                "value that podAntiAffinity keeps on different nodes"
            )
        affinity["podAntiAffinity"] = {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {
                    "labelSelector": {"matchLabels": {"prefect-nemo/placement-group": group}},
                    "topologyKey": "kubernetes.io/hostname",
                }
            ]
        }
    quantities: dict[str, str] = {}
    if spec.cpus_per_node:
        quantities["cpu"] = f"{spec.cpus_per_node:g}"
    if spec.gpus_per_node:
        quantities["nvidia.com/gpu"] = str(spec.gpus_per_node)
    return {
        "nodeSelector": node_selector,
        "affinity": affinity,
        "resources": {"requests": dict(quantities), "limits": dict(quantities)},
    }


def to_slurm(spec: PlacementSpec) -> dict[str, Any]:
    """Slurm allocation: {'nodes', 'gpus_per_node', 'cpus_per_task', 'constraint'?}.

    Slurm features are bare names: an equality label maps to the feature named by its value and
    in(a,b) to 'a|b'; Slurm constraints cannot negate, so '!v' is refused. No head on Slurm.
    """
    out: dict[str, Any] = {"nodes": spec.nodes, "gpus_per_node": spec.gpus_per_node}
    if spec.cpus_per_node:
        out["cpus_per_task"] = max(1, round(spec.cpus_per_node))
    features = []
    for key, selector in spec.node_labels.items():
        negate, values = _parse(selector)
        if negate:
            raise PlacementError(
                f"node_labels[{key!r}]={selector!r}: Slurm constraints cannot exclude a feature; "
                "use a positive selector or a partition without those nodes"
            )
        features.append(values[0] if len(values) == 1 else "[" + "|".join(values) + "]")
    if features:
        out["constraint"] = "&".join(features)
    return out
