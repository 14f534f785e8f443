"""The managed-subprocess actor: one command in one placement-group bundle, gone when we say so
and also when the actor dies.

A child started in its own session survives every way a Ray actor can die (the raylet kills the
worker's process group, not ours), so each child gets a reaper: a tiny process in its own
session that polls the actor's process and kills the child's whole group once the actor is
gone. The child's pgid is also recorded in Ray's internal KV for the orphan sweep, and the child
carries PREFECT_NEMO_PLACEMENT=<actor name> in its environment so nothing else is ever killed.

This module is what runs on the cluster's nodes, so it is shipped to Ray's workers by value (see
the end of the file): an actor's worker imports nothing of prefect_nemo, and nodes run without
it. Keep it to the standard library and Ray.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from prefect_nemo.placement.groups import NAMESPACE

MARKER_ENV = "PREFECT_NEMO_PLACEMENT"
KV_PROC_PREFIX = "proc:"
STOP_TIMEOUT_S = 10.0
LOG_DIR = Path(tempfile.gettempdir()) / "prefect-nemo" / "placement"

# The reaper: exits when the child's group is gone; kills the group when the actor is gone.
# The actor is identified by pid and start time (pids are reused); zombies count as gone
# (PID 1 may not reap them).
_REAPER = r"""
import os, signal, sys, time
def stat(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
        return rest[0], rest[19]
    except (OSError, IndexError):
        return None
def group_alive(pgid):
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.getpgid(int(name)) == pgid and stat(int(name))[0] != "Z":
                    return True
            except (OSError, TypeError):
                pass
    return False
parent, started, pgid = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
tick = 0
while True:
    s = stat(parent)
    if s is None or s[0] == "Z" or s[1] != started:
        break
    if tick % 5 == 0 and not group_alive(pgid):
        sys.exit(0)
    tick += 1
    time.sleep(0.1)
try:
    os.killpg(pgid, signal.SIGKILL)
except OSError:
    pass
"""


def proc_stat(pid: int) -> tuple[str, str] | None:
    """(state letter, start time in ticks) of a process, or None if it does not exist."""
    try:
        rest = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return rest[0], rest[19]
    except (OSError, IndexError):
        return None


def group_members(pgid: int, marker: str | None = None) -> list[int]:
    """Live (non-zombie) processes of a process group; with `marker`, only those whose
    environment carries PREFECT_NEMO_PLACEMENT=<marker>."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            if os.getpgid(pid) != pgid or (proc_stat(pid) or ("Z",))[0] == "Z":
                continue
            if marker is not None:
                environ = (entry / "environ").read_bytes().split(b"\0")
                if f"{MARKER_ENV}={marker}".encode() not in environ:
                    continue
        except OSError:
            continue
        members.append(pid)
    return members


def free_port() -> int:
    """A TCP port free right now on the node this runs on."""
    with socket.socket() as sock:
        sock.bind(("", 0))
        port: int = sock.getsockname()[1]
        return port


def kill_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    """Signal a process group; a group that is already gone is fine."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


@ray.remote(num_cpus=0)
def kill_marked(records: list[dict[str, Any]]) -> list[int]:
    """Kill recorded process groups on the node this runs on (pin it there), only processes
    that carry their record's marker; the pids killed."""
    killed = []
    for rec in records:
        members = group_members(int(rec["pgid"]), marker=rec["name"])
        if members:
            kill_group(int(rec["pgid"]))
            killed.extend(members)
    return killed


@ray.remote(num_cpus=0)
def ip_and_free_port() -> tuple[str, int]:
    """(IP, free port) of the node this runs on."""
    return ray.util.get_node_ip_address(), free_port()


def node_ip_and_free_port(pg: PlacementGroup, index: int) -> tuple[str, int]:
    """(IP, free port) on the node of bundle `index`, asked on that node."""
    strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index)
    return ray.get(ip_and_free_port.options(scheduling_strategy=strategy).remote())


def _wait_group_gone(pgid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        if not group_members(pgid):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


# Ray's overloads of ray.remote name only remote functions' options (not an actor's
# max_concurrency)
@ray.remote(max_concurrency=4, max_restarts=0)  # type: ignore[call-overload]
class ManagedProcess:
    """A Ray actor that owns one subprocess (its own session and process group)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.popen: subprocess.Popen[bytes] | None = None
        self.reaper: subprocess.Popen[bytes] | None = None
        self.log_path = LOG_DIR / f"{name}.log"

    def node(self) -> dict[str, Any]:
        """Where this actor runs: node id, IP, pid, the GPUs Ray assigned to it, and a TCP port
        free right now on its node (one call, so a launch costs one round trip per actor)."""
        ctx = ray.get_runtime_context()
        return {
            "node_id": ctx.get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "actor_pid": os.getpid(),
            "gpu_ids": [str(g) for g in ctx.get_accelerator_ids().get("GPU", [])],
            "free_port": free_port(),
        }

    def start(
        self,
        command: str | Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
    ) -> dict[str, Any]:
        """Spawn the command (a shell string or an argv list) with this actor's GPUs; again
        (a restart) once the previous child has ended and been stopped."""
        if self.popen is not None and self.popen.poll() is None:
            raise RuntimeError(f"{self.name}: already running (pid {self.popen.pid})")
        if self.reaper is not None and self.reaper.poll() is None:  # the ended child's reaper
            self.reaper.kill()
            self.reaper.wait(2)
        info = self.node()
        info.pop("free_port")
        child_env = {**os.environ, **(env or {}), MARKER_ENV: self.name}
        child_env["CUDA_VISIBLE_DEVICES"] = ",".join(info["gpu_ids"])
        for var in ("RAY_ADDRESS", "RAY_JOB_ID"):  # the server is not a Ray driver of ours
            child_env.pop(var, None)
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        # Ray workers block SIGINT/SIGTERM in some threads; the child inherits the mask of the
        # thread that forks it, so unblock here (per thread, allowed in a threaded actor).
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(
                command,
                shell=isinstance(command, str),
                env=child_env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        pgid = self.popen.pid  # session leader = group leader
        started = (proc_stat(os.getpid()) or ("", ""))[1]
        # -I -S: the reaper needs only the standard library; skipping site halves its start.
        self.reaper = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _REAPER, str(os.getpid()), started, str(pgid)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        record = {
            **info,
            "pid": self.popen.pid,
            "pgid": pgid,
            "reaper_pid": self.reaper.pid,
            "log": str(self.log_path),
        }
        _kv_put(KV_PROC_PREFIX + self.name, record)
        return record

    def pid(self) -> int | None:
        """The child's pid (None before start)."""
        return self.popen.pid if self.popen else None

    def pgid(self) -> int | None:
        """The child's process group id (its pid: it leads its own session)."""
        return self.popen.pid if self.popen else None

    def is_alive(self) -> bool:
        """True while the child runs."""
        return self.popen is not None and self.popen.poll() is None

    def exit_code(self) -> int | None:
        """The child's exit code once it ended."""
        return self.popen.poll() if self.popen else None

    def wait(self, timeout_s: float | None = None) -> int | None:
        """Wait for the child to end; its exit code, or None on timeout."""
        if self.popen is None:
            return None
        try:
            return self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def read_log_tail(self, lines: int = 40) -> str:
        """The last lines of the child's log (stdout and stderr)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 64 * 1024))
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> dict[str, Any]:
        """SIGTERM to the child's group, wait up to timeout_s, then SIGKILL the group."""
        t0 = time.monotonic()
        if self.popen is None:
            return {"exit_code": None, "killed": False, "seconds": 0.0}
        pgid = self.popen.pid
        kill_group(pgid, signal.SIGTERM)
        killed = False
        deadline = t0 + timeout_s
        while time.monotonic() < deadline:
            if self.popen.poll() is not None and not group_members(pgid):
                break
            time.sleep(0.05)
        else:
            kill_group(pgid, signal.SIGKILL)
            killed = True
            _wait_group_gone(pgid, 5.0)
        code = self.popen.poll()
        if code is None:
            try:
                code = self.popen.wait(2)
            except subprocess.TimeoutExpired:
                code = None
        if self.reaper is not None and self.reaper.poll() is None:
            self.reaper.kill()
            self.reaper.wait(2)
        _kv_del(KV_PROC_PREFIX + self.name)
        return {"exit_code": code, "killed": killed, "seconds": round(time.monotonic() - t0, 3)}


def _kv_put(key: str, value: dict[str, Any]) -> None:
    from ray.experimental.internal_kv import _internal_kv_put

    _internal_kv_put(key, json.dumps(value), overwrite=True, namespace=NAMESPACE)


def _kv_del(key: str) -> None:
    from ray.experimental.internal_kv import _internal_kv_del

    try:
        _internal_kv_del(key, namespace=NAMESPACE)
    except Exception:
        pass


def spawn_actor(
    name: str, pg: PlacementGroup, bundle_index: int, *, gpus: float = 0, cpus: float = 0
) -> Any:
    """A detached, named ManagedProcess actor in bundle `bundle_index` of `pg`."""
    # mypy keeps a class's own type under a class decorator: @ray.remote made it an ActorClass
    return ManagedProcess.options(  # type: ignore[attr-defined]
        name=name,
        namespace=NAMESPACE,
        lifetime="detached",
        num_cpus=cpus,
        num_gpus=gpus,
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=bundle_index
        ),
    ).remote(name)


def module_command(module: str, args: Sequence[str] = (), python: str | None = None) -> list[str]:
    """argv that runs a python module with the cluster node's interpreter (default: Ray's)."""
    return [python or sys.executable, "-m", module, *args]


def stop_many(
    actors: Sequence[Any], timeout_s: float = STOP_TIMEOUT_S
) -> list[dict[str, Any] | None]:
    """Stop several actors' children in parallel, then kill the actors.

    Each entry is the child's stop report, or None when the actor was already gone.
    """
    refs = [a.stop.remote(timeout_s) for a in actors]
    results: list[dict[str, Any] | None] = []
    for ref in refs:
        try:
            results.append(ray.get(ref, timeout=timeout_s + 10))
        except Exception:
            results.append(None)
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:
            pass
    return results


# Ship this module's classes and functions to Ray's workers by value instead of by reference: an
# actor's worker then imports nothing of prefect_nemo, so the cluster's nodes need not have it.
# (A fresh worker costs Ray itself about 0.6 CPU-s here; the package import it saves is within
# the noise of that.)
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
