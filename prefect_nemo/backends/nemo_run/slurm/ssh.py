"""`SafeSSH`: the SSH connection to a Slurm login node that never prompts or exits.

Key only (a missing, unreadable or rejected key is AuthenticationFailed naming the block field,
never a password prompt or ``sys.exit``), host key checked against the block's `known_hosts`
when given, no rsync (files go on a command's stdin: no key file is ever written), and a
NeMo-Run SSHTunnel whose own authentication is replaced by ours. One connection per settings
in the process (`SafeSSH.shared`); every pooled connection is closed at interpreter exit.

Every command is one SSH session (channel) on that connection, never a new connection; a
command can carry bytes on its stdin (`run_with_input`), so a job's files travel with the
command that submits it.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from prefect_nemo import names
from prefect_nemo.backends.nemo_run.isolation import nemo_run
from prefect_nemo.errors import AuthenticationFailed, BackendUnavailable

T = TypeVar("T")
_ssh_pool: dict[str, SafeSSH] = {}
_ssh_lock = threading.Lock()
# (user, host, port, sbatch script name) -> what runs it instead of a plain sbatch (`expect`):
# for any SafeSSH of that login node, as the shared scheduler may hold another's tunnel
_launches: dict[tuple[str, str, int, str], Callable[[str], Any]] = {}

#: Commands run at once on one connection. sshd_config(5), MaxSessions: "Specifies the maximum
#: number of open shell, login or subsystem (e.g. sftp) sessions permitted per network
#: connection ... The default is 10." Past it the login node refuses the channel; one session
#: is left for an SFTP channel and one spare. sshd frees a session a moment after we close
#: it, so a refused open (nothing ran yet) is tried again, OPEN_TRIES times in all.
MAX_SESSIONS = 8
OPEN_TRIES = 8


class SafeSSH:
    """One SSH connection per login node and settings, key only: a missing, unreadable or
    rejected key is AuthenticationFailed naming the block field, never a prompt or sys.exit.

    The key text (when the block holds the key itself) stays in memory: paramiko loads it
    from a string, and no rsync runs (files go on a command's stdin), so no key file is
    ever written.
    """

    def __init__(
        self,
        *,
        host: str,
        port: int,
        user: str,
        identity: str | None,
        identity_key: str | None,
        known_hosts: str | None,
        connect_timeout_s: float,
        command_timeout_s: float,
        field_prefix: str,
    ) -> None:
        self.host, self.port, self.user = host, port, user
        self._identity, self._key_text, self._known_hosts = identity, identity_key, known_hosts
        self._connect_timeout_s, self._command_timeout_s = connect_timeout_s, command_timeout_s
        self._field = field_prefix
        self._lock = threading.Lock()
        self._session: Any = None
        self._bounded: Callable[[Callable[[], Any]], Any] | None = None
        self._tunnels: list[Any] = []

    @classmethod
    def shared(cls, **kwargs: Any) -> SafeSSH:
        """The process-wide connection for these settings (a block builds a backend per task;
        they share one SSH connection). Keyed by a hash of the key, never the key itself."""
        key = names.secret_hash(
            *(f"{k}={kwargs[k]}" for k in sorted(kwargs) if k != "identity_key"),
            kwargs.get("identity_key") or "",
        )
        with _ssh_lock:
            ssh = _ssh_pool.get(key)
            if ssh is None:
                ssh = _ssh_pool[key] = cls(**kwargs)
            return ssh

    @property
    def secrets(self) -> list[str]:
        """The key text and each of its lines (a log may show one line of it)."""
        if not self._key_text:
            return []
        lines = [ln.strip() for ln in self._key_text.splitlines() if len(ln.strip()) > 16]
        return [self._key_text, self._key_text.strip(), *lines]

    def _pkey(self) -> Any:
        import paramiko

        where = f"{self._field}.identity_key" if self._key_text else f"{self._field}.identity"
        text = self._key_text
        if text is None:
            if not self._identity:
                raise AuthenticationFailed(
                    f"{self._field}: no SSH key: set identity (a private key file on this "
                    "machine) or identity_key (the key itself, kept as a secret)"
                )
            try:
                text = Path(self._identity).expanduser().read_text()
            except OSError as exc:
                raise AuthenticationFailed(
                    f"{where}={self._identity!r} cannot be read ({exc.strerror or exc}): point it "
                    f"at the private key authorized for {self.user}@{self.host}"
                ) from None
        for cls in (paramiko.Ed25519Key, paramiko.ECDSAKey, paramiko.RSAKey):
            try:
                return cls.from_private_key(io.StringIO(text))
            except paramiko.PasswordRequiredException:
                raise AuthenticationFailed(
                    f"{where}: the key is encrypted with a passphrase and prefect-nemo never "
                    "prompts: use a key without a passphrase for this cluster"
                ) from None
            except (paramiko.SSHException, ValueError):
                continue
        raise AuthenticationFailed(
            f"{where}: not a private key paramiko can read (OpenSSH ed25519, ECDSA or RSA "
            "expected): check you gave the private key, not the .pub file"
        )

    def _open(self) -> Any:
        import paramiko
        from fabric import Config, Connection

        conn = Connection(
            self.host,
            user=self.user,
            port=self.port,
            connect_timeout=self._connect_timeout_s,
            connect_kwargs={
                "pkey": self._pkey(),
                "look_for_keys": False,
                "allow_agent": False,
                "auth_timeout": self._connect_timeout_s,
                "banner_timeout": self._connect_timeout_s,
            },
            config=Config(overrides={"run": {"in_stream": False}}),
        )
        if self._known_hosts is not None:
            keys = conn.client.get_host_keys()
            for line in self._known_hosts.splitlines():
                entry = paramiko.hostkeys.HostKeyEntry.from_line(line)
                if entry is not None and entry.key is not None:
                    for name in entry.hostnames:
                        keys.add(name, entry.key.get_name(), entry.key)
            conn.client.set_missing_host_key_policy(paramiko.RejectPolicy())
        else:  # as ssh does: a host listed in ~/.ssh/known_hosts must match (fabric skips it)
            with contextlib.suppress(OSError):
                conn.client.load_system_host_keys()
        target = f"{self.user}@{self.host}:{self.port}"
        try:
            conn.open()
        except paramiko.BadHostKeyException:
            raise AuthenticationFailed(
                f"{target} presented a host key that differs from "
                f"{self._field + '.known_hosts' if self._known_hosts else '~/.ssh/known_hosts'}: "
                "the host changed or someone is in between; check it and update known_hosts"
            ) from None
        except paramiko.AuthenticationException:
            raise AuthenticationFailed(
                f"{target} rejected the SSH key in {self._field}."
                f"{'identity_key' if self._key_text else 'identity'}: add its public key to "
                f"~{self.user}/.ssh/authorized_keys on the login node"
            ) from None
        except paramiko.SSHException as exc:
            if "known_hosts" in str(exc) or "not found in" in str(exc):
                raise AuthenticationFailed(
                    f"{target} is not in {self._field}.known_hosts: add its line (ssh-keyscan "
                    f"-p {self.port} {self.host} prints it)"
                ) from None
            raise BackendUnavailable(f"SSH to {target} failed: {exc}") from None
        except (TimeoutError, OSError, EOFError) as exc:
            raise BackendUnavailable(
                f"cannot reach {target} over SSH ({type(exc).__name__}: {exc}): check "
                f"{self._field}.host and port and that the login node is up"
            ) from None
        transport = conn.client.get_transport()
        if transport is not None:
            transport.set_keepalive(30)  # long waits: keep NATs and firewalls from dropping us
        return conn

    def session(self) -> Any:
        """The open fabric Connection (reopened if it dropped)."""
        return self._connection()[0]

    def _connection(self) -> tuple[Any, Callable[[Callable[[], T]], T]]:
        """The open connection and its bound on sessions at once (`_bound_sessions`)."""
        with self._lock:
            if self._session is None or not self._session.is_connected:
                if self._session is not None:
                    with contextlib.suppress(Exception):  # free its socket and threads
                        self._session.close()
                session = self._open()
                self._bounded = _bound_sessions(session)
                self._session = session
                for tunnel in self._tunnels:
                    tunnel.session = self._session
            assert self._bounded is not None
            return self._session, self._bounded

    def tunnel(self, job_dir: str) -> Any:
        """A NeMo-Run SSHTunnel on our connection, whose own authentication (prompt, then
        sys.exit) is replaced on this instance by ours."""
        run = nemo_run()
        tunnel = run.SSHTunnel(host=self.host, user=self.user, port=self.port, job_dir=job_dir)

        def authenticate() -> None:
            tunnel.session = self.session()

        plain_run = tunnel.run

        def run_or_launch(command: str, *args: Any, **kwargs: Any) -> Any:
            launch = self._expected(command)
            return launch(command) if launch else plain_run(command, *args, **kwargs)

        tunnel._authenticate = authenticate  # instance attributes: SSHTunnel stays SSHTunnel
        tunnel.run = run_or_launch
        with self._lock:
            self._tunnels = [*self._tunnels[-15:], tunnel]
        return tunnel

    @contextlib.contextmanager
    def expect(self, script: str, launch: Callable[[str], Any]) -> Any:
        """While in this block, NeMo-Run's ``sbatch ... <script>`` through any of our tunnels
        runs `launch(command)` instead (it returns what tunnel.run would). Keyed by the
        script's file name: NeMo-Run's scheduler is shared by concurrent launches, and its
        tunnel (whose job dir the path is built from) may be another job's by then."""
        key = (self.user, self.host, self.port, script.rsplit("/", 1)[-1])
        with _ssh_lock:
            _launches[key] = launch
        try:
            yield
        finally:
            with _ssh_lock:
                if _launches.get(key) is launch:
                    del _launches[key]

    def _expected(self, command: str) -> Callable[[str], Any] | None:
        words = command.split()
        if not words or words[0] != "sbatch":
            return None
        with _ssh_lock:
            return _launches.pop(
                (self.user, self.host, self.port, words[-1].rsplit("/", 1)[-1]), None
            )

    def run(self, command: str, *, warn: bool = False) -> Any:
        """Run a command on the login node; BackendUnavailable on transport trouble."""
        from invoke.exceptions import CommandTimedOut, UnexpectedExit

        session = self.session()
        try:
            return session.run(command, hide=True, warn=warn, timeout=self._command_timeout_s)
        except UnexpectedExit as exc:
            result = exc.result
            raise BackendUnavailable(
                f"command on {self.user}@{self.host} failed (exit {result.exited}): "
                f"{(result.stderr or result.stdout).strip()[-300:]}"
            ) from None
        except CommandTimedOut:
            raise BackendUnavailable(
                f"command on {self.user}@{self.host} took over {self._command_timeout_s:g}s"
            ) from None
        except (OSError, EOFError) as exc:
            with self._lock:
                if self._session is session:  # another thread may have reopened already
                    self._session = None
            with contextlib.suppress(Exception):  # free its socket and transport thread
                session.close()
            raise BackendUnavailable(f"SSH to {self.user}@{self.host} broke: {exc}") from None

    def run_with_input(self, command: str, data: bytes) -> tuple[int, str, str]:
        """Run a command with `data` on its stdin, in one session: (exit status, stdout,
        stderr). BackendUnavailable on transport trouble or a timeout."""
        session, bounded = self._connection()

        def once() -> tuple[int, str, str]:
            transport = session.client.get_transport()
            if transport is None or not transport.is_active():
                raise EOFError("the connection is closed")
            channel = transport.open_session(timeout=self._connect_timeout_s)
            try:
                channel.settimeout(self._command_timeout_s)
                channel.exec_command(command)
                try:
                    channel.sendall(data)
                    channel.shutdown_write()
                except TimeoutError:
                    raise
                except OSError:
                    if not transport.is_active():
                        raise
                    # the command ended before it read all its input: its exit status says why
                out = channel.makefile("rb").read().decode(errors="replace")
                err = channel.makefile_stderr("rb").read().decode(errors="replace")
                if not channel.status_event.wait(self._command_timeout_s):
                    raise TimeoutError
                return channel.recv_exit_status(), out, err
            finally:
                channel.close()

        try:
            return bounded(once)
        except TimeoutError:  # socket.timeout is TimeoutError
            raise BackendUnavailable(
                f"command on {self.user}@{self.host} took over {self._command_timeout_s:g}s"
            ) from None
        except (OSError, EOFError) as exc:
            if not session.is_connected:
                with self._lock:
                    if self._session is session:
                        self._session = None
                with contextlib.suppress(Exception):
                    session.close()
            raise BackendUnavailable(f"SSH to {self.user}@{self.host} broke: {exc}") from None

    def close(self) -> None:
        """Close the connection (its socket and paramiko's transport thread);
        idempotent. A later call reconnects: the connection is shared, so a user may come late."""
        with self._lock:
            session, self._session = self._session, None
        if session is not None:
            with contextlib.suppress(Exception):
                session.close()


def _bound_sessions(conn: Any) -> Callable[[Callable[[], T]], T]:
    """Make conn.run (ours and NeMo-Run's tunnel's: one SSH session each) wait for one of
    MAX_SESSIONS slots, so that many jobs submitted at once stay within sshd's MaxSessions.
    Returns the same bound for other callers that open a session (`run_with_input`)."""
    from paramiko import ChannelException, SSHException

    slots = threading.BoundedSemaphore(MAX_SESSIONS)
    run = conn.run

    def refused(exc: SSHException) -> bool:
        """True when sshd refused the session, so the command never started. paramiko keeps one
        saved exception per connection: when two threads are refused at once, one may take the
        other's ChannelException, and the other sees a bare "Unable to open channel." while the
        connection is still up."""
        if isinstance(exc, ChannelException):
            return True
        return "Unable to open channel" in str(exc) and conn.is_connected

    def bounded(call: Callable[[], T]) -> T:
        for attempt in range(OPEN_TRIES):
            with slots:
                try:
                    return call()
                except SSHException as exc:
                    if not refused(exc) or attempt == OPEN_TRIES - 1:
                        raise
            time.sleep(0.05 * 2**attempt)  # up to 3.2 s: sshd has freed closed sessions by then
        raise AssertionError("unreachable")

    def bounded_run(command: str, **kwargs: Any) -> Any:
        return bounded(lambda: run(command, **kwargs))

    conn.run = bounded_run  # `run` is a real attribute: set on the instance, not the config
    return bounded


@atexit.register
def close_all() -> None:
    """Close every pooled connection (at interpreter exit: the owner of the shared ones)."""
    with _ssh_lock:
        pool = list(_ssh_pool.values())
    for ssh in pool:
        ssh.close()
