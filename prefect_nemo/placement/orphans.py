"""The orphan sweep: remove leftover placement groups by name prefix (in every namespace) and
kill leftover process groups recorded by ManagedProcess actors.

Removing a group kills its actors, whose reapers then kill their children; the sweep also kills
the recorded process groups itself (on their node, through a pinned Ray task), in case a reaper
died too. Only processes carrying the PREFECT_NEMO_PLACEMENT marker of the record are killed.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import placement_group_table
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from prefect_nemo.placement.groups import NAME_PREFIX, NAMESPACE, remove_group
from prefect_nemo.placement.process import KV_PROC_PREFIX, kill_marked, proc_stat

KV_OWNER_PREFIX = "owner:"


@dataclass
class SweepReport:
    """What a sweep removed."""

    groups: list[str] = field(default_factory=list)
    actors: list[str] = field(default_factory=list)
    processes: list[int] = field(default_factory=list)


def record_owner(group_name: str) -> None:
    """Remember which process created a group, so `only_orphans` sweeps can spare live owners."""
    from ray.experimental.internal_kv import _internal_kv_put

    owner = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": (proc_stat(os.getpid()) or ("", ""))[1],
    }
    _internal_kv_put(KV_OWNER_PREFIX + group_name, json.dumps(owner), namespace=NAMESPACE)


def forget_owner(group_name: str) -> None:
    """Drop a group's owner record (after a clean teardown)."""
    from ray.experimental.internal_kv import _internal_kv_del

    try:
        _internal_kv_del(KV_OWNER_PREFIX + group_name, namespace=NAMESPACE)
    except Exception:
        pass


def _owner_alive(group_name: str) -> bool | None:
    """True/False when the owner ran on this host; None when unknown (other host, no record)."""
    from ray.experimental.internal_kv import _internal_kv_get

    raw = _internal_kv_get(KV_OWNER_PREFIX + group_name, namespace=NAMESPACE)
    if not raw:
        return None
    owner = json.loads(raw)
    if owner.get("host") != socket.gethostname():
        return None
    stat = proc_stat(int(owner["pid"]))
    return stat is not None and stat[0] != "Z" and stat[1] == owner.get("started")


def sweep(prefix: str = NAME_PREFIX, *, only_orphans: bool = False) -> SweepReport:
    """Remove every placement group whose name starts with `prefix` (any namespace), kill the
    process groups recorded under that prefix, and drop their records.

    With only_orphans=True, groups whose creating process is still alive on this host (or whose
    owner is unknown) are left alone.
    """
    from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_get, _internal_kv_list

    report = SweepReport()
    spared: set[str] = set()
    for info in placement_group_table().values():
        name = info.get("name") or ""
        if not name.startswith(prefix) or info.get("state") == "REMOVED":
            continue
        if only_orphans and _owner_alive(name) is not False:
            spared.add(name)
            continue
        if remove_group(name):
            report.groups.append(name)
        forget_owner(name)

    by_node: dict[str, list[dict[str, Any]]] = {}
    keys = _internal_kv_list(KV_PROC_PREFIX + prefix, namespace=NAMESPACE)
    for key in keys:
        name = key.decode()[len(KV_PROC_PREFIX) :]
        if any(name.startswith(g) for g in spared):
            continue
        raw = _internal_kv_get(key, namespace=NAMESPACE)
        if raw:
            rec = json.loads(raw)
            by_node.setdefault(rec["node_id"], []).append({**rec, "name": name})
        report.actors.append(name)
    alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    for node_id, records in by_node.items():
        if node_id in alive:  # on a dead node the processes died with it
            strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
            killed: list[int] = ray.get(
                kill_marked.options(scheduling_strategy=strategy).remote(records), timeout=60
            )
            report.processes += killed
        for rec in records:
            _internal_kv_del(KV_PROC_PREFIX + rec["name"], namespace=NAMESPACE)
    for name in report.actors:  # actors outside any group (or left by a failed start)
        try:
            ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
        except Exception:
            pass
    return report
