"""Serving on a real multi-node Ray cluster (ray.cluster_utils.Cluster, logical GPUs, labels).

Nodes: a head with 2 GPUs, workers 'a' and 'b' with 2 GPUs each. Everything a test starts is
checked gone in the process table (psutil), not only in Ray.
"""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from prefect_nemo.placement import (
    InsufficientCapacity,
    PlacementError,
    ReplicaFailed,
    Topology,
    create_group,
    sweep,
    wait_ready,
)
from prefect_nemo.placement.process import MARKER_ENV
from prefect_nemo.tasks.replicas import SERVE_PREFIX, serve_replicas

# Ray vendors psutil (ray/thirdparty_files goes on sys.path when ray is imported).
psutil = importlib.import_module("psutil")
pytestmark = pytest.mark.slow
ROOT = Path(__file__).parent.parent
# A server that needs nothing but the stdlib; it prints the GPUs it was given.
SERVER = (
    f"echo CVD=$CUDA_VISIBLE_DEVICES; exec {sys.executable} -m http.server {{port}} --bind 0.0.0.0"
)
STUBBORN = "trap '' TERM; " + SERVER  # SIG_IGN survives exec: the server ignores SIGTERM


def wait_until(predicate, timeout_s: float, what: str, every: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def marked_processes(prefix: str) -> list[int]:
    """Live processes whose environment carries a placement marker starting with prefix."""
    found = []
    for proc in psutil.process_iter():
        try:
            value = proc.environ().get(MARKER_ENV, "")
            if value.startswith(prefix) and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        except (psutil.Error, OSError):
            continue
    return found


def live_groups(prefix: str) -> list[str]:
    table = ray.util.placement_group_table().values()
    return [g["name"] for g in table if g["name"].startswith(prefix) and g["state"] != "REMOVED"]


@pytest.fixture(scope="module")
def cluster() -> Iterator[object]:
    """Three Ray nodes on this machine; connected in this process; all gone afterwards."""
    from ray.cluster_utils import Cluster

    if os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        del os.environ["CUDA_VISIBLE_DEVICES"]  # an empty value hides logical GPUs
    if ray.is_initialized():
        ray.shutdown()
    c = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "num_gpus": 2, "labels": {"role": "head"}},
    )
    for pool in ("a", "b"):
        c.add_node(num_cpus=2, num_gpus=2, labels={"pool": pool})
    c.wait_for_nodes()
    session = c.head_node.get_session_dir_path()
    ray.init(address=c.address, namespace="prefect-nemo", log_to_driver=False)
    try:
        yield c
    finally:
        leftovers = marked_processes(SERVE_PREFIX)
        ray.shutdown()
        c.shutdown()
        ray_procs = [
            p.pid
            for p in psutil.process_iter(["cmdline"])
            if session in " ".join(p.info["cmdline"] or []) and alive(p.pid)
        ]
        assert not leftovers, f"server processes left behind: {leftovers}"
        assert not ray_procs, f"Ray processes of the test cluster left behind: {ray_procs}"


def nodes_by_label(key: str) -> dict[str, str]:
    return {n.labels.get(key, ""): n.node_id for n in Topology.from_ray().nodes}


def test_spread_replica_lands_off_the_head_with_its_gpus(cluster):
    head = Topology.from_ray().head
    assert head is not None
    pools = nodes_by_label("pool")
    # tp=4 on 2-GPU nodes without the head: one replica spread 2+2 over workers a and b.
    with serve_replicas(SERVER, replicas=1, tp_size=4, exclude_head=True, health_path="/") as rs:
        (replica,) = rs.replicas
        assert sorted(replica.node_ids) == sorted([pools["a"], pools["b"]])
        group = ray.util.placement_group_table()
        info = next(g for g in group.values() if g["name"] == replica.group)
        assert info["strategy"] == "STRICT_SPREAD"
        assert sorted(info["bundles_to_node_id"].values()) == sorted(replica.node_ids)
        for rank, gpus in enumerate(replica.gpu_ids):
            assert len(gpus) == 2
            actor = ray.get_actor(replica.actors[rank], namespace="prefect-nemo")
            log = ray.get(actor.read_log_tail.remote())
            assert f"CVD={','.join(gpus)}" in log
        pids = replica.pids
    assert not any(alive(p) for p in pids)
    assert not live_groups(rs.name)


def test_label_selector_and_packing(cluster):
    pools = nodes_by_label("pool")
    with serve_replicas(
        SERVER, replicas=2, tp_size=1, node_labels={"pool": "b"}, health_path="/"
    ) as rs:
        assert [r.node_ids for r in rs.replicas] == [[pools["b"]], [pools["b"]]]
        assert sorted(r.gpu_ids[0][0] for r in rs.replicas) == ["0", "1"]
        for r in rs.replicas:
            actor = ray.get_actor(r.actors[0], namespace="prefect-nemo")
            assert f"CVD={r.gpu_ids[0][0]}" in ray.get(actor.read_log_tail.remote())


def test_the_actors_workers_import_nothing_of_prefect_nemo(cluster):
    # placement.process ships by value: the cluster's nodes need no prefect_nemo installed.
    with serve_replicas(SERVER, replicas=1, tp_size=1, health_path="/") as rs:
        actor = ray.get_actor(rs.replicas[0].actors[0], namespace="prefect-nemo")
        imported = ray.get(
            actor.__ray_call__.remote(
                lambda _: [m for m in sys.modules if m.split(".")[0] in ("prefect", "prefect_nemo")]
            )
        )
    assert imported == []


def test_capacity_is_checked_before_anything_is_reserved(cluster):
    t0 = time.monotonic()
    with pytest.raises(InsufficientCapacity, match="hold at most 1"):
        with serve_replicas(SERVER, replicas=2, tp_size=4, exclude_head=True):
            pass
    with pytest.raises(PlacementError, match="cannot be split equally"):
        with serve_replicas(SERVER, replicas=1, tp_size=3, exclude_head=True):
            pass
    assert time.monotonic() - t0 < 5
    assert not live_groups(SERVE_PREFIX)
    # A group Ray itself finds infeasible fails fast too, with what cannot fit.
    pg = create_group("prefect-nemo-test-infeasible", [{"GPU": 8}], "STRICT_PACK")
    try:
        with pytest.raises(InsufficientCapacity, match="INFEASIBLE"):
            wait_ready([pg], timeout_s=30)
    finally:
        ray.util.remove_placement_group(pg)


def test_stubborn_server_is_killed_within_the_bound(cluster):
    bound = 1.0
    with serve_replicas(
        STUBBORN, replicas=2, tp_size=1, health_path="/", stop_timeout_s=bound
    ) as rs:
        pids = [p for r in rs.replicas for p in r.pids]
        os.kill(pids[0], 0)
        t0 = time.monotonic()
    took = time.monotonic() - t0
    assert not any(alive(p) for p in pids)
    assert took <= bound + 1.0, f"teardown took {took:.2f}s"


def test_killing_the_actor_process_kills_the_server(cluster):
    """The reaper kills a server whose actor died, and the set says so: "never a silently
    shrunken pool" (issue 14, item 9)."""
    with pytest.raises(ReplicaFailed, match="lost its Ray actor"):
        with serve_replicas(
            SERVER, replicas=1, tp_size=1, health_path="/", watch_interval_s=0.2
        ) as rs:
            (replica,) = rs.replicas
            server = replica.pids[0]
            assert alive(server)
            os.kill(replica.actor_pids[0], signal.SIGKILL)
            t0 = time.monotonic()
            wait_until(lambda: not alive(server), 5, "the reaper to kill the server")
            reaped_in = time.monotonic() - t0
            wait_until(lambda: rs.failure is not None, 10, "the watch to see the lost actor")
    assert reaped_in < 2
    assert not marked_processes(rs.name)


def test_a_replica_that_dies_when_healthy_is_restarted_then_fails_the_block(cluster):
    """Issue 14, item 9: "Replicas stay watched after they are healthy: a replica process that
    dies later is restarted up to the block's limit or fails the task with its exit code and log
    tail; never a silently shrunken pool." """
    with pytest.raises(ReplicaFailed) as failed:
        with serve_replicas(
            SERVER, replicas=2, tp_size=1, health_path="/", max_restarts=1, watch_interval_s=0.2
        ) as rs:
            replica = rs.replicas[0]
            first = replica.pids[0]
            os.kill(first, signal.SIGKILL)
            wait_until(lambda: replica.restarts == 1, 60, "the replica to be restarted")
            assert replica.pids[0] != first and alive(replica.pids[0])
            assert healthy(replica.health_url), "the restarted replica serves again"
            assert rs.failure is None
            rs.check()  # whole again: nothing to raise
            os.kill(replica.pids[0], signal.SIGKILL)  # past max_restarts: the set fails
            wait_until(lambda: rs.failure is not None, 30, "the set to fail")
            with pytest.raises(ReplicaFailed):
                rs.check()
    message = str(failed.value)
    assert "replica 0" in message and "exited with code -9 after 1 restart(s)" in message
    assert "CVD=" in message, "the log tail comes with it"
    assert not marked_processes(rs.name), "the other replica was torn down too"


DRIVER = textwrap.dedent(
    """
    import sys, time, ray
    ray.init(address=sys.argv[1], namespace="prefect-nemo", log_to_driver=False)
    from prefect import flow
    from prefect_nemo.tasks.replicas import serve_replicas

    def serve():
        with serve_replicas(sys.argv[2], replicas=2, tp_size=1, health_path="/") as rs:
            print("READY", rs.name, *[r.pids[0] for r in rs.replicas], flush=True)
            time.sleep(600)

    flow(serve)() if sys.argv[3] == "flow" else serve()
    """
)


def start_driver(cluster, log: Path, mode: str, env: dict[str, str] | None = None):
    """A separate driver process serving 2 replicas; returns (process, name, server pids)."""
    with open(log, "w") as out:
        driver = subprocess.Popen(
            [sys.executable, "-c", DRIVER, cluster.address, SERVER, mode],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=env,
        )
    try:
        line = wait_until(
            lambda: next((x for x in log.read_text().splitlines() if x.startswith("READY")), None),
            120,
            "the driver's replicas",
            every=0.3,
        )
    except BaseException:
        driver.kill()
        driver.wait()
        raise AssertionError(log.read_text()[-3000:]) from None
    _, name, *pids = line.split()
    return driver, name, [int(p) for p in pids]


def test_a_dead_driver_leaves_orphans_the_sweep_removes(cluster, tmp_path):
    driver, name, pids = start_driver(cluster, tmp_path / "driver.log", "plain")
    driver.kill()
    driver.wait()
    time.sleep(1.0)
    # Detached groups and actors outlive the driver: an orphan, servers still running.
    assert len(live_groups(name)) == 2
    assert all(alive(p) for p in pids)
    report = sweep(name, only_orphans=True)  # the owner (the driver) is dead: an orphan
    assert len(report.groups) == 2
    wait_until(lambda: not any(alive(p) for p in pids), 10, "the orphaned servers to die")
    assert not live_groups(name)
    assert not marked_processes(name)
    for actor in report.actors:
        with pytest.raises(ValueError):
            ray.get_actor(actor, namespace="prefect-nemo")


def test_sigterm_to_a_flow_process_tears_down(cluster, prefect_api, tmp_path):
    # What a runner does to cancel a flow run: SIGTERM, which Prefect raises in the main thread.
    from tests.conftest import subprocess_env

    env = subprocess_env(prefect_api, PYTHONPATH=str(ROOT))
    driver, name, pids = start_driver(cluster, tmp_path / "flow.log", "flow", env)
    driver.send_signal(signal.SIGTERM)
    try:
        driver.wait(60)
    finally:
        driver.kill()
    assert not any(alive(p) for p in pids)
    assert not live_groups(name)
    assert not marked_processes(name)


def test_only_orphans_spares_a_live_owner(cluster):
    with serve_replicas(SERVER, replicas=1, tp_size=1, health_path="/") as rs:
        assert sweep(rs.name, only_orphans=True).groups == []
        assert live_groups(rs.name)


def test_cancelled_flow_leaves_nothing_behind(cluster, prefect_api):
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.context import get_run_context
    from prefect.states import Cancelling

    seen: dict[str, object] = {}

    @flow
    def serving_flow() -> None:
        seen["run_id"] = get_run_context().flow_run.id
        with serve_replicas(SERVER, replicas=2, tp_size=1, health_path="/") as rs:
            seen["rs"] = rs
            rs.stopped.wait(120)  # a real body would be calling the endpoints
            raise RuntimeError("replicas went away")

    thread = threading.Thread(target=lambda: _quietly(serving_flow), daemon=True)
    thread.start()
    rs = wait_until(lambda: seen.get("rs"), 90, "the flow's replicas", every=0.2)
    pids = [p for r in rs.replicas for p in r.pids]
    assert all(alive(p) for p in pids) and len(live_groups(rs.name)) == 2
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(seen["run_id"], Cancelling(), force=True)
    wait_until(lambda: rs.stopped.is_set(), 30, "the cancel watch to tear down")
    thread.join(60)
    wait_until(lambda: not any(alive(p) for p in pids), 10, "the servers to die")
    assert not live_groups(rs.name)
    assert not marked_processes(rs.name)
    for replica in rs.replicas:
        with pytest.raises(ValueError):
            ray.get_actor(replica.actors[0], namespace="prefect-nemo")


def _quietly(fn) -> None:
    try:
        fn()
    except BaseException:
        pass


def test_serve_and_evaluate_flow(cluster, prefect_api):
    from flows.serve_and_evaluate import serve_and_evaluate

    metrics = serve_and_evaluate(replicas=2, tp_size=1, rows=2000, exclude_head=True)
    assert metrics["accuracy"] > 0.75
    assert len(metrics["batches_per_replica"]) == 2  # both replicas answered
    assert Topology.from_ray().head.node_id not in metrics["nodes"]
    assert not live_groups(SERVE_PREFIX)
    assert not marked_processes(SERVE_PREFIX)


def test_start_and_stop_replicas_tasks(cluster, prefect_api):
    from prefect import flow

    from prefect_nemo.tasks._live import live_work
    from prefect_nemo.tasks.replicas import start_replicas, stop_replicas

    @flow
    def pair() -> tuple[list[int], str, list]:
        rs = start_replicas(SERVER, replicas=1, tp_size=1, health_path="/", name="pair")
        pids = [p for r in rs.replicas for p in r.pids]
        assert all(alive(p) for p in pids)
        assert rs.flow_run_id in live_work.flow_run_ids()  # torn down if the run is cancelled
        reports = stop_replicas(rs)
        assert rs.flow_run_id not in live_work.flow_run_ids()  # stopped: nothing left to tear down
        return pids, rs.name, reports

    pids, name, reports = pair()
    assert len(reports) == 1 and reports[0]["killed"] is False
    assert not any(alive(p) for p in pids)
    assert not live_groups(name)


def test_bundle_helpers_resolve_node_ip_and_a_free_port(cluster):
    from prefect_nemo.placement import bundle_node, node_ip_and_free_port, remove_group

    pools = nodes_by_label("pool")
    pg = create_group("prefect-nemo-test-helpers", [{"GPU": 1}], "STRICT_PACK", [{"pool": "a"}])
    try:
        wait_ready([pg], timeout_s=30)
        node_id, ip = bundle_node(pg, 0)
        assert node_id == pools["a"]
        got_ip, port = node_ip_and_free_port(pg, 0)
        assert got_ip == ip and 1024 < port < 65536
    finally:
        assert remove_group("prefect-nemo-test-helpers")
    assert not live_groups("prefect-nemo-test-helpers")


def test_start_replicas_dry_run_plans_and_creates_nothing(cluster):
    """Issue 14 item 4: "Give ... the Dynamo and serving tasks a dry_run option ... that returns
    what would be submitted ... and submits nothing": the plan (placement groups, each rank's
    process) on the real cluster's topology; no group is reserved, no process started."""
    from prefect_nemo.tasks.replicas import start_replicas

    dry = start_replicas.fn(
        SERVER, dry_run=True, replicas=1, tp_size=4, exclude_head=True, health_path="/",
        env={"MODEL": "tiny"},
    )  # fmt: skip
    (group,) = [d for d in dry.documents if d["kind"] == "RayPlacementGroup"]
    assert group["strategy"] == "STRICT_SPREAD" and [b["GPU"] for b in group["bundles"]] == [2, 2]
    ranks = [d for d in dry.documents if d["kind"] == "ReplicaProcess"]
    assert [r["rank"] for r in ranks] == [0, 1] and ranks[0]["env"] == {"MODEL": "tiny"}
    assert "{port}" in ranks[0]["command"], "ports are chosen at launch"
    assert not live_groups(SERVE_PREFIX) and not marked_processes(SERVE_PREFIX)
    with pytest.raises(InsufficientCapacity):  # capacity is checked as a start would
        start_replicas.fn(SERVER, dry_run=True, replicas=2, tp_size=4, exclude_head=True)
