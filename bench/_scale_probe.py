"""What one measured process of the scale benchmark uses: a sampler of threads and RSS, a
counter of Prefect API requests and events, and the client of the simulated cluster process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from typing import Any

import httpx


def rss_mb() -> float:
    """This process's resident memory now (VmRSS), in MB."""
    return _status_kb("VmRSS") / 1024


def peak_rss_mb() -> float:
    """This process's peak resident memory so far (VmHWM), in MB."""
    return _status_kb("VmHWM") / 1024


def open_fds() -> int:
    """File descriptors open in this process."""
    return len(os.listdir("/proc/self/fd"))


def cpu_s() -> float:
    """CPU seconds this process has used (user + system): what load on the machine cannot
    inflate, unlike wall time."""
    times = os.times()
    return times.user + times.system


def server_cpu_s() -> float:
    """CPU seconds used so far by the Prefect API server(s) this process started (uvicorn)."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and b"uvicorn" in cmdline:
            total += (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return total


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class Sampler:
    """Samples the thread count every `every_s` (peak kept); RSS peak comes from VmHWM."""

    def __init__(self, every_s: float = 0.05) -> None:
        self.every_s = every_s
        self.peak_threads = threading.active_count()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-sampler", daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            # the sampler itself is not counted
            self.peak_threads = max(self.peak_threads, threading.active_count() - 1)


class PrefectRequestCounter:
    """Counts HTTP requests to the Prefect API (sync and async clients) and events emitted
    through Prefect's events client (its websocket carries one message each)."""

    def __init__(self, api_url: str) -> None:
        self.api_url = api_url.rstrip("/")
        self.requests = 0
        self.events = 0
        self.by_path: dict[str, int] = {}
        self._lock = threading.Lock()

    def install(self) -> PrefectRequestCounter:
        from prefect.events.clients import PrefectEventsClient

        counter = self
        sync_send, async_send = httpx.Client.send, httpx.AsyncClient.send
        emit = PrefectEventsClient._emit

        def send(client: Any, request: httpx.Request, *a: Any, **k: Any) -> Any:
            counter._count(request)
            return sync_send(client, request, *a, **k)

        async def asend(client: Any, request: httpx.Request, *a: Any, **k: Any) -> Any:
            counter._count(request)
            return await async_send(client, request, *a, **k)

        async def counted_emit(client: Any, event: Any) -> None:
            with counter._lock:
                counter.events += 1
            await emit(client, event)

        httpx.Client.send = send  # type: ignore[method-assign,assignment]
        httpx.AsyncClient.send = asend  # type: ignore[method-assign,assignment]
        PrefectEventsClient._emit = counted_emit  # type: ignore[method-assign,assignment]
        return self

    def _count(self, request: httpx.Request) -> None:
        if str(request.url).startswith(self.api_url):
            key = f"{request.method} {str(request.url)[len(self.api_url):].split('?')[0]}"
            key = "/".join("<id>" if len(p) == 36 else p for p in key.split("/"))
            with self._lock:
                self.requests += 1
                self.by_path[key] = self.by_path.get(key, 0) + 1


class SimulatedCluster:
    """The `_scale_cluster` process: start, ask, stop."""

    def __init__(self, quota: str | None = None) -> None:
        """`quota`: `QUEUE:N`, Kueue's admission by quota played there (`$SCALE_QUOTA`)."""
        env = dict(os.environ, SCALE_QUOTA=quota) if quota else None
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench._scale_cluster"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self.proc.stdout is not None
        first = self.proc.stdout.readline()
        if not first:
            raise RuntimeError("the simulated cluster process died before it was ready")
        self.kubeconfig: dict[str, Any] = json.loads(first)["kubeconfig"]

    def ask(self, cmd: str, **kw: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"cmd": cmd, **kw}) + "\n")
        self.proc.stdin.flush()
        out: dict[str, Any] = json.loads(self.proc.stdout.readline())
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.ask("quit") if False else None
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(30)
            except Exception:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> SimulatedCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
