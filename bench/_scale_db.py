"""The Prefect server's own database at scale (`bench.scale db`): the 1,000-job Kubernetes run
against `prefect server start` on SQLite (the default) and on PostgreSQL (Prefect's documented
production database: Debian's package, started here on a loopback port and stopped after).

scale_prefect_db_ratio is the SQLite wall over the PostgreSQL wall (> 1: PostgreSQL is
faster); scale_prefect_ui_page_s_max_<db>_<N> times the flow-run page's API requests every
second during each run.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from prefect_nemo.local_ray import free_port
from prefect_nemo.testing.prefect_server import PrefectServer

DB_N = 1000


def _pg_bin() -> Path:
    """The directory of PostgreSQL's server programs (Debian keeps them off PATH)."""
    found = shutil.which("postgres")
    if found:
        return Path(os.path.realpath(found)).parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"))
    if not versions:
        raise RuntimeError("PostgreSQL is not installed (Debian: apt-get install postgresql)")
    return Path(versions[-1]).parent


class LocalPostgres:
    """A throwaway PostgreSQL cluster on 127.0.0.1:<port> (trust auth, database `prefect`),
    run as the `postgres` user when we are root (the server refuses to run as root)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.root = Path(tempfile.mkdtemp(prefix="prefect-nemo-pg-"))
        self.data = self.root / "data"
        self.bin = _pg_bin()

    @property
    def url(self) -> str:
        """The SQLAlchemy URL Prefect's server takes."""
        return f"postgresql+asyncpg://postgres@127.0.0.1:{self.port}/prefect"

    def _run(self, *argv: str) -> None:
        cmd = [str(self.bin / argv[0]), *argv[1:]]
        if os.geteuid() == 0:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)

    def __enter__(self) -> LocalPostgres:
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres", "postgres")
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "-E", "UTF8")
        options = f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.root}"
        log = str(self.root / "server.log")
        self._run("pg_ctl", "-D", str(self.data), "-l", log, "-o", options, "-w", "start")
        self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "prefect")
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


def measure_db(measure: Any, report: Any, n: int = DB_N) -> None:
    """The n-job run (bench.scale's `measure`) on each database, with the UI page timed."""
    walls: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="prefect-nemo-scale-db-") as home:
        for db in ("sqlite", "postgres"):
            pg = LocalPostgres() if db == "postgres" else None
            if pg is not None:
                pg.__enter__()
            try:
                url = pg.url if pg is not None else None
                with PrefectServer(Path(home) / db, database_url=url) as server:
                    ui: list[float] = []
                    t0 = time.monotonic()
                    out = measure("ours", n, server.api_url, ui)
                    print(f"[scale] {db}: {time.monotonic() - t0:.1f}s {out['states']}", flush=True)
            finally:
                if pg is not None:
                    pg.__exit__()
            walls[db] = out["wall_s"]
            report(f"scale_prefect_db_wall_s_{db}_{n}", out["wall_s"])
            report(f"scale_prefect_api_requests_per_job_{db}_{n}", out["prefect_requests"] / n)
            if ui:
                report(f"scale_prefect_ui_page_s_max_{db}_{n}", max(ui))
                report(f"scale_prefect_ui_page_s_p50_{db}_{n}", sorted(ui)[len(ui) // 2])
    report("scale_prefect_db_ratio", walls["sqlite"] / walls["postgres"])
