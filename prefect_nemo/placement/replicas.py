"""Replica sets on Ray: N copies of a server command, each on its own placement group, started,
health-checked and torn down together. A plain library (no Prefect): `tasks/replicas.py` is
the Prefect side (the context manager, the tasks, teardown with the flow run, reporting).

Each replica gets a detached placement group: one STRICT_PACK bundle when its GPUs fit on a
node, else an equal STRICT_SPREAD split (`plan_replica_bundle_shape`). In each bundle a managed
subprocess actor (`process.py`) runs the command in its own process group. Group names carry
the owner's flow run id, so `sweep` finds what a driver killed with SIGKILL left behind.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from typing import Any

import ray

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
    create_group,
    plan_replica_bundle_shape,
    remove_group,
    spawn_actor,
    stop_many,
    to_ray_bundles,
    wait_ready,
)
from prefect_nemo.placement.orphans import forget_owner, record_owner, sweep

log = logging.getLogger(__name__)

SERVE_PREFIX = NAME_PREFIX + "serve-"
STOP_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ReplicaOptions:
    """How replicas of a command run: every option of `serve_replicas` and `start_replicas`."""

    replicas: int = 1
    """How many copies of the command to run."""
    tp_size: int = 1
    """GPUs per replica (one STRICT_PACK bundle if they fit a node, else split evenly across
    nodes); 0 for CPU-only replicas."""
    cpus_per_replica: float = 1.0
    """CPUs each replica reserves (split across its nodes)."""
    health_path: str = "/health"
    """Path polled on each replica's endpoint until it answers 2xx."""
    health_url: str | None = None
    """A health URL template ({host}, {port}) instead of endpoint + health_path."""
    readiness_timeout_s: float = 300.0
    """Seconds every replica may take to answer its health check."""
    placement_timeout_s: float = 180.0
    """Seconds the placement groups may take to be scheduled."""
    exclude_head: bool = False
    """Keep replicas off the Ray head node."""
    node_labels: Mapping[str, str] | None = None
    """Node labels the replicas must land on."""
    env: Mapping[str, str] | None = None
    """Extra environment of the command."""
    cwd: str | None = None
    """Working directory of the command on the nodes."""
    name: str = "replicas"
    """Readable part of the replica set's name."""
    ray_address: Any = None
    """The Ray cluster: a GCS address 'host:port', 'auto', a LocalRayCluster, or None for
    $RAY_ADDRESS / the embedded default."""
    auth_token: str | None = None
    """Ray's token, when ray_address needs one."""
    stop_timeout_s: float = STOP_TIMEOUT_S
    """Seconds between SIGTERM and SIGKILL when replicas stop."""
    sweep_orphans: bool = True
    """First remove replica groups whose creating process on this host is dead."""
    max_restarts: int = 2
    """How often a replica whose process dies after it was healthy is restarted (its health
    waited for again) before the replica set fails; 0: fail at the first death."""
    watch_interval_s: float = 2.0
    """Seconds between two checks that every healthy replica's process still runs."""

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise PlacementError(f"replicas={self.replicas}: pass replicas >= 1")
        if self.tp_size < 0:
            raise PlacementError(
                f"tp_size={self.tp_size}: pass tp_size >= 1 (GPUs), or 0 for CPU only"
            )
        if self.tp_size == 0 and self.cpus_per_replica <= 0:
            raise PlacementError(
                "tp_size=0 and cpus_per_replica=0: a replica must reserve something"
            )
        if self.max_restarts < 0:
            raise PlacementError(
                f"max_restarts={self.max_restarts}: pass 0 (fail at the first death) or more"
            )
        if self.watch_interval_s <= 0:
            raise PlacementError(f"watch_interval_s={self.watch_interval_s}: pass seconds > 0")

    @classmethod
    def of(cls, options: Mapping[str, Any]) -> ReplicaOptions:
        """Options from keyword arguments; an unknown one is named with the known ones."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise PlacementError(
                f"unknown replica option(s) {', '.join(unknown)}: use {', '.join(sorted(known))}"
            )
        return cls(**options)


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
    commands: list[str | list[str]] = field(default_factory=list, repr=False)
    envs: list[dict[str, str]] = field(default_factory=list, repr=False)
    restarts: int = 0


@dataclass
class ReplicaSet:
    """Replicas started together; `endpoints` is what clients call."""

    name: str
    flow_run_id: str | None
    replicas: list[Replica] = field(default_factory=list)
    groups: list[str] = field(default_factory=list)
    ranks: int = 1
    shape: BundleShape | None = None
    failure: ReplicaFailed | None = field(default=None, repr=False, compare=False)
    stopped: threading.Event = field(default_factory=threading.Event, repr=False, compare=False)
    torn_down: threading.Event = field(default_factory=threading.Event, repr=False, compare=False)

    @property
    def endpoints(self) -> list[str]:
        """Base URLs (http://ip:port) of the replicas, in replica order."""
        return [r.endpoint for r in self.replicas]

    def check(self) -> None:
        """Raise ReplicaFailed if a replica died for good since the set was healthy (its
        restarts used up): the pool is never silently smaller than asked."""
        if self.failure is not None:
            raise self.failure

    def __getstate__(self) -> dict[str, Any]:  # Events do not pickle: results may be persisted
        state = dict(self.__dict__)
        for flag in ("stopped", "torn_down"):
            state[flag] = getattr(self, flag).is_set()
        state.pop("_watch", None)  # the watch thread stays with the process that started it
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        for flag in ("stopped", "torn_down"):
            event = threading.Event()
            if state.pop(flag, False):
                event.set()
            state[flag] = event
        self.__dict__.update(state)


@dataclass(frozen=True)
class _Plan:
    shape: BundleShape | None
    nodes: int
    bundles: list[dict[str, float]]
    strategy: str
    selectors: list[dict[str, str]] | None


def sweep_orphans() -> list[str]:
    """Remove what drivers on this host that died (SIGKILL, OOM) left behind: their groups are
    detached, so nothing else would. Groups of live or unknown owners are left alone."""
    try:
        report = sweep(SERVE_PREFIX, only_orphans=True)
    except Exception as exc:
        log.debug("orphan sweep failed: %s", exc)
        return []
    return report.groups


def plan(options: ReplicaOptions) -> _Plan:
    """Where each replica goes on the connected cluster; refuses what cannot fit, before
    anything is reserved."""
    topology = Topology.from_ray()
    eligible = topology.eligible(exclude_head=options.exclude_head, labels=options.node_labels)
    shape = plan_replica_bundle_shape(options.tp_size, eligible) if options.tp_size > 0 else None
    nodes = shape.nodes if shape else 1
    check_capacity(
        shape, options.replicas, eligible, cpus_per_bundle=options.cpus_per_replica / nodes
    )
    head = topology.head
    spec = PlacementSpec(
        nodes=nodes,
        gpus_per_node=shape.gpus_per_node if shape else 0,
        cpus_per_node=options.cpus_per_replica / nodes,
        strategy="spread" if nodes > 1 else "pack",
        node_labels=dict(options.node_labels or {}),
        exclude_head=options.exclude_head and head is not None,
    )
    bundles, strategy, selectors = to_ray_bundles(spec, head_node_id=head.node_id if head else None)
    return _Plan(shape, nodes, bundles, strategy, selectors)


def new_set(options: ReplicaOptions, placed: _Plan, flow_run_id: str | None) -> ReplicaSet:
    """An empty replica set named after its owner (nothing reserved yet)."""
    tag = (flow_run_id or "none").replace("-", "")[:12] + "-" + uuid.uuid4().hex[:6]
    return ReplicaSet(
        name=f"{SERVE_PREFIX}{_slug(options.name)}-{tag}",
        flow_run_id=flow_run_id,
        ranks=placed.nodes,
        shape=placed.shape,
    )


def render(
    rs: ReplicaSet, command: str | Sequence[str], options: ReplicaOptions, placed: _Plan
) -> list[dict[str, Any]]:
    """What `launch` would create for this set, creating nothing: each replica's placement group
    and the process of each of its ranks (ports and hosts are chosen at launch: the command
    keeps its placeholders)."""
    docs: list[dict[str, Any]] = []
    for i in range(options.replicas):
        group = f"{rs.name}-{i}"
        docs.append(
            {
                "kind": "RayPlacementGroup",
                "name": group,
                "strategy": placed.strategy,
                "bundles": placed.bundles,
                "bundle_label_selector": placed.selectors,
                "lifetime": "detached",
            }
        )
        for rank in range(placed.nodes):
            docs.append(
                {
                    "kind": "ReplicaProcess",
                    "actor": f"{group}-b{rank}",
                    "replica": i,
                    "rank": rank,
                    "command": command if isinstance(command, str) else list(command),
                    "env": dict(options.env or {}),
                    "cwd": options.cwd,
                    "health": options.health_url
                    or f"http://{{host}}:{{port}}{options.health_path}",
                }
            )
    return docs


def launch(
    rs: ReplicaSet,
    command: str | Sequence[str],
    options: ReplicaOptions,
    placed: _Plan,
    say: Callable[[str], None] = log.info,
) -> None:
    """Reserve the groups, start every replica and return once every health check answers
    2xx. The caller tears `rs` down if this raises (capacity, timeouts, a replica exiting)."""
    pgs = []
    for i in range(options.replicas):
        group = f"{rs.name}-{i}"
        pgs.append(create_group(group, placed.bundles, placed.strategy, placed.selectors))
        rs.groups.append(group)
        record_owner(group)
    t_pg = time.monotonic()
    wait_ready(pgs, options.placement_timeout_s)
    say(f"{rs.name}: {options.replicas} placement group(s) ready in {time.monotonic() - t_pg:.1f}s")
    gpus = placed.shape.gpus_per_node if placed.shape else 0
    actors = [
        [
            spawn_actor(
                f"{rs.groups[i]}-b{b}", pg, b, gpus=gpus, cpus=placed.bundles[b].get("CPU", 0)
            )
            for b in range(placed.nodes)
        ]
        for i, pg in enumerate(pgs)
    ]
    rs.replicas = _start_processes(rs, actors, command, options)
    wait_healthy(rs.replicas, dict(enumerate(actors)), options.readiness_timeout_s)


def _slug(name: str) -> str:
    out = "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")
    return out[:30] or "replicas"


def _fill(template: str, values: Mapping[str, object]) -> str:
    # Only our placeholders: a shell's ${VAR} or a JSON brace stays as written.
    for key, value in values.items():
        template = template.replace("{" + key + "}", str(value))
    return template


def _start_processes(
    rs: ReplicaSet,
    actors: list[list[Any]],
    command: str | Sequence[str],
    options: ReplicaOptions,
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
        refs, commands, envs = [], [], []
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
                **(options.env or {}),
                "PORT": str(values["port"]),
                "HOST": str(values["host"]),
                "REPLICA_INDEX": str(i),
                "NODE_RANK": str(rank),
                "NNODES": str(len(ranks)),
                "MASTER_ADDR": master_ip,
                "MASTER_PORT": str(port),
            }
            refs.append(actor.start.remote(argv, env=child_env, cwd=options.cwd))
            commands.append(argv)
            envs.append(child_env)
        started.append((i, infos, port, refs, commands, envs))
    replicas = []
    for i, infos, port, refs, commands, envs in started:
        records = ray.get(refs)
        endpoint = f"http://{infos[0]['ip']}:{port}"
        url = (
            _fill(options.health_url, {"host": infos[0]["ip"], "port": port})
            if options.health_url
            else endpoint + options.health_path
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
                commands=commands,
                envs=envs,
            )
        )
    return replicas


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            status: int = resp.status
            return 200 <= status < 300
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


def wait_healthy(
    replicas: Sequence[Replica], actors: Mapping[int, list[Any]], timeout_s: float
) -> None:
    """Poll every replica's health URL; fail at once if a replica's process exits. `actors`
    are each replica's actors by replica index."""
    deadline = time.monotonic() + timeout_s
    waiting = {r.index: r for r in replicas}
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
                _check_alive(waiting, actors)
            if time.monotonic() >= deadline:
                urls = ", ".join(r.health_url for r in waiting.values())
                raise PlacementTimeout(
                    f"{len(waiting)} replica(s) not healthy after {timeout_s:g}s ({urls}): raise "
                    "readiness_timeout_s or check the health path and the server's log"
                )
            time.sleep(next(intervals))


def _check_alive(waiting: Mapping[int, Replica], actors: Mapping[int, list[Any]]) -> None:
    """Raise ReplicaFailed, with its log tail, for the first replica whose process exited (one
    round trip to all actors at once)."""
    pairs = [(index, actor) for index in waiting for actor in actors[index]]
    alive = ray.get([actor.is_alive.remote() for _, actor in pairs], timeout=30)
    for (index, actor), up in zip(pairs, alive, strict=True):
        if not up:
            tail = ray.get(actor.read_log_tail.remote(), timeout=30)
            raise ReplicaFailed(
                f"replica {index} ({waiting[index].endpoint}) exited before it was healthy; "
                f"last log lines:\n{tail}"
            )


_teardown_lock = threading.Lock()


def teardown(
    rs: ReplicaSet,
    *,
    stop_timeout_s: float = STOP_TIMEOUT_S,
    then: Callable[[list[dict[str, Any] | None]], None] = lambda reports: None,
) -> list[dict[str, Any] | None]:
    """Stop every replica's processes (SIGTERM, bounded wait, SIGKILL), kill the actors and
    remove the placement groups, then call `then(reports)`. Safe to call twice and on a
    half-started set; a second caller (the cancel watch racing the `with` block's exit) returns
    [] once the first one has finished (only the first calls `then`)."""
    with _teardown_lock:
        first = not rs.stopped.is_set()
        rs.stopped.set()
    if not first:
        rs.torn_down.wait(stop_timeout_s + 60)
        return []
    try:
        watch = rs.__dict__.get("_watch")
        if watch is not None:
            watch.stop()
        actors = []
        for group in rs.groups:
            for b in range(rs.ranks):
                with contextlib.suppress(ValueError):  # never created, or already gone
                    actors.append(ray.get_actor(f"{group}-b{b}", namespace=NAMESPACE))
        reports = stop_many(actors, timeout_s=stop_timeout_s) if actors else []
        for group in rs.groups:
            remove_group(group)
            forget_owner(group)
        then(reports)
        return reports
    finally:
        rs.torn_down.set()
