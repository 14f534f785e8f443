"""The embedded default: a local Ray head for when no cluster is configured.

We start `ray start --head --block` on free ports with token auth on (a fresh random token that
lives only in the head's environment and in our block, never on disk) and stop it by process
group when done. A cluster the user already runs on this machine is reused and left running.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

from prefect_nemo.blocks.ray_jobs import RayJobsCluster
from prefect_nemo.errors import BackendUnavailable

log = logging.getLogger(__name__)

DEFAULT_DASHBOARD = "http://127.0.0.1:8265"
#: How long find_local_ray waits for a Jobs API: at an address it was given, at the default port.
CONFIGURED_PROBE_S, DEFAULT_PROBE_S = 15.0, 2.0
#: Ray settings of the nodes we start, which share this machine's cores with their jobs and
#: with Prefect (an environment that sets one wins): no workers started ahead of a job's first
#: task (each stays idle for the node's life at ~0.4 CPU-s a minute, and a shell entrypoint
#: never needs one), no metrics collection (nothing reads them here). Measured on an idle head:
#: 3.0 CPU-s a minute against 4.3, and half the CPU for a job that only prints.
LEAN_NODE_ENV = {"RAY_prestart_worker_first_driver": "0", "RAY_enable_metrics_collection": "0"}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """`count` different TCP ports on 127.0.0.1 that nothing listens on right now: all held
    open until all are chosen (ports asked one at a time may repeat, and `ray start` refuses
    one port given to two of its components)."""
    with contextlib.ExitStack() as held:
        ports: list[int] = []
        for _ in range(count):
            sock = held.enter_context(socket.socket())
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
        return ports


@dataclass
class LocalRayCluster:
    """A Ray head on this machine: its addresses, its token, and (if we started it) its process."""

    dashboard_url: str
    gcs_address: str | None = None
    token: str | None = field(default=None, repr=False)
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    log_path: Path | None = None
    temp_dir: Path | None = None
    """Ray's temp dir (sessions, logs, sockets) of a head we started; None for one we found."""

    @property
    def owned(self) -> bool:
        """True when we started it (and so must stop it)."""
        return self.process is not None

    def block(self, **overrides: object) -> RayJobsCluster:
        """A RayJobsCluster block pointing at this cluster."""
        return RayJobsCluster(
            dashboard_url=self.dashboard_url,
            auth_token=self.token,
            **overrides,
        )

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the head we started: SIGTERM to `ray start --block` (it shuts Ray down), then
        SIGKILL to whatever is left of its session (Ray workers lead their own process groups,
        so killing the head's group alone would miss them)."""
        if self.process is not None:
            stop_session(self.process, timeout_s)

    def __enter__(self) -> LocalRayCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def stop_session(process: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    """Stop a `ray start --block` we started as a session leader (start_new_session): SIGTERM
    (it shuts its node down), then SIGKILL to whatever is left of its session."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
    kill_session(process.pid)


def kill_session(sid: int) -> None:
    """SIGKILL every process of session `sid`, returning once they are gone (10 s at most)."""
    for pid in session_members(sid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while session_members(sid) and time.monotonic() < deadline:
        time.sleep(0.1)  # SIGKILL is not instant


def session_members(sid: int) -> list[int]:
    """Live (non-zombie) process ids in session sid (Linux /proc; empty without /proc)."""
    members = []
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, IndexError):
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            if state != "Z" and os.getsid(int(entry.name)) == sid:
                members.append(int(entry.name))
    return members


def start_local_ray(
    *,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    resources: dict[str, float] | None = None,
    labels: dict[str, str] | None = None,
    token_auth: bool = True,
    object_store_bytes: int = 256 * 1024**2,
    timeout_s: float = 90.0,
    attempts: int = 3,
) -> LocalRayCluster:
    """Start a Ray head (dashboard on) on free ports and wait until it is up and its Jobs API
    answers. `ray start` gives its raylet a fixed 30 s to register; on a machine too busy for
    that it exits (having served its dashboard for a while), so that start is tried again."""
    args = (num_cpus, num_gpus, resources, labels, token_auth, object_store_bytes, timeout_s)
    for _ in range(attempts - 1):
        try:
            return _start_head(*args)
        except _StartTimedOut as exc:
            log.warning("local Ray head: %s; starting it again", exc)
    return _start_head(*args)


class _StartTimedOut(BackendUnavailable):
    """`ray start` gave up on its own start-up bound (a busy machine): worth another try."""


def _start_head(
    num_cpus: int | None,
    num_gpus: int | None,
    resources: dict[str, float] | None,
    labels: dict[str, str] | None,
    token_auth: bool,
    object_store_bytes: int,
    timeout_s: float,
) -> LocalRayCluster:
    """One `ray start --head --block` on free ports, waited for."""
    names = (
        "port",
        "dashboard-port",
        "dashboard-agent-listen-port",
        "dashboard-agent-grpc-port",
        "ray-client-server-port",
        "node-manager-port",
        "object-manager-port",
        "metrics-export-port",
        "runtime-env-agent-port",
    )
    ports = dict(zip(names, free_ports(len(names)), strict=True))
    bin_dir = Path(sys.executable).parent
    cmd = [
        str(bin_dir / "ray"),
        "start",
        "--head",
        "--block",
        "--disable-usage-stats",
        "--include-dashboard=true",
        "--dashboard-host=127.0.0.1",
        "--node-ip-address=127.0.0.1",
        f"--object-store-memory={object_store_bytes}",
        "--no-monitor",  # nothing autoscales a local head: its monitor only costs CPU
    ]
    cmd += [f"--{name}={port}" for name, port in ports.items()]
    if num_cpus is not None:
        cmd.append(f"--num-cpus={num_cpus}")
    if num_gpus is not None:
        cmd.append(f"--num-gpus={num_gpus}")
    if resources:
        cmd.append(f"--resources={json.dumps(resources)}")
    if labels:
        cmd.append("--labels=" + ",".join(f"{k}={v}" for k, v in labels.items()))

    token = secrets.token_hex(32) if token_auth else None
    env = {**LEAN_NODE_ENV, **os.environ}
    for var in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_TOKEN_PATH"):
        env.pop(var, None)
    # Jobs' entrypoint shells inherit this PATH: our interpreter must come first.
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["RAY_AUTH_MODE"] = "token" if token else "disabled"
    if token:
        env["RAY_AUTH_TOKEN"] = token
    if env.get("CUDA_VISIBLE_DEVICES") == "":
        del env["CUDA_VISIBLE_DEVICES"]  # an empty value hides logical GPUs from Ray

    # A temp dir of its own, not Ray's shared /tmp/ray: a job's driver finds its cluster through
    # the temp dir's ray_current_cluster (the job supervisor resolves RAY_ADDRESS "auto" there),
    # which names whichever head on this machine started last. Ray makes its temp dir and
    # everything below it world-readable (0777 directories, 0644 logs), and its logs hold what
    # jobs were given, secret env values included (runtime_env_agent.log): so it lives inside a
    # folder only we may enter (mkdtemp's 0700, which Ray never touches). Short, under /tmp:
    # Ray's unix socket paths live below it and must stay under 108 characters.
    private = Path(tempfile.mkdtemp(prefix="prefect-nemo-ray-", dir=_SHORT_TMP))
    temp_dir = private / "ray"
    cmd.append(f"--temp-dir={temp_dir}")
    log_path = private / "ray-start.log"
    with open(log_path, "wb") as log:  # the child keeps its own descriptor
        process = subprocess.Popen(
            cmd,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    cluster = LocalRayCluster(
        dashboard_url=f"http://127.0.0.1:{ports['dashboard-port']}",
        gcs_address=f"127.0.0.1:{ports['port']}",
        token=token,
        process=process,
        log_path=log_path,
        temp_dir=temp_dir,
    )
    try:
        _wait_until_serving(cluster, timeout_s)
    except BaseException:
        cluster.stop()
        raise
    return cluster


_SHORT_TMP = "/tmp" if os.path.isdir("/tmp") else None

# what `ray start --block` prints once every process of the node is up (the dashboard answers
# before that: a start that fails later takes it down again)
_STARTED = "Ray runtime started."
_RAY_GAVE_UP = "timed out during startup"


def _wait_until_serving(cluster: LocalRayCluster, timeout_s: float) -> None:
    headers = {"Authorization": f"Bearer {cluster.token}"} if cluster.token else {}
    deadline = time.monotonic() + timeout_s
    log_path = cluster.log_path
    while time.monotonic() < deadline:
        if cluster.process is not None and cluster.process.poll() is not None:
            tail = log_path.read_text()[-2000:] if log_path else ""
            if _RAY_GAVE_UP in tail:
                raise _StartTimedOut(f"ray start {_RAY_GAVE_UP} (log: {log_path})")
            raise BackendUnavailable(f"local Ray head exited during start-up:\n{tail}")
        try:
            # /api/jobs/ answers only once the job manager is up, not just the HTTP server.
            if (log_path is None or _STARTED in log_path.read_text()) and requests.get(
                f"{cluster.dashboard_url}/api/jobs/", headers=headers, timeout=2
            ).ok:
                return
        except requests.RequestException:
            pass
        time.sleep(0.3)
    raise BackendUnavailable(
        f"local Ray head did not serve its Jobs API within {timeout_s:g}s (log: {cluster.log_path})"
    )


def find_local_ray(dashboard_url: str | None = None) -> LocalRayCluster | None:
    """A Ray cluster the user already runs on this machine, if its Jobs API lets us in.

    Looks at `dashboard_url`, then $RAY_API_SERVER_ADDRESS / $RAY_ADDRESS when they are http
    URLs, then the default dashboard port; the token comes from Ray's own places
    ($RAY_AUTH_TOKEN, $RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token).
    """
    configured = [dashboard_url] + [
        os.environ.get(v) for v in ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS")
    ]  # fmt: skip
    token = _ray_token()
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    for url in [*configured, DEFAULT_DASHBOARD]:
        if not url or not url.startswith(("http://", "https://")):
            continue
        # an address someone named gets time to answer from a busy head (CI: 2 s was too
        # short, and a second cluster was started); the guessed default port only a glance
        named = url in configured
        timeout = CONFIGURED_PROBE_S if named else DEFAULT_PROBE_S
        try:
            answer = requests.get(f"{url.rstrip('/')}/api/jobs/", headers=headers, timeout=timeout)
        except requests.RequestException as exc:
            if named:
                log.warning("Ray at %s does not answer (%s)", url, type(exc).__name__)
            continue
        if answer.ok:
            return LocalRayCluster(dashboard_url=url.rstrip("/"), token=token)
        if named:
            log.warning("Ray at %s refused us (HTTP %s)", url, answer.status_code)
    return None


def _ray_token() -> str | None:
    if token := os.environ.get("RAY_AUTH_TOKEN"):
        return token.strip()
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


_default: LocalRayCluster | None = None
_default_lock = threading.Lock()


def default_local_cluster() -> LocalRayCluster:
    """The cluster used when none is configured: a running local one, else one we start.

    One per process; a cluster we start is stopped when the process exits.
    """
    global _default
    with _default_lock:
        if _default is None or (_default.owned and _default.process.poll() is not None):  # type: ignore[union-attr]
            _default = find_local_ray()
            if _default is None:
                log.info("no Ray cluster configured or running: starting a local one")
                _default = start_local_ray()
                atexit.register(_default.stop)
        return _default


def default_cluster() -> RayJobsCluster:
    """The block of the default local cluster (see default_local_cluster)."""
    return default_local_cluster().block()


def stop_default() -> int | None:
    """Stop the default cluster if this process started it (a reused one is left running).

    Returns the process id of the head it stopped, if any.
    """
    global _default
    with _default_lock:
        stopped = None
        if _default is not None and _default.process is not None:
            stopped = _default.process.pid
            _default.stop()
        _default = None
        return stopped
