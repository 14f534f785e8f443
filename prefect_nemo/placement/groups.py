"""Detached, named placement groups in one stable namespace: create, wait, resolve, remove.

Detached so that a group outlives the process that made it only on purpose: a start task and a
stop task may run in different processes, and a crashed driver leaves a group the orphan sweep
can find by name.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import ray
from ray._raylet import PlacementGroupID
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)

from prefect_nemo.placement.errors import InsufficientCapacity, PlacementTimeout

NAMESPACE = "prefect-nemo"
NAME_PREFIX = "prefect-nemo-"
READY_TIMEOUT_S = 180.0


def connect(address: str | None = None, *, auth_token: str | None = None) -> None:
    """Connect this process to a Ray cluster (no-op if already connected).

    `address` is a GCS address (host:port) or 'auto'; the token (Ray >= 2.59 has token auth on)
    goes through $RAY_AUTH_TOKEN, the only way Ray's driver reads it, so one process talks to
    one token-protected cluster.
    """
    if ray.is_initialized():
        return
    if auth_token:
        os.environ["RAY_AUTH_TOKEN"] = auth_token
        os.environ["RAY_AUTH_MODE"] = "token"
        _reload_auth_config()
    ray.init(
        address=address or "auto",
        namespace=NAMESPACE,
        logging_level=logging.WARNING,
        log_to_driver=False,
    )


def _reload_auth_config() -> None:
    # Ray reads RAY_AUTH_MODE into its config when it is imported and caches the token: refresh
    # both, as Ray's own token setup does (private API, so tolerate its absence).
    try:
        # not in Ray's stubs of _raylet
        from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
    except Exception:
        pass


def create_group(
    name: str,
    bundles: Sequence[dict[str, float]],
    strategy: str,
    bundle_label_selector: Sequence[dict[str, str]] | None = None,
) -> PlacementGroup:
    """Ask for a detached, named group (returns at once; wait with `wait_ready`)."""
    kwargs: dict[str, Any] = {}
    if bundle_label_selector:
        kwargs["bundle_label_selector"] = [dict(s) for s in bundle_label_selector]
    group: PlacementGroup = placement_group(
        [dict(b) for b in bundles], strategy=strategy, name=name, lifetime="detached", **kwargs
    )
    return group


def group_info(pg: PlacementGroup) -> dict[str, Any]:
    """Ray's table entry of the group (state, bundles, bundles_to_node_id, stats)."""
    table: dict[str, Any] = placement_group_table(pg)
    return table


def wait_ready(groups: Sequence[PlacementGroup], timeout_s: float = READY_TIMEOUT_S) -> None:
    """Wait until every group is placed; fail early on one Ray reports INFEASIBLE.

    A group that cannot fit stays PENDING forever, so waiting out the timeout would only hide
    the cause: the error says what cannot fit and what the cluster has.
    """
    deadline = time.monotonic() + timeout_s
    refs = {pg.ready(): pg for pg in groups}  # each ready() call schedules a probe: once
    while refs:
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0.5)
        for ref in ready:
            refs.pop(ref)
        pending = list(refs.values())
        for pg in pending:
            info = group_info(pg)
            if info.get("stats", {}).get("scheduling_state") == "INFEASIBLE":
                raise InsufficientCapacity(
                    f"placement group {info.get('name')!r} ({info.get('strategy')}, bundles "
                    f"{list(info.get('bundles', {}).values())}) is INFEASIBLE: no set of alive "
                    f"nodes can hold it ({_cluster_summary()}); lower the request or add nodes"
                )
        if pending and time.monotonic() > deadline:
            names = ", ".join(repr(group_info(pg).get("name")) for pg in pending)
            raise PlacementTimeout(
                f"placement group(s) {names} not ready after {timeout_s:g}s: other work holds "
                f"the resources ({_cluster_summary(available=True)}); raise the timeout or free "
                "them"
            )


def _cluster_summary(available: bool = False) -> str:
    try:
        res = ray.available_resources() if available else ray.cluster_resources()
    except Exception:
        return "cluster resources unknown"
    what = "available" if available else "total"
    return f"{what}: {res.get('GPU', 0):g} GPU, {res.get('CPU', 0):g} CPU"


def remove_group(pg: PlacementGroup | str) -> bool:
    """Remove a group (kills the actors in it), by object or by name in any namespace.

    False if there was no such group.
    """
    if isinstance(pg, str):
        found = find_group(pg)
        if found is None:
            return False
        pg = found
    try:
        remove_placement_group(pg)
    except Exception:
        return False
    return True


def find_group(name: str) -> PlacementGroup | None:
    """The live group of that name in any namespace (names are namespace-scoped in Ray)."""
    for pg_id, info in placement_group_table().items():
        if info.get("name") == name and info.get("state") != "REMOVED":
            return PlacementGroup(PlacementGroupID(bytes.fromhex(pg_id)))
    return None


def bundle_node(pg: PlacementGroup, index: int) -> tuple[str, str]:
    """(node id, node IP) of a placed bundle."""
    node_id = group_info(pg)["bundles_to_node_id"][index]
    for node in ray.nodes():
        if node["NodeID"] == node_id:
            return node_id, node["NodeManagerAddress"]
    raise PlacementTimeout(f"bundle {index} of the group is on node {node_id}, which is gone")
