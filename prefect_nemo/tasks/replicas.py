"""Replicated servers from a Prefect flow: `serve_replicas(...)` starts N replicas of a command on
Ray placement groups (`placement.replicas`), waits until every health check answers, yields the
endpoints, and tears everything down when the block ends: on exit, failure, timeout,
cancellation and crash. `start_replicas` / `stop_replicas` are the same as two tasks.

How it reaches Ray: a process holds one Ray connection. If this process is already connected
(`ray.init` was called) that connection is used. Otherwise `ray_address` (a GCS address
'host:port', 'auto', or a `LocalRayCluster`) with `auth_token`, then $RAY_ADDRESS when it is not
an http URL, else the embedded default cluster of `prefect_nemo.local_ray` (its GCS address and
token). The token reaches Ray's driver through $RAY_AUTH_TOKEN. A `RayJobsCluster` block has
only the dashboard address, which cannot place actors: pass the cluster's GCS address.
The command runs on the cluster's nodes as given: paths in it must exist there. What runs on the
nodes (placement.process) ships to Ray's workers by value: the nodes need no prefect_nemo.

Teardown paths: the context manager's `finally` (the flow body raised, returned or got
Prefect's TerminationSignal on SIGTERM); the run context's teardown, as for every piece of
remote work a flow run starts (flow hooks on cancellation, crash and failure, plus the one
cancel watch for runs cancelled through the API with no runner to signal them); and, for a
driver killed with SIGKILL, the detached groups carry the flow run id in their names so
`placement.sweep` finds them (the servers' reapers already killed the processes if the actors
died with their node; detached actors wait for the sweep).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import ray
from prefect import task
from prefect.cache_policies import NO_CACHE

from prefect_nemo.jobs import DryRun
from prefect_nemo.local_ray import LocalRayCluster
from prefect_nemo.placement import connect
from prefect_nemo.placement import replicas as engine
from prefect_nemo.placement.replica_watch import ReplicaWatch
from prefect_nemo.placement.replicas import (
    SERVE_PREFIX,
    STOP_TIMEOUT_S,
    ReplicaOptions,
    ReplicaSet,
    poll_intervals,
)
from prefect_nemo.redaction import Redactor
from prefect_nemo.tasks._live import live_work
from prefect_nemo.tasks._run import RunContext, current_run
from prefect_nemo.tasks.artifacts import RunTable
from prefect_nemo.tasks.reporting import dry_run_reported, emit

EVENT_PREFIX = "prefect-nemo.serve"

__all__ = [
    "SERVE_PREFIX",
    "ReplicaOptions",
    "ReplicaSet",
    "connect_ray",
    "poll_intervals",
    "render",
    "serve_replicas",
    "start",
    "start_replicas",
    "stop_replicas",
    "teardown",
]


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


def start(command: str | Sequence[str], options: ReplicaOptions | None = None) -> ReplicaSet:
    """Start the replicas and return once every health check answers 2xx.

    Anything that goes wrong (capacity, placement timeout, a replica exiting, readiness timeout,
    cancellation) tears down what was started before raising. See `serve_replicas`.
    """
    options = options or ReplicaOptions()
    run = current_run()
    t0 = time.monotonic()
    connect_ray(options.ray_address, auth_token=options.auth_token)
    if options.sweep_orphans and (swept := engine.sweep_orphans()):
        run.logger.warning(f"removed {len(swept)} orphaned group(s): {swept}")
    placed = engine.plan(options)
    rs = engine.new_set(options, placed, run.flow_run_id)
    # torn down with the flow run if it is cancelled or crashes before our own `finally`
    run.track(_work_key(rs), partial(_teardown_quietly, rs, options.stop_timeout_s))
    try:
        engine.launch(rs, command, options, placed, say=run.logger.info)
    except BaseException as exc:
        run.logger.error(f"{rs.name}: start failed ({type(exc).__name__}): tearing down")
        teardown(rs, stop_timeout_s=options.stop_timeout_s)
        _emit(rs, "failed", {"error": str(exc)[:500]})
        raise
    elapsed = time.monotonic() - t0
    run.logger.info(f"{rs.name}: {len(rs.replicas)} replica(s) healthy in {elapsed:.1f}s: "
                    f"{rs.endpoints}")  # fmt: skip
    _report(rs, run)
    _emit(rs, "ready", {"endpoints": rs.endpoints, "startup_s": round(elapsed, 3)})
    ReplicaWatch(rs, options, report=partial(_watched, rs, run)).start()
    return rs


def _watched(rs: ReplicaSet, run: RunContext, what: str, payload: dict[str, Any]) -> None:
    """What the replica watch saw: a replica restarted, or the set failed for good."""
    if what == "restarted":
        run.logger.warning(
            f"{rs.name}: replica {payload['replica']} died and was restarted "
            f"({payload['restarts']} restart(s) so far)"
        )
    else:
        run.logger.error(f"{rs.name}: {rs.failure}")
    _emit(rs, what, payload)


def teardown(
    rs: ReplicaSet, *, stop_timeout_s: float = STOP_TIMEOUT_S
) -> list[dict[str, Any] | None]:
    """Stop the replicas (see `placement.replicas.teardown`) and stop tracking them for the run."""
    reports = engine.teardown(
        rs,
        stop_timeout_s=stop_timeout_s,
        then=lambda reports: _emit(rs, "stopped", {"reports": reports}),
    )
    live_work.discard(rs.flow_run_id, _work_key(rs))
    return reports


def _teardown_quietly(rs: ReplicaSet, stop_timeout_s: float) -> str:
    try:
        teardown(rs, stop_timeout_s=stop_timeout_s)
    except Exception as exc:
        return f"teardown failed: {exc}"
    return "stopped"


def _work_key(rs: ReplicaSet) -> str:
    return f"replicas {rs.name}"


# ---------------------------------------------------------------------------------------------
# Reporting


def _report(rs: ReplicaSet, run: RunContext) -> None:
    rows = {
        str(r.index): {
            "replica": r.index,
            "endpoint": r.endpoint,
            "nodes": ", ".join(r.node_ips),
            "node_ids": ", ".join(n[:12] for n in r.node_ids),
            "gpus": "; ".join(",".join(g) or "-" for g in r.gpu_ids),
            "placement": rs.shape.strategy if rs.shape else "CPU",
            "group": r.group,
            "pids": ", ".join(map(str, r.pids)),
        }
        for r in rs.replicas
    }
    RunTable(f"Replicas of {rs.name} (prefect-nemo)").update(run.flow_run_id, rows)


def _emit(rs: ReplicaSet, what: str, payload: dict[str, Any]) -> None:
    if rs.flow_run_id is None:  # outside a run there may be no API (and no one listening)
        return
    emit(
        f"{EVENT_PREFIX}.{what}",
        {"prefect.resource.id": f"{EVENT_PREFIX}.{rs.name}", "prefect.resource.name": rs.name},
        {"name": rs.name, "replicas": len(rs.groups), **payload},
    )


# ---------------------------------------------------------------------------------------------
# The public faces


@contextmanager
def serve_replicas(command: str | Sequence[str], **options: Any) -> Iterator[ReplicaSet]:
    """Run replicas of `command` on Ray for the duration of a `with` block (options: the fields
    of `ReplicaOptions`, e.g. replicas=2, tp_size=2, exclude_head=True).

    Each replica gets `tp_size` GPUs (one STRICT_PACK bundle if they fit on a node, else an equal
    STRICT_SPREAD split; tp_size=0 for CPU-only replicas) and its own port: the command sees it
    as `{port}` (and `{host}`, `{replica}`, `{rank}`, `{nnodes}`, `{master_addr}`,
    `{master_port}`) and as $PORT. Yields a ReplicaSet once every `health_path` (or `health_url`
    template) answers 2xx; tears everything down when the block ends, however it ends. While
    the block runs, a replica whose process dies is restarted up to `max_restarts` times; past
    that the block raises ReplicaFailed (exit code, log tail) when it ends, and
    `ReplicaSet.check()` raises it at once. With sweep_orphans, first removes replica groups
    whose creating process on this host is dead.
    """
    opts = ReplicaOptions.of(options)
    rs = start(command, opts)
    try:
        yield rs
    finally:
        teardown(rs, stop_timeout_s=opts.stop_timeout_s)
        current_run().logger.info(f"{rs.name}: stopped")
    rs.check()  # a replica that died for good while the block ran fails it


@task(name="start_replicas", cache_policy=NO_CACHE)
def start_replicas(
    command: str | list[str], *, dry_run: bool = False, **options: Any
) -> ReplicaSet | DryRun:
    """Task: start replicas (options: the fields of ReplicaOptions); pair it with
    stop_replicas. The flow's cancellation/crash hooks and the cancel watch stop them if the
    flow never does. `dry_run`: return what would be created (each replica's placement group
    and processes, planned on the connected cluster) and create nothing."""
    opts = ReplicaOptions.of(options)
    if dry_run:
        return render(command, opts)
    return start(command, opts)


def render(command: str | Sequence[str], options: ReplicaOptions | None = None) -> DryRun:
    """The replica set `start` would create, planned on the cluster (capacity checked), as a
    DryRun; nothing is reserved or started."""
    options = options or ReplicaOptions()
    run = current_run()
    connect_ray(options.ray_address, auth_token=options.auth_token)
    placed = engine.plan(options)
    rs = engine.new_set(options, placed, run.flow_run_id)
    redact = Redactor([options.auth_token])
    dry = DryRun(
        job_id=rs.name,
        backend="ray-replicas",
        cluster=str(options.ray_address or "the connected Ray cluster"),
        documents=redact.deep(engine.render(rs, command, options, placed)),
    )
    return dry_run_reported(run, dry)


@task(name="stop_replicas", cache_policy=NO_CACHE)
def stop_replicas(
    replica_set: ReplicaSet,
    stop_timeout_s: float = STOP_TIMEOUT_S,
    *,
    ray_address: str | LocalRayCluster | None = None,
    auth_token: str | None = None,
) -> list[dict[str, Any] | None]:
    """Task: stop replicas started by start_replicas, from any process that reaches the cluster
    (actors and groups are found by name); returns each process's stop report."""
    connect_ray(ray_address, auth_token=auth_token)
    replica_set.stopped.clear()  # a copy from another task: its own flags say nothing
    replica_set.torn_down.clear()
    reports = teardown(replica_set, stop_timeout_s=stop_timeout_s)
    replica_set.check()  # a replica that died for good while they served fails the task
    return reports
