"""A Ray worker node joining a local head, for the tests that need a second node: started
again when its raylet dies starting (ray#65983: the raylet waits a hard-coded 15 s for its
dashboard agent's port file, then aborts; CI's busy cores ran past it, in two modules)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from prefect_nemo.errors import BackendUnavailable
from prefect_nemo.local_ray import (
    LEAN_NODE_ENV,
    LocalRayCluster,
    free_ports,
    kill_session,
    stop_session,
)

NODE_STARTS = 3
JOIN_TIMEOUT_S = 180


@contextlib.contextmanager
def worker_node(
    head: LocalRayCluster, resources: dict[str, float], num_cpus: int = 1
) -> Iterator[subprocess.Popen[bytes]]:
    """A node of `head` on this machine (`ray start --address`, its own ports and process
    session, its logs in the head's temp dir), alive in the head's view when this yields; at
    the end stopped as a head we start is (`stop_session`)."""
    env = {**LEAN_NODE_ENV, **os.environ, "RAY_AUTH_MODE": "token"}
    env["RAY_AUTH_TOKEN"] = head.token or ""
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    env.pop("RAY_ADDRESS", None)
    for _ in range(NODE_STARTS):
        process = _start_node(head, resources, num_cpus, env)
        if _joined(head, resources, process):
            break
        kill_session(process.pid)
        process.wait(30)
    else:
        raise AssertionError(f"a Ray worker node with {resources} died starting, {NODE_STARTS}x")
    try:
        yield process
    finally:
        stop_session(process)


def _start_node(
    head: LocalRayCluster, resources: dict[str, float], num_cpus: int, env: dict[str, str]
) -> subprocess.Popen[bytes]:
    names = ("node-manager", "object-manager", "dashboard-agent-listen", "dashboard-agent-grpc",
             "metrics-export", "runtime-env-agent")  # fmt: skip
    ports = zip(names, free_ports(len(names)), strict=True)
    cmd = [str(Path(sys.executable).parent / "ray"), "start", "--block", "--disable-usage-stats",
           f"--address={head.gcs_address}", "--node-ip-address=127.0.0.1",
           f"--num-cpus={num_cpus}", f"--resources={json.dumps(resources)}",
           "--object-store-memory=100000000",
           *(f"--{name}-port={port}" for name, port in ports)]  # fmt: skip
    if head.temp_dir is not None:
        cmd.append(f"--temp-dir={head.temp_dir}")
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )


def _joined(
    head: LocalRayCluster, resources: dict[str, float], process: subprocess.Popen[bytes]
) -> bool:
    """The node is ALIVE with `resources` as the head's dashboard lists its nodes (through the
    Ray Jobs backend's own reader); False once its `ray start --block` exited (a process of the
    node died)."""
    backend = head.block().backend()

    def alive() -> bool:
        with contextlib.suppress(BackendUnavailable):
            return any(set(resources) <= set(node) for node in backend._node_resources())
        return False

    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while time.monotonic() < deadline and process.poll() is None:
        if alive():
            return True
        time.sleep(1)
    return False
