"""A real Slurm cluster and an sshd on loopback, for tests (Debian packages, run as root).

`LocalSlurm().start()` runs munged, MariaDB, slurmdbd, slurmctld, two slurmd (two nodes on this one
machine: Slurm's multiple-slurmd mode, `slurmd -N <node>`) and an sshd on a free 127.0.0.1 port
under one supervisor process, configured from files under a state dir (default
/tmp/prefect-nemo-slurm; Slurm's own config has to live in /etc/slurm, where clients look for it).
The supervisor is a child subreaper: slurmstepd and job processes that outlive their parents are
reaped by it (PID 1 here reaps nothing), and on SIGTERM it stops every daemon it started and kills
what is left under it. A cluster already running from the same state dir is reused, not restarted,
as long as its slurm.conf is the one this version writes (else it is restarted once no other
LocalSlurm is attached: new nodes and PreemptType need restarted daemons, not a reconfigure).

Partitions: the default one (`partition`) holds the first node only (one-node jobs always land
there); `multi_partition` holds the first two, for multi-node jobs (Ray on Slurm). Two more nodes
of one CPU each stand for a busy shared cluster: `queue_partition` has room for one job at a time
(the others wait, PENDING with reason Resources or Priority, `squeue --start` estimating when),
and `low_partition` / `high_partition` share a node under `PreemptType=preempt/partition_prio`:
a high job requeues the low one (`PreemptMode=REQUEUE`), which runs again after it. Jobs there
get a 10-minute time limit unless they ask (backfill estimates start times from time limits).

`stop()` stops only a cluster this object started, and leaves it running while another
LocalSlurm (in any process) is still attached. One cluster per machine (Slurm's config is
global). Stop one left running with `python -m prefect_nemo.testing.slurm stop`.

This file imports only the standard library: the supervisor runs it as a script (no package import).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

DEFAULT_STATE_DIR = Path("/tmp/prefect-nemo-slurm")
SLURM_CONF_DIR = Path("/etc/slurm")
MARKER = "# written by prefect_nemo.testing.slurm; state in "
MUNGE_SOCKET = Path("/run/munge/munge.socket.2")
# The executables the cluster needs; missing ones mean `make system` has not run (as root).
REQUIRED_BINARIES = (
    "munged",
    "munge",
    "mariadbd",
    "mariadb-install-db",
    "mariadb",
    "slurmdbd",
    "slurmctld",
    "slurmd",
    "sbatch",
    "sacctmgr",
    "sshd",
    "ssh",
    "ssh-keygen",
    "rsync",
)
# each slurmd's port, in the state file and in the order of _node_names
_SLURMD_PORTS = ("slurmd", "slurmd2", "slurmd3", "slurmd4")
_SBIN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
PR_SET_CHILD_SUBREAPER = 36


def missing_binaries() -> list[str]:
    """The executables of REQUIRED_BINARIES not installed on this machine."""
    return [name for name in REQUIRED_BINARIES if shutil.which(name, path=_SBIN_PATH) is None]


def unavailable_reason() -> str | None:
    """Why a LocalSlurm cannot start here (not root, packages missing), or None when it can."""
    if os.geteuid() != 0:
        return "the local Slurm cluster runs its daemons as root; run the tests as root"
    missing = missing_binaries()
    if missing:
        return f"missing {', '.join(missing)}: run `make system` as root to install Slurm and sshd"
    return None


def _pid_alive(pid: int) -> bool:
    """True when pid names a running process (a zombie counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _supervisor_alive(state: dict[str, Any] | None) -> bool:
    """True when the supervisor that `state` records still runs. Its pid alone is not enough:
    after a reboot (or a long uptime) the pid of a supervisor that is long gone names some other
    process, which a stop would then signal; so its command line must still be our supervisor's,
    for this state dir."""
    if not state or not _pid_alive(pid := state.get("supervisor_pid", 0)):
        return False
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    state_dir = json.dumps(str(state.get("state_dir", ""))).encode()  # as the spec argument has it
    return b"_supervise" in argv and any(state_dir in arg for arg in argv)


def _port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as sock:
        sock.settimeout(1.0)
        return sock.connect_ex((host, port)) == 0


def _run(
    args: list[str], *, input: str | None = None, check: bool = True, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args,
        input=input,
        capture_output=True,
        text=True,
        check=check,
        timeout=timeout,
        env=dict(os.environ, PATH=_SBIN_PATH + ":" + os.environ.get("PATH", "")),
    )


def _tail(path: Path, lines: int = 20) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    """Write text atomically with the given mode."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.chmod(mode)
    tmp.replace(path)


@dataclass
class LocalSlurm:
    """A two-node Slurm cluster (one machine) with accounting and an sshd on 127.0.0.1."""

    state_dir: Path = DEFAULT_STATE_DIR
    cluster: str = "prefectnemo"
    partition: str = "debug"
    multi_partition: str = "multi"
    queue_partition: str = "queue"
    low_partition: str = "low"
    high_partition: str = "high"
    account: str = "nemo"
    host: str = "127.0.0.1"
    user: str = "root"
    port: int = 0
    owned: bool = False
    _supervisor: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _users: IO[str] | None = field(default=None, repr=False)  # our shared lock on state_dir/users

    def __post_init__(self) -> None:
        self.state_dir = Path(self.state_dir)

    # -- where things are ---------------------------------------------------------------------

    @property
    def identity(self) -> Path:
        """The client's private ed25519 key, authorized for root on the sshd."""
        return self.state_dir / "ssh" / "id_ed25519"

    @property
    def known_hosts(self) -> Path:
        """A known_hosts file holding the sshd's host key for [127.0.0.1]:port."""
        return self.state_dir / "ssh" / "known_hosts"

    @property
    def node(self) -> str:
        """The first compute node's name (`hostname -s`), the default partition's only node."""
        return socket.gethostname().split(".")[0]

    @property
    def nodes(self) -> list[str]:
        """The multi partition's two compute nodes (slurmd daemons on this machine)."""
        return _node_names(self.node)[:2]

    @property
    def queue_node(self) -> str:
        """The queue partition's one node: one CPU, so one job at a time."""
        return _node_names(self.node)[2]

    @property
    def preempt_node(self) -> str:
        """The node the low and high partitions share: one CPU, so a high job preempts."""
        return _node_names(self.node)[3]

    @property
    def all_nodes(self) -> list[str]:
        """Every compute node of the cluster."""
        return _node_names(self.node)

    @property
    def log_dir(self) -> Path:
        """The daemons' log files."""
        return self.state_dir / "log"

    @property
    def _state_file(self) -> Path:
        return self.state_dir / "state.json"

    def ssh_command(self, *remote: str) -> list[str]:
        """argv for `ssh` to the sshd with our key and known_hosts (no prompts), then remote."""
        return [
            "ssh",
            "-p",
            str(self.port),
            "-i",
            str(self.identity),
            "-o",
            f"UserKnownHostsFile={self.known_hosts}",
            "-o",
            "StrictHostKeyChecking=yes",
            "-o",
            "BatchMode=yes",
            "-o",
            "IdentitiesOnly=yes",
            f"{self.user}@{self.host}",
            *remote,
        ]

    # -- life cycle ---------------------------------------------------------------------------

    def start(self, timeout_s: float = 180.0) -> LocalSlurm:
        """Start the cluster (or attach to the one already running from state_dir); returns self."""
        reason = unavailable_reason()
        if reason:
            from prefect_nemo.errors import BackendUnavailable

            raise BackendUnavailable(reason)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.state_dir.chmod(0o700)  # keys and the database password live here
        with self._lock("lock", fcntl.LOCK_EX):  # one starter or stopper at a time
            state = self._read_state()
            healthy = bool(state) and self._healthy(state)  # type: ignore[arg-type]
            if state and healthy and self._current(state):
                self.port = state["ports"]["ssh"]
                self.owned = False
            else:
                if healthy:  # runs an older slurm.conf: restart it, but not under anyone's feet
                    self._wait_unused(timeout_s)
                if _supervisor_alive(state):
                    _terminate_supervisor(state["supervisor_pid"])  # ours, but broken: restart
                self._spawn(state, timeout_s)
            # every user holds a shared lock, so the starter can see that others still need it
            self._users = open(self.state_dir / "users", "a")  # held until stop()
            fcntl.flock(self._users, fcntl.LOCK_SH)
        return self

    @contextlib.contextmanager
    def _lock(self, name: str, how: int) -> Iterator[IO[str]]:
        with open(self.state_dir / name, "a") as handle:
            fcntl.flock(handle, how)
            yield handle

    def _wait_unused(self, timeout_s: float) -> None:
        """Wait until no other LocalSlurm is attached (each holds a shared lock on `users`);
        a cluster restarted under a running test session would fail its jobs."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with self._lock("users", fcntl.LOCK_EX | fcntl.LOCK_NB):
                    return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the local Slurm of {self.state_dir} runs an older slurm.conf and is "
                        f"still in use after {timeout_s:.0f}s; once its users are done, stop it "
                        "(`python -m prefect_nemo.testing.slurm stop`) or start again"
                    ) from None
                time.sleep(1.0)

    def _spec(self, ports: dict[str, int]) -> dict[str, Any]:
        """What the supervisor is started with, and what slurm.conf is written from."""
        return {
            "state_dir": str(self.state_dir),
            "cluster": self.cluster,
            "partition": self.partition,
            "multi_partition": self.multi_partition,
            "queue_partition": self.queue_partition,
            "low_partition": self.low_partition,
            "high_partition": self.high_partition,
            "account": self.account,
            "user": self.user,
            "ports": ports,
        }

    def _spawn(self, previous: dict[str, Any] | None, timeout_s: float) -> None:
        # imported here, not at the top: the supervisor runs this file as a script, and the
        # package's import (Prefect's, through blocks) took it ~20 s on a busy machine
        from prefect_nemo.local_ray import free_port

        old_ports = (previous or {}).get("ports", {})
        ports = {
            name: (p if (p := old_ports.get(name)) and not _port_open(p) else free_port())
            for name in ("ssh", "slurmctld", *_SLURMD_PORTS, "slurmdbd", "mysql")
        }
        spec = self._spec(ports)
        self._state_file.unlink(missing_ok=True)
        self.log_dir.mkdir(exist_ok=True)
        with open(self.log_dir / "supervisor.log", "ab") as out:
            self._supervisor = subprocess.Popen(
                [sys.executable, "-I", __file__, "_supervise", json.dumps(spec)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C in the test run must not reach the daemons
                close_fds=True,
                # machine-wide daemons must not keep the starting run's directory: once it is
                # deleted, every job's output begins "slurmstepd: error: Unable to get current
                # working directory"
                cwd="/",
            )
        self.owned = True
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = self._read_state()
            if state and state.get("ready"):
                self.port = ports["ssh"]
                return
            if (state and state.get("error")) or self._supervisor.poll() is not None:
                self._terminate(30)
                error = (state or {}).get("error", "the supervisor exited")
                raise RuntimeError(
                    f"local Slurm did not start: {error}\n{_tail(self.log_dir / 'supervisor.log')}"
                )
            time.sleep(0.2)
        self._terminate(30)
        raise TimeoutError(
            f"local Slurm not up after {timeout_s:.0f}s; logs in {self.log_dir}\n"
            f"{_tail(self.log_dir / 'supervisor.log')}"
        )

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stop the cluster if this object started it and no other LocalSlurm (in any process)
        is attached to it; otherwise leave it running. Stops it by the supervisor's pid."""
        if self._users is not None:
            self._users.close()
            self._users = None
        if self._supervisor is None:
            return
        with self._lock("lock", fcntl.LOCK_EX):
            try:
                with self._lock("users", fcntl.LOCK_EX | fcntl.LOCK_NB):
                    self._terminate(timeout_s)
            except BlockingIOError:  # another session still uses it: hand it over, running
                self._supervisor = None
                self.owned = False

    def _terminate(self, timeout_s: float) -> None:
        proc, self._supervisor = self._supervisor, None
        self.owned = False
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)

    def __enter__(self) -> LocalSlurm:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _read_state(self) -> dict[str, Any] | None:
        try:
            return json.loads(self._state_file.read_text())
        except (OSError, ValueError):
            return None

    def _healthy(self, state: dict[str, Any]) -> bool:
        """True when the recorded cluster answers: supervisor alive, slurmctld up, sshd open."""
        return (
            bool(state.get("ready"))
            and _supervisor_alive(state)
            and _port_open(state["ports"]["ssh"])
            and _run(["scontrol", "ping"], check=False, timeout=20).returncode == 0
        )

    def _current(self, state: dict[str, Any]) -> bool:
        """True when the running cluster's slurm.conf is the one this version would write for
        it (same nodes, partitions and settings): an older one is restarted, not reused."""
        try:
            wanted = _slurm_conf(self._spec(state["ports"]))
            return (SLURM_CONF_DIR / "slurm.conf").read_text() == wanted
        except (OSError, KeyError):  # no config, or ports of an older layout (fewer nodes)
            return False

    # -- using it -----------------------------------------------------------------------------

    def run(
        self, cmd: str | list[str], *, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """Run a command here (sbatch, sacct, squeue, ...); a string goes through the shell."""
        if isinstance(cmd, str):
            cmd = ["bash", "-c", cmd]
        return _run(cmd, check=check, timeout=timeout)

    def job(self, job_id: str) -> dict[str, str]:
        """The job's allocation row in sacct (State, ExitCode, ...); {} until recorded.
        slurmdbd fills JobName and Partition in a moment after the first State it shows."""
        fields = ("JobID", "JobName", "State", "ExitCode", "Reason", "Account", "Partition")
        out = self.run(
            ["sacct", "-X", "-n", "-P", "-j", job_id, "-o", ",".join(fields)], check=False
        )
        for line in out.stdout.splitlines():
            row = dict(zip(fields, line.split("|"), strict=False))
            if row.get("JobID") == job_id:
                return row
        return {}

    def wait_job(
        self, job_id: str, states: tuple[str, ...], timeout_s: float = 60
    ) -> dict[str, str]:
        """Wait until sacct shows the job in one of states (e.g. COMPLETED, FAILED); its row."""
        deadline = time.monotonic() + timeout_s
        row: dict[str, str] = {}
        while time.monotonic() < deadline:
            row = self.job(job_id)
            if row.get("State", "").split(" ")[0] in states:
                return row
            time.sleep(0.3)
        raise TimeoutError(f"job {job_id} not in {states} after {timeout_s}s: {row}")

    def site_bin(self, ray: Path) -> Path:
        """A bin dir to put first on a job's PATH, standing in for what a GPU site has and
        this machine lacks, for NeMo-Run's container jobs and its Ray-on-Slurm batch script
        (`ray.sub.j2`): srun takes pyxis' container options (no container runtime here: the
        step runs on the host, its --container-mounts bind-mounted in its own mount
        namespace), `scontrol show job --json` (Slurm 23.02; this is 22.05) and, since both
        nodes are this one host, a worker's `ray start` takes the head's fixed ports + 100.
        `ray` is the Ray executable the nodes run. (No PMIx library either: --mpi=pmix goes.)"""
        bin_dir = self.state_dir / "site-bin"
        bin_dir.mkdir(exist_ok=True)
        for name, text in _site_shims(ray).items():
            _write(bin_dir / name, text, 0o755)
        return bin_dir

    def wait_idle(self, timeout_s: float = 60) -> None:
        """Wait until no job is queued or running and every node is idle."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            queued = self.run(["squeue", "-h", "-o", "%i"], check=False).stdout.split()
            node = self.run(
                ["sinfo", "-h", "-N", "-n", ",".join(self.all_nodes), "-o", "%T"], check=False
            ).stdout
            states = {line.strip().rstrip("*~#") for line in node.splitlines()}
            if not queued and states == {"idle"}:
                return
            time.sleep(0.3)
        raise TimeoutError(f"Slurm not idle after {timeout_s}s: queued={queued} node={node!r}")


def _terminate_supervisor(pid: int, timeout_s: float = 60.0) -> None:
    """SIGTERM a supervisor that is not our child (a cluster left running), wait until gone."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while _pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _pid_alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)


# -- the supervisor (a separate process: `python slurm.py _supervise <spec>`) --------------------


class _Supervisor:
    """Starts the daemons in order, reaps everything under it, stops it all on SIGTERM."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.dir = Path(spec["state_dir"])
        self.ports: dict[str, int] = spec["ports"]
        self.logs = self.dir / "log"
        self.run_dir = self.dir / "run"
        self.ssh_dir = self.dir / "ssh"
        self.node = socket.gethostname().split(".")[0]
        self.daemons: list[tuple[str, int]] = []  # (name, pid), in start order
        self.exited: dict[int, int] = {}  # reaped pid -> wait status
        self.stopping = False

    # process bookkeeping: we reap with waitpid(-1), so Popen's own polling is never used
    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.exited[pid] = status

    def alive(self, pid: int) -> bool:
        self.reap()
        return pid not in self.exited

    def spawn(self, name: str, args: list[str], **kwargs: Any) -> int:
        with open(self.logs / f"{name}.out", "ab") as out:
            proc = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, **kwargs
            )
        self.daemons.append((name, proc.pid))
        print(f"started {name} pid {proc.pid}", flush=True)
        return proc.pid

    def wait_for(self, what: str, ready: Any, pid: int | None, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.stopping:
                raise RuntimeError("stopped while starting")
            if pid is not None and not self.alive(pid):
                name = next(n for n, p in self.daemons if p == pid)
                raise RuntimeError(
                    f"{name} exited while starting; its log:\n"
                    f"{_tail(self.logs / f'{name}.log') or _tail(self.logs / f'{name}.out')}"
                )
            if ready():
                return
            time.sleep(0.2)
        raise RuntimeError(f"{what} not ready after {timeout_s}s (logs in {self.logs})")

    def write_state(self, **extra: Any) -> None:
        state = {"supervisor_pid": os.getpid(), "ports": self.ports, **self.spec, **extra}
        _write(self.dir / "state.json", json.dumps(state, indent=1), 0o600)

    # -- main ---------------------------------------------------------------------------------

    def main(self) -> int:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # orphans below us come to us to be reaped
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        code = 0
        try:
            for sub in ("log", "run", "ssh", "ctld", "slurmd"):
                (self.dir / sub).mkdir(parents=True, exist_ok=True)
            started = time.monotonic()
            self.start_munge()
            self.start_mariadb()
            self.start_slurmdbd()
            self.start_slurmctld()
            self.start_slurmd()
            self.start_sshd()
            print(f"ready in {time.monotonic() - started:.1f}s", flush=True)
            self.write_state(ready=True)
            while not self.stopping:
                self.reap()
                dead = [name for name, pid in self.daemons if pid in self.exited]
                if dead:
                    print(f"{', '.join(dead)} exited; stopping the cluster", flush=True)
                    code = 1
                    break
                time.sleep(0.5)
        except Exception as exc:
            print(f"start failed: {exc}", flush=True)
            self.write_state(ready=False, error=str(exc))
            code = 1
        finally:
            self.teardown()
        return code

    def _on_signal(self, signum: int, frame: object) -> None:
        self.stopping = True

    def teardown(self) -> None:
        for name, pid in reversed(self.daemons):
            if not self.alive(pid):
                continue
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 20
            while self.alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if self.alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            print(f"stopped {name}", flush=True)
        # whatever is left under us (job steps, their children) goes too, reaped as it dies
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            children = _children(os.getpid())
            if not children:
                break
            for pid in children:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)
            self.reap()
        with contextlib.suppress(OSError, ValueError):
            state = json.loads((self.dir / "state.json").read_text())
            if state.get("supervisor_pid") == os.getpid() and state.get("ready"):
                self.write_state(ready=False)  # kept: the next start reuses these ports

    # -- the daemons --------------------------------------------------------------------------

    def start_munge(self) -> None:
        if _munge_works():
            print("munged already running; using it", flush=True)
            return
        run_dir = MUNGE_SOCKET.parent
        run_dir.mkdir(parents=True, exist_ok=True)
        shutil.chown(run_dir, "munge", "munge")
        run_dir.chmod(0o755)
        pid = self.spawn(
            "munged",
            ["munged", "--foreground", f"--log-file={self.logs / 'munged.log'}"],
            user="munge",
            group="munge",
            extra_groups=[],
        )
        (self.logs / "munged.log").touch()
        shutil.chown(self.logs / "munged.log", "munge", "munge")
        self.wait_for("munged", _munge_works, pid, 30)

    def start_mariadb(self) -> None:
        datadir = self.dir / "mysql"
        sock = self.run_dir / "mysql.sock"
        if not (datadir / "mysql").is_dir():
            shutil.rmtree(datadir, ignore_errors=True)
            _run(
                [
                    "mariadb-install-db",
                    "--no-defaults",
                    "--user=root",
                    f"--datadir={datadir}",
                    "--auth-root-authentication-method=socket",
                    "--skip-test-db",
                ],
                timeout=120,
            )
        pid = self.spawn(
            "mariadb",
            [
                "mariadbd",
                "--no-defaults",
                "--user=root",
                f"--datadir={datadir}",
                f"--socket={sock}",
                f"--port={self.ports['mysql']}",
                "--bind-address=127.0.0.1",
                "--skip-name-resolve",
                f"--pid-file={self.run_dir / 'mariadb.pid'}",
                f"--log-error={self.logs / 'mariadb.log'}",
                "--innodb-buffer-pool-size=64M",
                "--innodb-lock-wait-timeout=900",  # slurmdbd asks for it
                "--max-connections=50",
            ],
        )

        def sql(statements: str) -> subprocess.CompletedProcess[str]:
            cmd = ["mariadb", "--no-defaults", f"--socket={sock}", "-u", "root", "-N", "-B"]
            return _run(cmd, input=statements, check=False)

        self.wait_for("mariadb", lambda: sql("SELECT 1;").returncode == 0, pid, 60)
        password_file = self.dir / "db_password"
        if not password_file.exists():
            _write(password_file, secrets.token_hex(16), 0o600)
        self.db_password = password_file.read_text().strip()
        user = "'slurm'@'127.0.0.1'"
        result = sql(
            "CREATE DATABASE IF NOT EXISTS slurm_acct_db;"
            f"CREATE USER IF NOT EXISTS {user} IDENTIFIED BY '{self.db_password}';"
            f"ALTER USER {user} IDENTIFIED BY '{self.db_password}';"
            f"GRANT ALL ON slurm_acct_db.* TO {user};"
        )
        if result.returncode:
            raise RuntimeError(f"mariadb setup failed: {result.stderr}")

    def start_slurmdbd(self) -> None:
        self.write_slurm_conf()
        conf = f"""{MARKER}{self.dir}
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort={self.ports["slurmdbd"]}
SlurmUser=root
LogFile={self.logs / "slurmdbd.log"}
PidFile={self.run_dir / "slurmdbd.pid"}
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={self.ports["mysql"]}
StorageUser=slurm
StoragePass={self.db_password}
StorageLoc=slurm_acct_db
"""
        _write(SLURM_CONF_DIR / "slurmdbd.conf", conf, 0o600)  # slurmdbd insists on 0600
        pid = self.spawn("slurmdbd", ["slurmdbd", "-D"])
        self.wait_for(
            "slurmdbd",
            lambda: _run(["sacctmgr", "-n", "-P", "show", "cluster"], check=False).returncode == 0,
            pid,
            60,
        )
        cluster, account, user = self.spec["cluster"], self.spec["account"], self.spec["user"]
        self.sacctmgr_add("cluster", cluster, [])
        self.sacctmgr_add("account", account, [f"Cluster={cluster}", "Description=tests"])
        # the user's association with our account, so `--account` passes the enforced check
        assoc = ["show", "assoc", f"cluster={cluster}", f"account={account}", f"user={user}"]
        shown = _run(["sacctmgr", "-n", "-P", *assoc, "format=User"], check=False).stdout.split()
        if user not in shown:
            _run(
                ["sacctmgr", "-i", "add", "user", user, f"Account={account}", f"Cluster={cluster}"]
            )

    def sacctmgr_add(self, kind: str, name: str, options: list[str]) -> None:
        """`sacctmgr add kind name options` unless it exists (a second add is an error)."""
        shown = _run(["sacctmgr", "-n", "-P", "show", kind, name, "format=" + kind], check=False)
        if name not in shown.stdout.split():
            _run(["sacctmgr", "-i", "add", kind, name, *options])

    def write_slurm_conf(self) -> None:
        path = SLURM_CONF_DIR / "slurm.conf"
        if path.exists():
            first_line = path.read_text().split("\n", 1)[0]
            if not first_line.startswith(MARKER):
                raise RuntimeError(f"{path} exists and was not written by us; not overwriting it")
            other = Path(first_line.removeprefix(MARKER))
            if other != self.dir and _cluster_running(other):
                raise RuntimeError(f"the local Slurm of {other} is running: one per machine")
        conf = _slurm_conf(self.spec)
        SLURM_CONF_DIR.mkdir(parents=True, exist_ok=True)
        _write(path, conf, 0o644)

    def start_slurmctld(self) -> None:
        pid = self.spawn("slurmctld", ["slurmctld", "-D"])
        self.wait_for(
            "slurmctld", lambda: _run(["scontrol", "ping"], check=False).returncode == 0, pid, 60
        )

    def start_slurmd(self) -> None:
        for name, daemon in zip(_node_names(self.node), _SLURMD_PORTS, strict=True):
            (self.dir / "slurmd" / name).mkdir(parents=True, exist_ok=True)
            pid = self.spawn(daemon, ["slurmd", "-D", "-N", name])
            self.wait_for(daemon, functools.partial(_node_up, name, set()), pid, 60)

    def start_sshd(self) -> None:
        host_key = self.ssh_dir / "ssh_host_ed25519_key"
        client_key = self.ssh_dir / "id_ed25519"
        for key, comment in ((host_key, "prefect-nemo-sshd"), (client_key, "prefect-nemo-tests")):
            if not key.exists():
                _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(key)])
        _write(self.ssh_dir / "authorized_keys", client_key.with_suffix(".pub").read_text(), 0o600)
        # A session's home of its own: bash sources ~/.bashrc for a command sent over ssh
        # (Debian builds it with SSH_SOURCE_BASHRC), and a machine user's bashrc is not the
        # cluster's: with `pyenv init` in it, each command started ~100 processes and took
        # 0.35 s more (CI run 50: 138,000 processes in the extras phase).
        home = self.dir / "home"
        home.mkdir(mode=0o700, exist_ok=True)
        config = f"""{MARKER}{self.dir}
Port {self.ports["ssh"]}
ListenAddress 127.0.0.1
HostKey {host_key}
PidFile {self.run_dir / "sshd.pid"}
AuthorizedKeysFile {self.ssh_dir / "authorized_keys"}
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
# the key files sit under /tmp, which StrictModes would reject
StrictModes no
PrintMotd no
Subsystem sftp /usr/lib/openssh/sftp-server
SetEnv HOME={home}
"""
        _write(self.ssh_dir / "sshd_config", config, 0o600)
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation dir
        pid = self.spawn(
            "sshd", ["/usr/sbin/sshd", "-D", "-e", "-f", str(self.ssh_dir / "sshd_config")]
        )
        self.wait_for("sshd", lambda: _port_open(self.ports["ssh"]), pid, 30)
        key_type, key_b64 = host_key.with_suffix(".pub").read_text().split()[:2]
        names = [f"[127.0.0.1]:{self.ports['ssh']}", f"[localhost]:{self.ports['ssh']}"]
        entries = "".join(f"{name} {key_type} {key_b64}\n" for name in names)
        _write(self.ssh_dir / "known_hosts", entries, 0o644)
        # ssh and rsync (as NeMo-Run calls them) read only the user's own known_hosts
        user_known = Path.home() / ".ssh" / "known_hosts"
        user_known.parent.mkdir(mode=0o700, exist_ok=True)
        kept = []
        if user_known.exists():
            kept = [
                line
                for line in user_known.read_text().splitlines(keepends=True)
                if line.split(" ", 1)[0] not in names
            ]
        _write(user_known, "".join(kept) + entries, 0o600)


def _site_shims(ray: Path) -> dict[str, str]:
    """The scripts of `LocalSlurm.site_bin`, by name."""
    srun = """#!/bin/bash
# pyxis stand-in (no container runtime here: steps run on the host): --container-mounts become
# bind mounts in the step's own mount namespace, --container-workdir its working directory;
# the other container options are dropped, --mpi=pmix too (the PMIx library is not here)
args=() mounts="" workdir=""
while (($#)); do
  case "$1" in
    --container-mounts) mounts=$2; shift ;;
    --container-mounts=*) mounts=${1#*=} ;;
    --container-workdir) workdir=$2; shift ;;
    --container-workdir=*) workdir=${1#*=} ;;
    --container-image|--container-name) shift ;;
    --container-*|--no-container-mount-home|--mpi=pmix) ;;
    -o|-e|-w|-J|-N|-n|-c|--output|--error|--nodelist|--job-name|--jobid) args+=("$1" "$2"); shift ;;
    -*) args+=("$1") ;;
    *) break ;;
  esac
  shift
done
[[ -z $mounts && -z $workdir ]] && exec /usr/bin/srun "${args[@]}" "$@"
exec /usr/bin/srun "${args[@]}" unshare --mount --propagation private /bin/bash -c '
IFS=, read -ra list <<< "$1"
for m in "${list[@]}"; do
  src=${m%%:*} dst=${m#*:}; dst=${dst%%:*}
  mkdir -p "$dst" && mount --bind "$src" "$dst" || exit 1
done
[[ -z $2 ]] || cd "$2" || exit 1
shift 2
exec "$@"' pyxis "$mounts" "$workdir" "$@"
"""
    scontrol = """#!/bin/bash
# `scontrol show job <id> --json` (Slurm 23.02): the one field NeMo-Run's Ray script reads
if [[ "$1 $2" == "show job" && "$4" == "--json" ]]; then
  dir=$(/usr/bin/scontrol show job "$3" | sed -n 's/^ *WorkDir=//p')
  printf '{"jobs": [{"current_working_directory": "%s"}]}\\n' "$dir"
  exit 0
fi
exec /usr/bin/scontrol "$@"
"""
    ray_start = f"""#!/bin/bash
# both Slurm nodes are this host: a worker node's fixed ports are the head's + 100
args=()
if [[ "$1" == start && " $* " != *" --head "* ]]; then
  for a in "$@"; do
    if [[ $a =~ ^(--[a-z-]+-port)=([0-9]+)$ ]]; then
      a="${{BASH_REMATCH[1]}}=$((BASH_REMATCH[2] + 100))"
    fi
    args+=("$a")
  done
else
  args=("$@")
fi
[[ "$1" == start ]] || exec {ray} "${{args[@]}}"
# proctrack/linuxproc tracks by parentage: once Slurm's SIGTERM kills the step's shells, ray
# start and its daemons are orphans it no longer sees. As proctrack/cgroup would, take the
# whole task (its process group) down with the signal.
trap 'kill -KILL -- -$(ps -o pgid= $$ | tr -d " ")' TERM INT HUP
{ray} "${{args[@]}}" &
wait $!
"""
    return {"srun": srun, "scontrol": scontrol, "ray": ray_start}


def _node_names(first: str) -> list[str]:
    """The cluster's nodes, all on this host: its short name (the default partition's), -2
    (with the first, the multi partition's), -3 (the queue partition's) and -4 (the low and
    high partitions')."""
    return [first, f"{first}-2", f"{first}-3", f"{first}-4"]


def _slurm_conf(spec: dict[str, Any]) -> str:
    """slurm.conf for the cluster of `spec` (the supervisor's): written at start, and compared
    with the one in /etc/slurm to tell whether a running cluster is this version's."""
    state_dir = Path(spec["state_dir"])
    logs, run_dir, p = state_dir / "log", state_dir / "run", spec["ports"]
    host = socket.gethostname().split(".")[0]
    cpus = os.cpu_count() or 1
    mem_mb = _mem_total_mb() * 9 // 10
    first, second, queue_node, preempt_node = _node_names(host)
    # the queue and preemption nodes get one CPU each: one job at a time, whatever the machine
    node_cpus = (cpus, cpus, 1, 1)
    nodes = "\n".join(
        f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={p[port]} "
        f"CPUs={n} RealMemory={mem_mb} State=UNKNOWN"
        for name, port, n in zip(_node_names(host), _SLURMD_PORTS, node_cpus, strict=True)
    )
    return f"""{MARKER}{state_dir}
ClusterName={spec["cluster"]}
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={p["slurmctld"]}
SlurmdPort={p["slurmd"]}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CryptoType=crypto/munge
# a requeued job may start again only once its old credential expired (120 s by default);
# 5 s is Slurm's minimum, 20 s leaves a busy machine time to launch a step
AuthInfo=cred_expire=20
StateSaveLocation={state_dir / "ctld"}
# four slurmd on this host (multiple-slurmd): each node's own port, spool, pid and log
SlurmdSpoolDir={state_dir / "slurmd" / "%n"}
SlurmctldPidFile={run_dir / "slurmctld.pid"}
SlurmdPidFile={run_dir / "slurmd-%n.pid"}
SlurmctldLogFile={logs / "slurmctld.log"}
SlurmdLogFile={logs / "slurmd-%n.log"}
# no cgroups here: track processes by parentage, no task binding
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# quick scheduling and cancelling, so tests do not wait on defaults meant for big clusters
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
KillWait=2
MinJobAge=600
ReturnToService=2
InactiveLimit=0
MessageTimeout=10
MpiDefault=none
MailProg=/bin/true
# a job of a higher PriorityTier partition preempts those of lower tiers on its nodes: only the
# low partition's are ever preempted (high is the top tier, the others say PreemptMode=OFF), and
# they are requeued (batch jobs may be: JobRequeue=1, the default, said for the reader)
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
JobRequeue=1
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort={p["slurmdbd"]}
# limits: the QOS submit limits the pushback test sets are enforced (none is set by default)
AccountingStorageEnforce=associations,limits
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=5
JobCompType=jobcomp/none
{nodes}
# several jobs share a core, so dependency chains and parallel tests fit on 2 cores
PartitionName={spec["partition"]} Nodes={first} Default=YES MaxTime=INFINITE State=UP \
OverSubscribe=FORCE:4 PreemptMode=OFF
PartitionName={spec["multi_partition"]} Nodes={first},{second} MaxTime=INFINITE State=UP \
OverSubscribe=FORCE:4 PreemptMode=OFF
# a shared cluster's queue: one CPU, no sharing, so one job runs and the rest wait
PartitionName={spec["queue_partition"]} Nodes={queue_node} DefaultTime=10 State=UP \
OverSubscribe=NO PreemptMode=OFF
PartitionName={spec["low_partition"]} Nodes={preempt_node} DefaultTime=10 State=UP \
OverSubscribe=NO PriorityTier=1 PreemptMode=REQUEUE
PartitionName={spec["high_partition"]} Nodes={preempt_node} DefaultTime=10 State=UP \
OverSubscribe=NO PriorityTier=2
"""


def _node_up(node: str, resumed: set[str]) -> bool:
    """True when the node is up; resumes it once if an earlier run left it down (stopped
    with jobs on it)."""
    out = _run(["sinfo", "-h", "-n", node, "-o", "%T"], check=False).stdout.strip()
    state = out.rstrip("*~#$@^-!%")
    if state in ("down", "drained", "draining") and node not in resumed:
        _run(["scontrol", "update", f"nodename={node}", "state=resume"], check=False)
        resumed.add(node)
    return state in ("idle", "mixed", "allocated")


def _cluster_running(state_dir: Path) -> bool:
    """True when the supervisor recorded in state_dir's state.json is alive."""
    with contextlib.suppress(OSError, ValueError, KeyError):
        return _supervisor_alive(json.loads((state_dir / "state.json").read_text()))
    return False


def _munge_works() -> bool:
    if not MUNGE_SOCKET.exists():
        return False
    cred = _run(["munge", "-n"], check=False)
    return (
        cred.returncode == 0 and _run(["unmunge"], input=cred.stdout, check=False).returncode == 0
    )


def _mem_total_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    return 1024


def _children(pid: int) -> list[int]:
    """Live processes whose parent is pid."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
                found.append(int(entry.name))
    return found


def main(argv: list[str]) -> int:
    """`start` (left running), `stop` (the cluster running from the default state dir), `status`."""
    command = argv[0] if argv else "status"
    if command == "_supervise":
        return _Supervisor(json.loads(argv[1])).main()
    slurm = LocalSlurm()
    state = slurm._read_state()
    if command == "start":
        started = time.monotonic()
        slurm.start()
        slurm._supervisor = None  # detach: the cluster outlives this command
        how = "started" if slurm.owned else "already running"
        print(f"local Slurm {how} in {time.monotonic() - started:.1f}s: ssh -p {slurm.port}")
        return 0
    if command == "stop":
        if _supervisor_alive(state):
            _terminate_supervisor(state["supervisor_pid"])
            print("local Slurm stopped")
        else:
            print("local Slurm not running")
        return 0
    if command == "status":
        up = bool(state) and slurm._healthy(state)  # type: ignore[arg-type]
        current = up and slurm._current(state)  # type: ignore[arg-type]
        print(json.dumps({"running": up, "current_config": current, **(state or {})}, indent=1))
        return 0 if up else 1
    print("usage: python -m prefect_nemo.testing.slurm start|stop|status", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
