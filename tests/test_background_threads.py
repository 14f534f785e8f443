"""Every background thread has an owner that stops it (issue 13, "Must hold" 4).

"Test: wait a job on a loopback API server, stop the server, close the backend: within 2 s no
thread started by prefect-nemo is alive and nothing more is logged." The threads in question are
the cluster watcher, the Kubernetes informers (owned by the backend: `close()`), the log pump's
loop thread and the `asyncio.to_thread` workers its streams use (owned by the pump: it stops when
the last followed job ends). The loopback server's own threads belong to the test kit.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from prefect_nemo import JobSpec
from prefect_nemo.errors import BackendUnavailable
from prefect_nemo.lifecycle import JobIdentity, QuietObserver, Supervisor, WaitPolicy
from prefect_nemo.logs import log_pump

OURS = ("prefect-nemo", "asyncio_")  # our thread names; the log pump's to_thread workers


def our_threads(before: set[int]) -> list[str]:
    """Threads started since `before` whose names say prefect-nemo started them."""
    return [
        t.name
        for t in threading.enumerate()
        if t.ident not in before and t.is_alive() and t.name.startswith(OURS)
    ]


class Records(logging.Handler):
    """Every log record, from any logger, after `start()`."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.on = False

    def emit(self, record: logging.LogRecord) -> None:
        if self.on and record.levelno >= logging.INFO:
            self.records.append(record)


@pytest.fixture
def records() -> Iterator[Records]:
    handler = Records()
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield handler
    finally:
        root.removeHandler(handler)


def test_closing_the_backend_leaves_no_thread_and_no_log(records: Records) -> None:
    from prefect_nemo.backends.kubeflow import KubeflowTrainerBackend, TrainerConfig
    from prefect_nemo.blocks.kubernetes import KubernetesCluster
    from prefect_nemo.testing.kube_api import LoopbackKubeServer, crd_dir
    from prefect_nemo.testing.operators import TrainJobSimulator

    before = {t.ident for t in threading.enumerate() if t.ident is not None}
    server = LoopbackKubeServer(crds=[crd_dir()]).start()
    simulator = TrainJobSimulator(server).start()
    backend = KubeflowTrainerBackend(
        KubernetesCluster(kubeconfig=server.kubeconfig()).api(), TrainerConfig(image="img")
    )
    lines: list[str] = []

    class Lines(QuietObserver):  # keeps the job's log lines
        def log(self, handle: Any, line: str) -> None:
            lines.append(line)

    supervisor = Supervisor(
        backend,
        WaitPolicy(unreachable_budget_s=300, stop_timeout_s=1, max_poll_interval_s=0.5),
        Lines(),
    )
    spec = JobSpec(entrypoint="while true; do echo tick; sleep 0.2; done")
    outcome: dict[str, BaseException | None] = {}

    def wait() -> None:
        try:
            supervisor.run(spec, JobIdentity(scope=f"t:{uuid.uuid4().hex}", key="ticker"))
        except BaseException as exc:
            outcome["error"] = exc

    waiter = threading.Thread(target=wait, name="test-waiter", daemon=True)
    waiter.start()
    try:
        deadline = time.monotonic() + 60
        while "tick" not in lines and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "tick" in lines, "the job ran and its log streamed through the log pump"
        assert our_threads(before), "the watcher, informers and log pump are running"
    finally:
        simulator.stop()
        server.stop()

    backend.close()
    records.on = True
    waiter.join(10)
    deadline = time.monotonic() + 2
    while our_threads(before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert our_threads(before) == [], "no thread prefect-nemo started outlives the close"
    time.sleep(1.0)  # anything still retrying would log within this second
    assert not waiter.is_alive()
    assert isinstance(outcome.get("error"), BackendUnavailable), outcome
    # only this test's threads: one another test left behind (seen once under heavy load: a
    # RayJob's GET retried against its module's stopped server) is not this backend's
    earlier = before - {threading.get_ident()}
    noise = [
        r
        for r in records.records
        if r.name.startswith(("prefect_nemo", "urllib3")) and r.thread not in earlier
    ]
    assert noise == [], [r.getMessage() for r in noise]


def test_the_log_pump_stops_when_nothing_is_followed() -> None:
    """The pump's loop thread lives only while a job is followed."""

    class Fake:  # the smallest Backend the pump uses: a log that never changes
        async def tail_logs(self, job_id: str):  # type: ignore[no-untyped-def]
            yield "one\n"

        def logs(self, job_id: str) -> str:
            return "one\n"

    got: list[str] = []
    follower = log_pump.follow(Fake(), "j", got.append, is_done=lambda: True)  # type: ignore[arg-type]
    deadline = time.monotonic() + 5
    while not got and time.monotonic() < deadline:
        time.sleep(0.01)
    follower.finish()
    deadline = time.monotonic() + 2
    while any(t.name == "prefect-nemo-logs" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the log pump thread did not stop"
        time.sleep(0.01)
    assert got == ["one"]


def test_finishing_the_last_stream_while_the_pump_stops_logs_no_error(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """finish() cancels the stream on the pump's own loop. (Cancelled in the finishing thread,
    its future ran the pump's callbacks there: the last follower's stopped the loop, which closed
    before the next callback asked it to cancel the stream: "exception calling callback ...
    Event loop is closed", eight times in one `bench.ray_overhead` run.) The pause after the
    pump's callback lets the loop close in that gap, every time."""
    import asyncio

    import prefect_nemo.logs as logs

    done = logs.LogPump._done

    def done_then_pause(self: logs.LogPump, future: Any) -> None:
        done(self, future)
        time.sleep(0.3)

    monkeypatch.setattr(logs.LogPump, "_done", done_then_pause)

    class Endless:  # a job whose log stays open
        async def tail_logs(self, job_id: str):  # type: ignore[no-untyped-def]
            yield "one\n"
            await asyncio.sleep(3600)

        def logs(self, job_id: str) -> str:
            return "one\n"

    caplog.set_level(logging.ERROR, logger="concurrent.futures")
    for _ in range(3):
        follower = log_pump.follow(Endless(), "j", lambda line: None, is_done=lambda: False)  # type: ignore[arg-type]
        time.sleep(0.2)  # streaming
        follower.finish()
        deadline = time.monotonic() + 2
        while any(t.name == "prefect-nemo-logs" for t in threading.enumerate()):
            assert time.monotonic() < deadline, "the log pump thread did not stop"
            time.sleep(0.01)
    assert [r.getMessage() for r in caplog.records if r.name == "concurrent.futures"] == []
    assert log_pump._following == 0
