"""A real Prefect server that a test can stop and start again on the same database.

`prefect server start` (the command users run, services included: the event persister, the
automations' triggers and actions) as a child process on a fixed loopback port and a SQLite
database in a directory of its own. `stop()` ends it as Ctrl-C would (SIGINT, then SIGKILL);
`start()` brings it back on the same port and database, so clients configured with `api_url`
see an outage and then the same server again. Prefect's own test harness
(`prefect.testing.utilities.prefect_test_harness`) starts uvicorn on a temporary database the
same way but cannot restart it on the same port.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from prefect_nemo.local_ray import free_port


class PrefectServer:
    """`prefect server start` on 127.0.0.1:<port> with its database under `home` (SQLite), or
    at `database_url` (PostgreSQL: postgresql+asyncpg://...); with its UI at `ui_url` if `ui`."""

    def __init__(
        self,
        home: Path,
        port: int | None = None,
        database_url: str | None = None,
        *,
        ui: bool = False,
    ) -> None:
        self.home = Path(home)
        self.port = port or free_port()
        self.database_url = database_url or f"sqlite+aiosqlite:///{self.database}"
        self.ui = ui
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def api_url(self) -> str:
        """The API URL clients use (PREFECT_API_URL)."""
        return f"http://127.0.0.1:{self.port}/api"

    @property
    def ui_url(self) -> str:
        """Where the UI is served (with `ui=True`)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def database(self) -> Path:
        return self.home / "prefect.db"

    def env(self) -> dict[str, str]:
        """The environment of a client of this server (a flow script, the prefect CLI)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        return {**env, "PREFECT_API_URL": self.api_url, "PREFECT_HOME": str(self.home / "client")}

    def start(self, timeout_s: float = 180.0) -> PrefectServer:
        """Start the server (again, on the same port and database) and wait until it answers."""
        if self.process is not None and self.process.poll() is None:
            return self
        self.home.mkdir(parents=True, exist_ok=True)
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")},
            "PREFECT_HOME": str(self.home),
            "PREFECT_SERVER_DATABASE_CONNECTION_URL": self.database_url,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_SERVER_UI_ENABLED": str(self.ui).lower(),
            "PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED": "false",
            "PREFECT_SERVER_LOGGING_LEVEL": "WARNING",
        }
        if self.ui:  # the UI asks /ui-settings where its API is; `--port` alone leaves :4200
            env.update(
                PREFECT_SERVER_API_HOST="127.0.0.1",
                PREFECT_SERVER_API_PORT=str(self.port),
                PREFECT_UI_API_URL=self.api_url,
                PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT="false",
            )
        prefect = str(Path(sys.executable).parent / "prefect")
        cmd = [prefect, "server", "start", "--host", "127.0.0.1", "--port", str(self.port)]
        log = open(self.home / "server.log", "ab")  # the child keeps it open
        self.process = subprocess.Popen(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        self.starts += 1
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"prefect server exited ({self.process.returncode}):\n"
                                   + self.log_tail())  # fmt: skip
            if self.healthy():
                return self
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"prefect server silent for {timeout_s:g}s:\n{self.log_tail()}")

    def healthy(self) -> bool:
        """True when /api/health answers 200."""
        try:
            return httpx.get(f"{self.api_url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the server as Ctrl-C does (its services shut down), SIGKILL if it hangs."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGINT)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)
        self.process = None

    def log_tail(self, chars: int = 4000) -> str:
        path = self.home / "server.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def __enter__(self) -> PrefectServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
