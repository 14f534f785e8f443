"""Reports from inside a job (prefect_nemo.report), what they add up to (prefect_nemo.progress),
the stall watch and the reporter's rate limits: pure, no server, no cluster."""

from __future__ import annotations

import ast
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import prefect_nemo.report as report_module
from prefect_nemo import InvalidJobSpec, JobSpec, JobStalled
from prefect_nemo.jobs import JobState, QueueInfo
from prefect_nemo.progress import MAX_METRICS, MAX_POINTS, JobProgress, Series, svg_line
from prefect_nemo.report import PREFIX, ProgressCallback, Report, format_line, parse, progress
from prefect_nemo.watcher import Silence

# -- the job's side -----------------------------------------------------------------------------


def test_progress_prints_one_flushed_json_line(capsys):
    progress(step=120, total=1000, loss=0.31, lr=2e-5)
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.startswith(PREFIX)
    assert json.loads(out[len(PREFIX) :]) == {
        "step": 120, "total": 1000, "metrics": {"loss": 0.31, "lr": 2e-5},
    }  # fmt: skip
    assert parse(out.strip()) == Report(120, 1000, {"loss": 0.31, "lr": 2e-5})


def test_non_finite_values_keep_the_json_valid_and_come_back():
    line = format_line(3, loss=math.nan, up=math.inf, down=-math.inf)
    json.loads(line[len(PREFIX) :])  # strict JSON: no NaN token
    assert "NaN" not in line and "Infinity" not in line
    back = parse(line)
    assert back is not None and math.isnan(back.metrics["loss"])
    assert back.metrics["up"] == math.inf and back.metrics["down"] == -math.inf


def test_bad_input_fails_in_the_job_with_the_name():
    with pytest.raises(TypeError, match="'loss' must be a number"):
        format_line(1, loss="low")
    with pytest.raises(TypeError, match="'ok' must be a number"):
        format_line(1, ok=True)
    with pytest.raises(ValueError, match="step must be >= 0"):
        format_line(-1)
    with pytest.raises(ValueError, match="total must be >= 1"):
        format_line(1, 0)


def test_parse_finds_reports_behind_launcher_prefixes_and_ignores_the_rest():
    line = "[default0]:" + format_line(7, 10, loss=1.5)
    assert parse(line) == Report(7, 10, {"loss": 1.5})
    for other in ("plain line", PREFIX + "{not json", PREFIX + "[1, 2]", PREFIX + '"x"',
                  PREFIX + '{"metrics": 3}', PREFIX + "{}" + " " * 9000):  # fmt: skip
        assert parse(other) is None, other
    # what is no number or no whole step is left out, the rest of the report kept
    odd = parse(PREFIX + '{"step": -2, "total": true, "metrics": {"a": "x", "b": [1], "c": 2}}')
    assert odd == Report(None, None, {"c": 2.0})
    long = parse(PREFIX + json.dumps({"metrics": {"n" * 500: 1}}))
    assert long is not None and list(long.metrics) == ["n" * 64]


def test_report_module_imports_only_the_standard_library(tmp_path):
    """A job ships report.py as a plain file: nothing but the standard library at import."""
    tree = ast.parse(Path(report_module.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.col_offset == 0:  # lazy: Lightning
            imported.add((node.module or "").split(".")[0])
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}, imported
    # and it runs alone, copied next to a job's code (-I: no site-packages, no prefect_nemo)
    (tmp_path / "report.py").write_text(Path(report_module.__file__).read_text())
    code = "import sys; sys.path.insert(0, '.'); import report; report.progress(1, 2, loss=0.5)"
    out = subprocess.run(
        [sys.executable, "-I", "-c", code], cwd=tmp_path, capture_output=True, text=True,
        check=True,
    ).stdout  # fmt: skip
    assert parse(out.strip()) == Report(1, 2, {"loss": 0.5})


class _Scalar:
    """A 0-d tensor's stand-in: float() works, nothing else does."""

    def __init__(self, value: float) -> None:
        self.value = value

    def __float__(self) -> float:
        return self.value


class _Trainer:
    def __init__(self, max_steps: int = 100) -> None:
        self.global_step = 0
        self.max_steps = max_steps
        self.is_global_zero = True
        self.sanity_checking = False
        self.callback_metrics: dict[str, Any] = {}


def test_the_callback_reports_a_duck_typed_trainer(capsys):
    callback = ProgressCallback(every_n_steps=10)
    trainer = _Trainer(max_steps=30)
    for step in range(1, 31):
        trainer.global_step = step
        trainer.callback_metrics = {"train_loss": _Scalar(1.0 / step), "text": "x", "step": step}
        callback.on_train_batch_end(trainer, None, None, None, step)
    trainer.callback_metrics["val_loss"] = _Scalar(0.25)
    callback.on_validation_end(trainer, None)
    callback.on_train_end(trainer, None)
    reports = [parse(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r.step, r.total) for r in reports if r] == [(10, 30), (20, 30), (30, 30), (30, 30),
                                                         (30, 30)]  # fmt: skip
    last = reports[-1]
    assert last is not None and last.metrics == {"train_loss": 1 / 30, "val_loss": 0.25}
    trainer.is_global_zero = False  # other ranks stay quiet
    callback.on_train_end(trainer, None)
    assert capsys.readouterr().out == ""


def test_progress_callback_is_plain_without_lightning():
    callback = report_module.progress_callback(every_n_steps=5)
    assert isinstance(callback, ProgressCallback) and callback.every_n_steps == 5
    with pytest.raises(ValueError, match="every_n_steps"):
        ProgressCallback(0)


# -- what reports add up to ---------------------------------------------------------------------


def test_a_series_stays_bounded_and_keeps_the_shape_and_the_latest_value():
    series = Series()
    for step in range(1_000_000):
        series.add(step, 1.0 / (step + 1))
    curve = series.curve()
    assert len(series.points) <= MAX_POINTS and len(curve) <= MAX_POINTS + 1
    assert curve[0] == (0, 1.0) and curve[-1] == (999_999, 1e-6)
    steps = [s for s, _ in curve]
    assert steps == sorted(steps) and steps[len(steps) // 2] > 300_000  # spread over the run
    assert series.low == 1e-6 and series.high == 1.0


def test_job_progress_rate_eta_table_and_payload():
    progress_ = JobProgress()
    for i in range(11):  # 10 steps a second for 10 s
        progress_.take(Report(i * 10, 1000, {"loss": 2.0 - i / 10, "bad": math.nan}), 100.0 + i)
    assert progress_.percent() == 10.0
    assert progress_.steps_per_s() == pytest.approx(10.0)
    assert progress_.eta_s() == pytest.approx(90.0)
    assert progress_.describe() == "step 100/1000 (10.0%), 10 steps/s, ETA 90 s"
    payload = progress_.payload()
    json.dumps(payload, allow_nan=False)
    assert payload["metrics"] == {"loss": 1.0, "bad": "nan"} and payload["eta_s"] == 90.0
    rows = {row["metric"]: row for row in progress_.table()}
    assert rows["loss"] == {"metric": "loss", "value": 1.0, "step": 100, "min": 1.0, "max": 2.0}
    assert rows["bad"]["value"] == "nan" and rows["bad"]["min"] is None
    json.dumps(progress_.table(), allow_nan=False)
    progress_.take(Report(5, 1000, {}), 200.0)  # a restart: the rate starts again
    assert progress_.steps_per_s() is None


def test_metric_count_is_bounded():
    progress_ = JobProgress()
    progress_.take(Report(1, None, {f"m{i}": float(i) for i in range(MAX_METRICS + 5)}), 0.0)
    assert len(progress_.series) == MAX_METRICS and progress_.dropped_metrics == 5
    assert progress_.percent() is None and progress_.describe() == "step 1"


def test_the_chart_is_one_html_block_of_svg_the_ui_keeps():
    progress_ = JobProgress()
    for step in range(50):
        progress_.take(Report(step, 50, {"loss<&>": 1.0 / (step + 1), "lr": 1e-4}), float(step))
    chart = progress_.chart("Metrics of job `j`")
    assert chart.count("<svg") == 2 and "loss&lt;&amp;&gt;" in chart
    assert "style=" not in chart  # the Prefect UI's sanitizer drops style attributes
    for line in chart.splitlines():  # each SVG is one line inside a <div> block
        if "<svg" in line:
            assert line.startswith("<div><svg") and line.endswith("</svg></div>")
    assert "no finite values" in svg_line([(1, math.nan)], "x")
    flat = svg_line([(1, 2.0), (2, 2.0)], "flat")  # no division by zero
    assert "polyline" in flat


# -- the stall watch ------------------------------------------------------------------------------


def test_silence_tells_each_stall_once_and_a_line_ends_it():
    told: list[float] = []
    silence = Silence(0.2, told.append)
    silence.check("j", JobState.PENDING)
    time.sleep(0.3)
    silence.check("j", JobState.PENDING)  # not running: no silence counted
    silence.check("j", JobState.RUNNING)
    assert told == []
    time.sleep(0.3)
    silence.check("j", JobState.RUNNING)
    silence.check("j", JobState.RUNNING)
    assert len(told) == 1 and told[0] > 0.2
    silence.heard()
    silence.check("j", JobState.RUNNING)
    assert len(told) == 1 and not silence.stalled
    time.sleep(0.3)
    silence.check("j", JobState.RUNNING)
    assert len(told) == 2


def test_silence_raises_job_stalled_when_asked_to_stop():
    silence = Silence(0.1, lambda s: None, stop=True)
    silence.check("job-1", JobState.RUNNING)
    time.sleep(0.2)
    with pytest.raises(JobStalled, match=r"job 'job-1' said nothing for 0\.\ds"):
        silence.check("job-1", JobState.RUNNING)


@pytest.mark.parametrize("value", [0, -1, math.inf, math.nan, "soon"])
def test_stall_after_s_must_be_seconds(value):
    with pytest.raises(InvalidJobSpec, match=r"JobSpec\.stall_after_s"):
        JobSpec(entrypoint="true", stall_after_s=value)


def test_stall_fields_leave_the_fingerprint_alone():
    plain = JobSpec(entrypoint="true")
    watched = JobSpec(entrypoint="true", stall_after_s=60, stop_on_stall=True)
    assert plain.fingerprint() == watched.fingerprint()


# -- the reporter's rate limit (no server: its emitter and log are caught) ----------------------


def _reporter(monkeypatch) -> tuple[Any, list[tuple[str, dict[str, Any]]], list[str]]:
    """A JobReporter whose events and log lines land in two lists."""
    import logging

    from prefect_nemo.redaction import Redactor
    from prefect_nemo.tasks import reporting
    from prefect_nemo.tasks._run import RunContext

    events: list[tuple[str, dict[str, Any]]] = []
    lines: list[str] = []
    monkeypatch.setattr(reporting, "emit", lambda name, resource, payload: events.append(
        (name, payload)))  # fmt: skip
    monkeypatch.setattr(reporting, "say", lambda run, level, message: lines.append(message))
    run = RunContext(None, "", None, None, None, None, logging.getLogger("test"))
    return reporting.JobReporter(run, Redactor(["hush-hush-1234"])), events, lines


def test_the_reporter_rate_limits_events_and_sends_the_newest_at_the_end(monkeypatch):
    from prefect_nemo.jobs import JobHandle, JobStatus

    reporter, events, lines = _reporter(monkeypatch)
    handle = JobHandle(job_id="j-1", backend="ray-jobs", cluster="c")
    for step in range(1, 1001):
        reporter.progress(handle, Report(step, 1000, {"loss": 1 / step, "x hush-hush-1234": 1.0}))
    progress_events = [p for name, p in events if name.endswith(".progress")]
    assert [p["step"] for p in progress_events] == [1], "one event per PROGRESS_EVENT_S"
    reporter.changed(handle, JobStatus(job_id="j-1", state=JobState.SUCCEEDED), None)
    names = [name.rsplit(".", 1)[1] for name, _ in events]
    assert names == ["progress", "progress", "succeeded"], "the newest report before the end"
    last = events[1][1]
    assert last["step"] == 1000 and last["percent"] == 100.0
    assert set(last["metrics"]) == {"loss", "x **********"}
    reporter.ended(handle)
    assert len(events) == 3, "nothing left to send at the end"
    assert not any("hush-hush-1234" in line for line in lines)
    assert sum("step 1000/1000" in line for line in lines) == 1


@pytest.mark.parametrize(
    ("seen", "end", "exit_code", "expected"),
    [
        ("QUEUED", "SUCCEEDED", 0, ["queued", "running", "admitted", "succeeded"]),
        ("PENDING", "FAILED", 1, ["pending", "running", "failed"]),
        ("QUEUED", "STOPPED", None, ["queued", "stopped"]),  # removed from its queue: never ran
        ("PENDING", "FAILED", None, ["pending", "failed"]),  # e.g. its runtime env failed
        (None, "SUCCEEDED", 0, ["succeeded"]),  # attached after the end: its run said RUNNING
    ],
)
def test_a_job_that_ran_between_two_polls_still_says_running(
    monkeypatch, seen, end, exit_code, expected
):
    """CI saw a Ray job go PENDING -> SUCCEEDED between two polls (`sleep 1`): an automation on
    `prefect-nemo.job.running` must still hear of every job that ran, and of no job that did not."""
    from prefect_nemo.jobs import JobHandle, JobStatus

    reporter, events, _ = _reporter(monkeypatch)
    handle = JobHandle(job_id="j-1", backend="ray-jobs", cluster="c")
    if seen:
        reporter.changed(handle, JobStatus(job_id="j-1", state=JobState(seen)), None)
    ended = JobStatus(job_id="j-1", state=JobState(end), exit_code=exit_code)
    reporter.changed(handle, ended, None)
    assert [name.rsplit(".", 1)[1] for name, _ in events] == expected
    running = [p for name, p in events if name.endswith(".running")]
    assert all(p["exit_code"] is None for p in running), "the running event carries no ending"


def test_a_stall_watch_needs_the_log_streamed():
    from prefect_nemo.tasks.jobs import wait_policy

    spec = JobSpec(entrypoint="true", stall_after_s=60)
    with pytest.raises(InvalidJobSpec, match="stream_logs=True"):
        wait_policy(None, timeout_s=None, queue_timeout_s=None, stream_logs=False, spec=spec)


def test_a_preemption_the_polls_missed_is_told_as_the_engine_counts_it(monkeypatch):
    """A Slurm job preempted within a second of starting is requeued and runs again between
    two polls: the polls see PENDING, QUEUED (preempted), RUNNING, and later RUNNING again with
    one more requeue. Each preemption the engine counts (squeue's RestartCnt) gets its
    `preempted` event, as many as the result's `preemptions` (CI saw 0 events and 0)."""
    from prefect_nemo.jobs import JobHandle, JobStatus
    from prefect_nemo.watcher import JobClock

    reporter, events, _ = _reporter(monkeypatch)
    handle = JobHandle(job_id="j-1", backend="nemo-run-slurm", cluster="c")
    clock = JobClock()
    preempted = QueueInfo(queue="low", reason="BeginTime", preempted=True)
    for state, requeues, queue in [
        ("PENDING", 0, None), ("QUEUED", 1, preempted), ("RUNNING", 1, None),
        ("RUNNING", 2, None), ("SUCCEEDED", None, None),
    ]:  # fmt: skip
        status = JobStatus(
            job_id="j-1", state=JobState(state), requeues=requeues, queue=queue,
            message=f"{state} {requeues}", exit_code=0 if requeues is None else None,
        )  # fmt: skip
        clock.observe(status)
        reporter.changed(handle, status, clock)
    names = [name.rsplit(".", 1)[1] for name, _ in events]
    assert names == ["pending", "queued", "preempted", "running", "admitted", "preempted",
                     "succeeded"], names  # fmt: skip
    assert clock.preemptions == names.count("preempted") == 2
