"""What serving on Ray placement groups costs over starting the same servers by hand.

Figures (from ROUNDS interleaved rounds of both ways after a warm-up round, bench._rounds:
the ratios per round as `median [min, max]`, the times as medians):

- serve_startup_ratio: time from `serve_replicas` entry to all 4 replicas healthy (4 x tp=1 on a
  2-node logical-GPU cluster) over the time to start the same 4 servers with plain Popen and
  see them healthy, in the same round. Also serve_startup_s and serve_popen_s.
- serve_ray_worker_floor_s: 4 trivial Ray actors (1 logical GPU each) created and answering,
  in the same run: the part of serve_startup_s that is Ray starting a worker per replica.
- serve_startup_ratio_floor: 1 + floor / Popen time, the ratio serving would have if it cost
  nothing but that one fresh Ray worker per replica. Ray runs every actor in a worker process
  of its own (started for it, gone with it), and a replica's server can only be spawned once its
  actor runs, so serve_startup_ratio cannot go below this figure; on a 2-core machine a fresh
  worker costs about 0.6-0.7 CPU-s against about 0.2 CPU-s for a model server.

Both ways of starting poll /health on the same back-off (serving.poll_intervals).
- serve_teardown_s: from leaving the `with` block to everything stopped (well-behaved servers).
- serve_teardown_stubborn_s: the same for servers that ignore SIGTERM (SIGKILL after the
  bound, serve_stop_bound_s).

    .venv/bin/python -m bench.serve_startup      # this module alone
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import ray

from bench._rounds import ROUNDS, Spread, interleaved
from prefect_nemo.local_ray import free_port
from prefect_nemo.tasks.replicas import poll_intervals, serve_replicas

Report = Callable[[str, object], None]

SERVER = Path(__file__).resolve().parent.parent / "flows" / "serve_jobs" / "model_server.py"
REPLICAS = 4
STOP_BOUND_S = 2.0


def log(message: str) -> None:
    """Progress goes to stderr; stdout carries only figures."""
    print(f"[serve_startup] {message}", file=sys.stderr, flush=True)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def popen_startup() -> float:
    """Start REPLICAS servers with Popen, wait until all answer /health; seconds."""
    t0 = time.monotonic()
    ports = [free_port() for _ in range(REPLICAS)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(SERVER), "--port", str(p)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for p in ports
    ]
    try:
        waiting = set(ports)
        intervals = poll_intervals()
        while waiting:
            waiting = {p for p in waiting if not _healthy(f"http://127.0.0.1:{p}/health")}
            if waiting:
                time.sleep(next(intervals))
        return time.monotonic() - t0
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(10)


def ray_worker_floor() -> float:
    """Create REPLICAS trivial actors (a fresh Ray worker each) and call them once; seconds."""

    # Defined here so Ray ships it by value: a module-level class would make every worker
    # import this module, and with it Prefect.
    @ray.remote
    class Trivial:
        def ping(self) -> int:
            return os.getpid()

    t0 = time.monotonic()
    options = Trivial.options  # type: ignore[attr-defined]  # ray.remote's class is untyped
    actors = [options(num_gpus=1, num_cpus=1).remote() for _ in range(REPLICAS)]
    ray.get([a.ping.remote() for a in actors])
    took = time.monotonic() - t0
    for actor in actors:
        ray.kill(actor)
    return took


def serve_once(stubborn: bool = False) -> tuple[float, float]:
    """(entry -> all healthy, block exit -> all stopped) for REPLICAS replicas; seconds."""
    command = [sys.executable, str(SERVER), "--port", "{port}"]
    if stubborn:
        command.append("--ignore-sigterm")
    t0 = time.monotonic()
    with serve_replicas(
        command, replicas=REPLICAS, tp_size=1, name="bench", stop_timeout_s=STOP_BOUND_S
    ):
        startup = time.monotonic() - t0
        t1 = time.monotonic()
    return startup, time.monotonic() - t1


class Served(NamedTuple):
    """One round of serve_replicas, and the Ray worker floor measured right after it."""

    startup_s: float
    teardown_s: float
    floor_s: float


def run(report: Report) -> None:
    """Start a 2-node logical cluster, run Popen and serve_replicas in interleaved rounds."""
    from ray.cluster_utils import Cluster

    if os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        del os.environ["CUDA_VISIBLE_DEVICES"]  # an empty value hides logical GPUs
    log("starting a 2-node Ray cluster (2 logical GPUs each)")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 2})
    cluster.add_node(num_cpus=2, num_gpus=2)
    try:
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace="prefect-nemo", log_to_driver=False)

        def ours() -> Served:
            served = Served(*serve_once(), ray_worker_floor())
            log(
                f"serve {served.startup_s:.2f}s, teardown {served.teardown_s:.2f}s, "
                f"4 trivial actors {served.floor_s:.2f}s (load average {os.getloadavg()[0]:.1f})"
            )
            return served

        def raw() -> float:
            direct = popen_startup()
            log(f"popen {direct:.2f}s (load average {os.getloadavg()[0]:.1f})")
            return direct

        pairs = interleaved(ours, raw, ROUNDS, warmups=1)
        stubborn = []
        for rep in range(2):
            _, teardown = serve_once(stubborn=True)
            log(f"stubborn rep {rep + 1}/2: teardown {teardown:.2f}s (bound {STOP_BOUND_S:g}s)")
            stubborn.append(teardown)
        report("serve_startup_s", statistics.median(o.startup_s for o, _ in pairs))
        report("serve_popen_s", statistics.median(r for _, r in pairs))
        report("serve_startup_ratio", Spread.of(o.startup_s / r for o, r in pairs))
        report("serve_ray_worker_floor_s", statistics.median(o.floor_s for o, _ in pairs))
        report("serve_startup_ratio_floor", Spread.of(1 + o.floor_s / r for o, r in pairs))
        report("serve_teardown_s", statistics.median(o.teardown_s for o, _ in pairs))
        report("serve_stop_bound_s", STOP_BOUND_S)
        report("serve_teardown_stubborn_s", max(stubborn))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    from bench.run_all import report as print_figure

    run(print_figure)
