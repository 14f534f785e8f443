"""report.py's posts to the Kubeflow Trainer's status server (its env set), against a small local
HTTPS server that records them; the real controller's server is tested in test_real_progress.
And the TrainJob's `status.trainerStatus` as the backend reads it."""

from __future__ import annotations

import json
import ssl
import threading
from collections.abc import Iterator
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

import prefect_nemo.report as report_module
from prefect_nemo.backends.kubeflow.trainjob import status_from_trainjob, trainer_progress
from prefect_nemo.report import StatusPoster, progress
from prefect_nemo.testing.kube_api.tls import server_cert_pems


class Recorder(BaseHTTPRequestHandler):
    posts: list[tuple[str, str, dict[str, Any]]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.posts.append((self.path, self.headers["Authorization"], body))
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def status_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """A local HTTPS server as the Trainer's env names it (URL, CA file, token file)."""
    ca_pem, cert_pem, key_pem = server_cert_pems("status", ("status.trainer.svc",))
    (tmp_path / "tls.crt").write_bytes(cert_pem)
    (tmp_path / "tls.key").write_bytes(key_pem)
    (tmp_path / "ca.crt").write_bytes(ca_pem)
    (tmp_path / "token").write_text("token-one\n")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tmp_path / "tls.crt", tmp_path / "tls.key")
    server = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    Recorder.posts = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    path = "/apis/trainer.kubeflow.org/v1alpha1/namespaces/ns/trainjobs/job/status"
    monkeypatch.setenv(
        report_module.STATUS_URL_ENV, f"https://localhost:{server.server_port}{path}"
    )
    monkeypatch.setenv(report_module.STATUS_CA_ENV, str(tmp_path / "ca.crt"))
    monkeypatch.setenv(report_module.STATUS_TOKEN_ENV, str(tmp_path / "token"))
    monkeypatch.setattr(report_module, "_status", StatusPoster())
    yield Recorder.posts
    server.shutdown()
    server.server_close()


def test_progress_posts_rate_limited_with_the_last_step_and_a_fresh_token(
    status_server: list[Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each call still prints its line; the server gets the first report and the last step
    (the rest are within STATUS_POST_S), as the Trainer's UpdateTrainJobStatusRequest, with
    the token file as it reads at each post (the kubelet rotates it)."""
    for step in range(1, 100):
        progress(step, 100, loss=1.0 / step, **{"x secret-value": 1})
    (tmp_path / "token").write_text("token-two\n")
    progress(100, 100, loss=0.01, nan_check=float("nan"))
    assert capsys.readouterr().out.count("@@prefect-nemo.report ") == 100
    assert len(status_server) == 2, status_server
    (path, auth1, first), (_, auth2, last) = status_server
    assert path.endswith("/namespaces/ns/trainjobs/job/status")
    assert (auth1, auth2) == ("Bearer token-one", "Bearer token-two")
    assert first["trainerStatus"]["progressPercentage"] == 1
    # a name that is no identifier (it may hold an env value, a secret) is not posted
    assert first["trainerStatus"]["metrics"] == [{"name": "loss", "value": "1.0"}]
    status = last["trainerStatus"]
    assert status["progressPercentage"] == 100 and status["estimatedRemainingSeconds"] == 0
    assert status["metrics"] == [
        {"name": "loss", "value": "0.01"},
        {"name": "nan_check", "value": "nan"},
    ]
    assert datetime.strptime(status["lastUpdatedTime"], "%Y-%m-%dT%H:%M:%SZ")


def test_a_failing_post_never_stops_training_and_is_said_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "token").write_text("t")
    monkeypatch.setenv(report_module.STATUS_URL_ENV, "https://127.0.0.1:9/status")  # nothing there
    monkeypatch.setenv(report_module.STATUS_TOKEN_ENV, str(tmp_path / "token"))
    monkeypatch.setattr(report_module, "_status", StatusPoster(every_s=0))
    for step in range(1, 4):
        progress(step, 3, loss=0.5)
    out, err = capsys.readouterr()
    assert out.count("@@prefect-nemo.report ") == 3
    assert err.count("posting progress") == 1 and "the log line still reports it" in err


def test_without_the_trainer_env_nothing_is_posted(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv(report_module.STATUS_URL_ENV, raising=False)
    poster = StatusPoster()
    monkeypatch.setattr(report_module, "_status", poster)
    monkeypatch.setattr(poster, "post", lambda body: pytest.fail("posted"))
    progress(1, 2, loss=0.5)
    assert capsys.readouterr().out.startswith("@@prefect-nemo.report ")


def test_the_trainjobs_trainer_status_is_the_jobs_engine_progress() -> None:
    """What the Trainer's status server stores (`status.trainerStatus`: the CRD's types, values
    as strings) becomes JobStatus.progress."""
    obj = {
        "metadata": {"name": "job"},
        "status": {"trainerStatus": {
            "progressPercentage": 42, "estimatedRemainingSeconds": 17,
            "metrics": [{"name": "loss", "value": "0.25"}, {"name": "bad"}],
            "lastUpdatedTime": "2026-01-02T03:04:05Z",
        }},
    }  # fmt: skip
    progress = trainer_progress(obj)
    assert progress is not None
    assert (progress.percent, progress.eta_s, progress.metrics) == (42, 17, {"loss": "0.25"})
    assert progress.updated is not None and progress.updated.year == 2026
    assert status_from_trainjob(obj, []).progress == progress
    assert trainer_progress({"status": {}}) is None
    assert status_from_trainjob({"metadata": {"name": "job"}}, []).progress is None


def test_the_engines_progress_counts_only_for_a_job_whose_log_has_no_report_line() -> None:
    """lifecycle's rule: the log's report lines win; the engine's record is a report only while
    none was read, and while the log is followed the first record waits for a second (a line
    printed with it is read by then)."""
    from types import SimpleNamespace

    from prefect_nemo.jobs import EngineProgress, JobState, JobStatus
    from prefect_nemo.lifecycle import _LogStream
    from prefect_nemo.progress import JobProgress
    from prefect_nemo.report import Report, format_line

    def status(percent: int) -> JobStatus:
        progress = EngineProgress(percent=percent, eta_s=30 - percent,
                                  metrics={"loss": "0.5", "note": "text"})  # fmt: skip
        return JobStatus(job_id="j", state=JobState.RUNNING, progress=progress)

    def stream(followed: bool) -> tuple[Any, list[Report]]:
        seen: list[Report] = []
        observer = SimpleNamespace(progress=lambda _, report: seen.append(report),
                                   log=lambda *_: None)  # fmt: skip
        policy = SimpleNamespace(log_dir=None, stall_after_s=None, stream_logs=followed)
        supervisor = SimpleNamespace(policy=policy, redact=str, observer=observer)
        return _LogStream(supervisor, SimpleNamespace(job_id="j")), seen  # type: ignore[arg-type]

    logs, seen = stream(followed=True)
    logs._engine_progress(status(10))
    assert seen == []  # the first record waits
    logs._engine_progress(status(20))
    logs._engine_progress(status(20))  # the same record again: nothing new
    assert seen == [Report(step=20, total=100, metrics={"loss": 0.5}, eta_s=10)]
    shown = JobProgress()
    shown.take(seen[0], now=0.0)
    assert shown.eta_s() == 10, "the engine's own ETA (the Trainer's estimatedRemainingSeconds)"
    logs._sink(format_line(5, 10, loss=0.4))
    logs._engine_progress(status(30))
    assert [r.step for r in seen] == [20, 5]  # once a line came, lines only

    logs, seen = stream(followed=False)  # run_jobs' default: the record is all there is
    logs._engine_progress(status(10))
    assert [r.step for r in seen] == [10]
