"""Replicated servers from a Prefect flow: `serve_replicas(...)` starts N replicas of a command on
Ray placement groups, waits until every health check answers, yields the endpoints, and tears
everything down when the block ends: on exit, failure, timeout, cancellation and crash.

How it reaches Ray: a process holds one Ray connection. If this process is already connected
(`ray.init` was called) that connection is used. Otherwise `ray_address` (a GCS address
'host:port', 'auto', or a `LocalRayCluster`) with `auth_token`, then $RAY_ADDRESS when it is not
an http URL, else the embedded default cluster of `prefect_nemo.local_ray` (its GCS address and
token). The token reaches Ray's driver through $RAY_AUTH_TOKEN. A `RayJobsCluster` block has
only the dashboard address, which cannot place actors: pass the cluster's GCS address.
The command runs on the cluster's nodes as given: paths in it must exist there. What runs on the
nodes (placement.process) ships to Ray's workers by value: the nodes need no prefect_nemo.

Teardown paths: the context manager's `finally` (the flow body raised, returned or got
Prefect's TerminationSignal on SIGTERM); `tasks.register_teardown`, as for every piece of remote
work a flow run starts (flow hooks on cancellation, crash and failure, plus the one cancel watch
for runs cancelled through the API with no runner to signal them); and, for a driver killed with
SIGKILL, the detached groups carry the flow run id in their names so `placement.sweep` finds
them (the servers' reapers already killed the processes if the actors died with their node;
detached actors wait for the sweep).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import ray
from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.context import FlowRunContext, TaskRunContext

from prefect_nemo.local_ray import LocalRayCluster
from prefect_nemo.placement import (
    NAME_PREFIX,
    NAMESPACE,
    BundleShape,
    PlacementError,
    PlacementSpec,
    PlacementTimeout,
    ReplicaFailed,
    Topology,
    check_capacity,
    connect,
    create_group,
    plan_replica_bundle_shape,
    remove_group,
    spawn_actor,
    stop_many,
    to_ray_bundles,
    wait_ready,
)
from prefect_nemo.placement.orphans import forget_owner, record_owner, sweep
from prefect_nemo.tasks import live_work, register_teardown

SERVE_PREFIX = NAME_PREFIX + "serve-"
EVENT_PREFIX = "prefect-nemo.serve"
STOP_TIMEOUT_S = 10.0


# ---------------------------------------------------------------------------------------------
# What a started set of replicas is


@dataclass
class Replica:
    """One replica: its placement group, its actors (rank 0 first), where it runs, its endpoint."""

    index: int
    group: str
    actors: list[str]
    node_ids: list[str]
    node_ips: list[str]
    gpu_ids: list[list[str]]
    pids: list[int]
    actor_pids: list[int]
    port: int
    endpoint: str
    health_url: str


@dataclass
class ReplicaSet:
    """Replicas started together; `endpoints` is what clients call."""

    name: str
    flow_run_id: str | None
    replicas: list[Replica] = field(default_factory=list)
    groups: list[str] = field(default_factory=list)
    ranks: int = 1
    stopped: threading.Event = field(default_factory=threading.Event, repr=False, compare=False)
    torn_down: threading.Event = field(default_factory=threading.Event, repr=False, compare=False)

    @property
    def endpoints(self) -> list[str]:
        """Base URLs (http://ip:port) of the replicas, in replica order."""
        return [r.endpoint for r in self.replicas]

    def __getstate__(self) -> dict[str, Any]:  # Events do not pickle: results may be persisted
        state = dict(self.__dict__)
        for flag in ("stopped", "torn_down"):
            state[flag] = getattr(self, flag).is_set()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        for flag in ("stopped", "torn_down"):
            event = threading.Event()
            if state.pop(flag, False):
                event.set()
            state[flag] = event
        self.__dict__.update(state)


# ---------------------------------------------------------------------------------------------
# Connecting


def connect_ray(
    ray_address: str | LocalRayCluster | None = None, *, auth_token: str | None = None
) -> None:
    """Connect this process to Ray as described in the module docstring (no-op if connected)."""
    if ray.is_initialized():
        return
    if isinstance(ray_address, LocalRayCluster):
        auth_token = auth_token or ray_address.token
        ray_address = ray_address.gcs_address or "auto"
    env_address = os.environ.get("RAY_ADDRESS", "")
    if not ray_address and env_address and not env_address.startswith(("http://", "https://")):
        ray_address = env_address
    if not ray_address:
        from prefect_nemo import local_ray

        local = local_ray.default_local_cluster()
        ray_address = local.gcs_address or "auto"
        auth_token = auth_token or local.token
    connect(ray_address, auth_token=auth_token)


# ---------------------------------------------------------------------------------------------
# Start and stop (plain functions; the tasks and the context manager wrap them)


def _logger() -> Any:
    try:
        from prefect import get_run_logger

        return get_run_logger()
    except Exception:
        return logging.getLogger("prefect_nemo")


def _flow_run_id() -> str | None:
    flow_ctx = FlowRunContext.get()
    if flow_ctx and flow_ctx.flow_run:
        return str(flow_ctx.flow_run.id)
    task_ctx = TaskRunContext.get()
    if task_ctx and task_ctx.task_run.flow_run_id:
        return str(task_ctx.task_run.flow_run_id)
    return None


def _fill(template: str, values: Mapping[str, object]) -> str:
    # Only our placeholders: a shell's ${VAR} or a JSON brace stays as written.
    for key, value in values.items():
        template = template.replace("{" + key + "}", str(value))
    return template


def start(
    command: str | Sequence[str],
    *,
    replicas: int = 1,
    tp_size: int = 1,
    cpus_per_replica: float = 1.0,
    health_path: str = "/health",
    health_url: str | None = None,
    readiness_timeout_s: float = 300.0,
    placement_timeout_s: float = 180.0,
    exclude_head: bool = False,
    node_labels: Mapping[str, str] | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    name: str = "replicas",
    ray_address: str | LocalRayCluster | None = None,
    auth_token: str | None = None,
    stop_timeout_s: float = STOP_TIMEOUT_S,
    sweep_orphans: bool = True,
) -> ReplicaSet:
    """Start `replicas` replicas and return once every health check answers 2xx.

    Anything that goes wrong (capacity, placement timeout, a replica exiting, readiness timeout,
    cancellation) tears down what was started before raising. See `serve_replicas`.
    """
    if replicas < 1:
        raise PlacementError(f"replicas={replicas}: pass replicas >= 1")
    if tp_size < 0:
        raise PlacementError(f"tp_size={tp_size}: pass tp_size >= 1 (GPUs), or 0 for CPU only")
    if tp_size == 0 and cpus_per_replica <= 0:
        raise PlacementError("tp_size=0 and cpus_per_replica=0: a replica must reserve something")
    logger = _logger()
    t0 = time.monotonic()
    connect_ray(ray_address, auth_token=auth_token)
    if sweep_orphans:
        _sweep_orphans(logger)
    topology = Topology.from_ray()
    eligible = topology.eligible(exclude_head=exclude_head, labels=node_labels)
    shape = plan_replica_bundle_shape(tp_size, eligible) if tp_size > 0 else None
    nodes = shape.nodes if shape else 1
    check_capacity(shape, replicas, eligible, cpus_per_bundle=cpus_per_replica / nodes)
    bundles, strategy, selectors = _bundles(
        shape, cpus_per_replica, exclude_head, node_labels, topology
    )

    flow_run_id = _flow_run_id()
    tag = (flow_run_id or "none").replace("-", "")[:12] + "-" + uuid.uuid4().hex[:6]
    rs = ReplicaSet(name=f"{SERVE_PREFIX}{_slug(name)}-{tag}", flow_run_id=flow_run_id, ranks=nodes)
    # torn down with the flow run if it is cancelled or crashes before our own `finally`
    register_teardown(_teardown_key(rs), partial(_teardown_quietly, rs, stop_timeout_s))
    try:
        pgs = []
        for i in range(replicas):
            group = f"{rs.name}-{i}"
            pgs.append(create_group(group, bundles, strategy, selectors))
            rs.groups.append(group)
            record_owner(group)
        t_pg = time.monotonic()
        wait_ready(pgs, placement_timeout_s)
        logger.info(
            f"{rs.name}: {replicas} placement group(s) ready in {time.monotonic() - t_pg:.1f}s"
        )
        actors = [
            [
                spawn_actor(
                    f"{rs.groups[i]}-b{b}",
                    pg,
                    b,
                    gpus=shape.gpus_per_node if shape else 0,
                    cpus=bundles[b].get("CPU", 0),
                )
                for b in range(nodes)
            ]
            for i, pg in enumerate(pgs)
        ]
        rs.replicas = _launch(rs, actors, command, env, cwd, health_path, health_url)
        _wait_healthy(rs, actors, readiness_timeout_s)
    except BaseException as exc:
        logger.error(f"{rs.name}: start failed ({type(exc).__name__}): tearing down")
        teardown(rs, stop_timeout_s=stop_timeout_s)
        _emit(rs, "failed", {"error": str(exc)[:500]})
        raise
    elapsed = time.monotonic() - t0
    logger.info(f"{rs.name}: {replicas} replica(s) healthy in {elapsed:.1f}s: {rs.endpoints}")
    _artifact(rs, shape)
    _emit(rs, "ready", {"endpoints": rs.endpoints, "startup_s": round(elapsed, 3)})
    return rs


def _sweep_orphans(logger: Any) -> None:
    """Remove what drivers on this host that died (SIGKILL, OOM) left behind: their groups are
    detached, so nothing else would. Groups of live or unknown owners are left alone."""
    try:
        report = sweep(SERVE_PREFIX, only_orphans=True)
    except Exception as exc:
        logger.debug(f"orphan sweep failed: {exc}")
        return
    if report.groups:
        logger.warning(f"removed {len(report.groups)} orphaned group(s): {report.groups}")


def _slug(name: str) -> str:
    out = "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")
    return out[:30] or "replicas"


def _bundles(
    shape: BundleShape | None,
    cpus_per_replica: float,
    exclude_head: bool,
    node_labels: Mapping[str, str] | None,
    topology: Topology,
) -> tuple[list[dict[str, float]], str, list[dict[str, str]] | None]:
    """One replica's placement group arguments, through the one PlacementSpec translator."""
    nodes = shape.nodes if shape else 1
    head = topology.head
    spec = PlacementSpec(
        nodes=nodes,
        gpus_per_node=shape.gpus_per_node if shape else 0,
        cpus_per_node=cpus_per_replica / nodes,
        strategy="spread" if nodes > 1 else "pack",
        node_labels=dict(node_labels or {}),
        exclude_head=exclude_head and head is not None,
    )
    return to_ray_bundles(spec, head_node_id=head.node_id if head else None)


def _launch(
    rs: ReplicaSet,
    actors: list[list[Any]],
    command: str | Sequence[str],
    env: Mapping[str, str] | None,
    cwd: str | None,
    health_path: str,
    health_url: str | None,
) -> list[Replica]:
    """Pick ports on each node, then spawn every rank of every replica (all at once: one
    round trip to every actor for where it runs, one to start; no call waits on another)."""
    nodes = ray.get([a.node.remote() for ranks in actors for a in ranks])
    started = []
    k = 0
    for i, ranks in enumerate(actors):
        infos = nodes[k : k + len(ranks)]
        rank_ports = [n["free_port"] for n in infos]
        k += len(ranks)
        master_ip, port = infos[0]["ip"], rank_ports[0]
        refs = []
        for rank, actor in enumerate(ranks):
            values = {
                "port": rank_ports[rank],
                "host": infos[rank]["ip"],
                "replica": i,
                "rank": rank,
                "nnodes": len(ranks),
                "master_addr": master_ip,
                "master_port": port,
            }
            argv = (
                _fill(command, values)
                if isinstance(command, str)
                else [_fill(c, values) for c in command]
            )
            child_env = {
                **(env or {}),
                "PORT": str(values["port"]),
                "HOST": str(values["host"]),
                "REPLICA_INDEX": str(i),
                "NODE_RANK": str(rank),
                "NNODES": str(len(ranks)),
                "MASTER_ADDR": master_ip,
                "MASTER_PORT": str(port),
            }
            refs.append(actor.start.remote(argv, env=child_env, cwd=cwd))
        started.append((i, ranks, infos, port, refs))
    replicas = []
    for i, _ranks, infos, port, refs in started:
        records = ray.get(refs)
        endpoint = f"http://{infos[0]['ip']}:{port}"
        url = (
            _fill(health_url, {"host": infos[0]["ip"], "port": port})
            if health_url
            else endpoint + health_path
        )
        replicas.append(
            Replica(
                index=i,
                group=rs.groups[i],
                actors=[f"{rs.groups[i]}-b{b}" for b in range(len(infos))],
                node_ids=[n["node_id"] for n in infos],
                node_ips=[n["ip"] for n in infos],
                gpu_ids=[n["gpu_ids"] for n in infos],
                pids=[r["pid"] for r in records],
                actor_pids=[r["actor_pid"] for r in records],
                port=port,
                endpoint=endpoint,
                health_url=url,
            )
        )
    return replicas


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return 200 <= resp.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


def poll_intervals(
    first_s: float = 0.02, factor: float = 1.5, most_s: float = 0.25
) -> Iterator[float]:
    """Back-off between health polls: servers that come up fast are seen fast, slow ones are
    not hammered (20 ms, growing by half each time, at most 250 ms)."""
    interval = first_s
    while True:
        yield interval
        interval = min(most_s, interval * factor)


def _wait_healthy(rs: ReplicaSet, actors: list[list[Any]], timeout_s: float) -> None:
    """Poll every replica's health URL; fail at once if a replica's process exits."""
    deadline = time.monotonic() + timeout_s
    waiting = {r.index: r for r in rs.replicas}
    next_liveness = time.monotonic() + 1.0
    intervals = poll_intervals()
    with ThreadPoolExecutor(max_workers=min(16, len(waiting))) as pool:
        while waiting:
            ok = list(pool.map(_healthy, [r.health_url for r in waiting.values()]))
            for index, healthy in zip(list(waiting), ok, strict=True):
                if healthy:
                    waiting.pop(index)
            if not waiting:
                return
            if time.monotonic() >= next_liveness:
                next_liveness = time.monotonic() + 1.0
                _check_alive(rs, {i: actors[i] for i in waiting})
            if time.monotonic() >= deadline:
                urls = ", ".join(r.health_url for r in waiting.values())
                raise PlacementTimeout(
                    f"{len(waiting)} replica(s) not healthy after {timeout_s:g}s ({urls}): raise "
                    "readiness_timeout_s or check the health path and the server's log"
                )
            time.sleep(next(intervals))


def _check_alive(rs: ReplicaSet, actors: Mapping[int, list[Any]]) -> None:
    """Raise ReplicaFailed, with its log tail, for the first replica whose process exited (one
    round trip to all actors at once)."""
    pairs = [(index, actor) for index, ranks in actors.items() for actor in ranks]
    alive = ray.get([actor.is_alive.remote() for _, actor in pairs], timeout=30)
    for (index, actor), up in zip(pairs, alive, strict=True):
        if not up:
            tail = ray.get(actor.read_log_tail.remote(), timeout=30)
            raise ReplicaFailed(
                f"replica {index} ({rs.replicas[index].endpoint}) exited before it was healthy; "
                f"last log lines:\n{tail}"
            )


_teardown_lock = threading.Lock()


def teardown(rs: ReplicaSet, *, stop_timeout_s: float = STOP_TIMEOUT_S) -> list[dict | None]:
    """Stop every replica's processes (SIGTERM, bounded wait, SIGKILL), kill the actors and
    remove the placement groups. Safe to call twice and on a half-started set; a second caller
    (the cancel watch racing the `with` block's exit) returns once the first one has finished."""
    with _teardown_lock:
        first = not rs.stopped.is_set()
        rs.stopped.set()
    if not first:
        rs.torn_down.wait(stop_timeout_s + 60)
        return []
    try:
        return _teardown(rs, stop_timeout_s)
    finally:
        rs.torn_down.set()


def _teardown(rs: ReplicaSet, stop_timeout_s: float) -> list[dict | None]:
    live_work.discard(rs.flow_run_id, _teardown_key(rs))
    actors = []
    for group in rs.groups:
        for b in range(rs.ranks):
            with contextlib.suppress(ValueError):  # never created, or already gone
                actors.append(ray.get_actor(f"{group}-b{b}", namespace=NAMESPACE))
    reports = stop_many(actors, timeout_s=stop_timeout_s) if actors else []
    for group in rs.groups:
        remove_group(group)
        forget_owner(group)
    _emit(rs, "stopped", {"reports": reports})
    return reports


def _teardown_key(rs: ReplicaSet) -> str:
    return f"replicas {rs.name}"


def _teardown_quietly(rs: ReplicaSet, stop_timeout_s: float) -> str:
    try:
        teardown(rs, stop_timeout_s=stop_timeout_s)
    except Exception as exc:
        return f"teardown failed: {exc}"
    return "stopped"


# ---------------------------------------------------------------------------------------------
# Reporting


def _artifact(rs: ReplicaSet, shape: BundleShape | None) -> None:
    if rs.flow_run_id is None:
        return
    from prefect.artifacts import create_table_artifact

    rows = [
        {
            "replica": r.index,
            "endpoint": r.endpoint,
            "nodes": ", ".join(r.node_ips),
            "node_ids": ", ".join(n[:12] for n in r.node_ids),
            "gpus": "; ".join(",".join(g) or "-" for g in r.gpu_ids),
            "placement": shape.strategy if shape else "CPU",
            "group": r.group,
            "pids": ", ".join(map(str, r.pids)),
        }
        for r in rs.replicas
    ]
    with contextlib.suppress(Exception):  # reporting must never break serving
        create_table_artifact(rows, description=f"Replicas of {rs.name} (prefect-nemo)")


def _emit(rs: ReplicaSet, what: str, payload: dict[str, Any]) -> None:
    if rs.flow_run_id is None:  # outside a run there may be no API (and no one listening)
        return
    from prefect.events import emit_event

    with contextlib.suppress(Exception):
        emit_event(
            event=f"{EVENT_PREFIX}.{what}",
            resource={
                "prefect.resource.id": f"{EVENT_PREFIX}.{rs.name}",
                "prefect.resource.name": rs.name,
            },
            payload={"name": rs.name, "replicas": len(rs.groups), **payload},
        )


# ---------------------------------------------------------------------------------------------
# The public faces


@contextmanager
def serve_replicas(
    command: str | Sequence[str],
    *,
    replicas: int = 1,
    tp_size: int = 1,
    cpus_per_replica: float = 1.0,
    health_path: str = "/health",
    health_url: str | None = None,
    readiness_timeout_s: float = 300.0,
    placement_timeout_s: float = 180.0,
    exclude_head: bool = False,
    node_labels: Mapping[str, str] | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    name: str = "replicas",
    ray_address: str | LocalRayCluster | None = None,
    auth_token: str | None = None,
    stop_timeout_s: float = STOP_TIMEOUT_S,
    sweep_orphans: bool = True,
) -> Iterator[ReplicaSet]:
    """Run `replicas` copies of `command` on Ray for the duration of a `with` block.

    Each replica gets `tp_size` GPUs (one STRICT_PACK bundle if they fit on a node, else an equal
    STRICT_SPREAD split; tp_size=0 for CPU-only replicas) and its own port: the command sees it
    as `{port}` (and `{host}`, `{replica}`, `{rank}`, `{nnodes}`, `{master_addr}`,
    `{master_port}`) and as $PORT. Yields a ReplicaSet once every `health_path` (or `health_url`
    template) answers 2xx; tears everything down when the block ends, however it ends. With
    sweep_orphans, first removes replica groups whose creating process on this host is dead.
    """
    rs = start(
        command,
        replicas=replicas,
        tp_size=tp_size,
        cpus_per_replica=cpus_per_replica,
        health_path=health_path,
        health_url=health_url,
        readiness_timeout_s=readiness_timeout_s,
        placement_timeout_s=placement_timeout_s,
        exclude_head=exclude_head,
        node_labels=node_labels,
        env=env,
        cwd=cwd,
        name=name,
        ray_address=ray_address,
        auth_token=auth_token,
        stop_timeout_s=stop_timeout_s,
        sweep_orphans=sweep_orphans,
    )
    try:
        yield rs
    finally:
        teardown(rs, stop_timeout_s=stop_timeout_s)
        _logger().info(f"{rs.name}: stopped")


@task(name="start_replicas", cache_policy=NO_CACHE)
def start_replicas(command: str | list[str], **options: Any) -> ReplicaSet:
    """Task: start replicas (see serve_replicas for the options); pair it with stop_replicas.

    The flow's cancellation/crash hooks and the cancel watch stop them if the flow never does.
    """
    return start(command, **options)


@task(name="stop_replicas", cache_policy=NO_CACHE)
def stop_replicas(
    replica_set: ReplicaSet,
    stop_timeout_s: float = STOP_TIMEOUT_S,
    *,
    ray_address: str | LocalRayCluster | None = None,
    auth_token: str | None = None,
) -> list:
    """Task: stop replicas started by start_replicas, from any process that reaches the cluster
    (actors and groups are found by name); returns each process's stop report."""
    connect_ray(ray_address, auth_token=auth_token)
    replica_set.stopped.clear()  # a copy from another task: its own flags say nothing
    replica_set.torn_down.clear()
    return teardown(replica_set, stop_timeout_s=stop_timeout_s)
