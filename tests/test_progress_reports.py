"""A job's reports reach Prefect, and a silent job is stopped as stalled: real Prefect API, real
local Ray (Ray Jobs), the job shipping prefect_nemo/report.py as a plain file."""

from __future__ import annotations

import json
import logging
import shutil
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from pydantic import SecretStr

import prefect_nemo.report as report_module
from prefect_nemo import JobSpec, JobStalled, JobState, run_job
from prefect_nemo.tasks import reporting
from tests.conftest import wait_until

pytestmark = pytest.mark.slow

CANARY = "canary-report-5be2d1"


def _job_dir(tmp_path: Path, body: str) -> Path:
    shutil.copy(report_module.__file__, tmp_path / "report.py")  # shipped as a plain file
    (tmp_path / "job.py").write_text("import os, sys, time\nfrom report import progress\n" + body)
    return tmp_path


def _events(prefect_api: str, flow_run_id: object, since: str, until: str) -> list[dict]:
    """Our events related to the flow run (through its task run), once `until` is among them."""
    events: list[dict] = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        body = {"filter": {"occurred": {"since": since},
                           "related": {"id": [f"prefect.flow-run.{flow_run_id}"]},
                           "event": {"prefix": ["prefect-nemo.job."]}}, "limit": 50}  # fmt: skip
        page = httpx.post(f"{prefect_api}/events/filter", json=body).json()
        events = page["events"]
        while page.get("next_page"):
            page = httpx.get(page["next_page"]).json()
            events += page["events"]
        if any(e["event"] == until for e in events):
            break
        time.sleep(0.5)
    return sorted(events, key=lambda e: e["occurred"])


def test_a_job_reporting_1000_steps_shows_progress_metrics_and_charts(
    ray_head, prefect_api, tmp_path, caplog, capfd
):
    caplog.set_level(logging.INFO)
    since = datetime.now(UTC).isoformat()
    body = (
        "print('starting', flush=True)\n"
        "for step in range(1, 1001):\n"
        # a secret the job prints inside its reports: a metric's name
        "    progress(step, 1000, loss=1.0 / step, lr=2e-5, **{'x ' + os.environ['CANARY']: 1})\n"
        "    time.sleep(0.004)\n"
        "progress(1000, 1000, nan_check=float('nan'))\n"
    )
    spec = JobSpec(
        entrypoint="python job.py", name="reporter", working_dir=_job_dir(tmp_path, body),
        env={"CANARY": SecretStr(CANARY)},
    )  # fmt: skip

    @flow
    def reporting_flow():
        return run_job(spec, cluster=ray_head.block())

    started = time.monotonic()
    state = reporting_flow(return_state=True)
    result = state.result()
    took = time.monotonic() - started
    assert result.state is JobState.SUCCEEDED
    flow_run_id = state.state_details.flow_run_id

    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        )
    job_id = result.handle.job_id
    by_kind = {a.type: a for a in artifacts if job_id in (a.description or "")}
    assert set(by_kind) == {"progress", "table", "markdown"}, [a.type for a in artifacts]
    assert all(a.task_run_id is not None for a in by_kind.values()), "the job's task run's"
    assert by_kind["progress"].data == 100.0
    assert "step 1000/1000 (100.0%)" in by_kind["progress"].description
    rows = {row["metric"]: row for row in json.loads(by_kind["table"].data)}
    assert rows["loss"]["value"] == pytest.approx(0.001) and rows["loss"]["step"] == 1000
    assert rows["lr"]["value"] == 2e-5 and rows["nan_check"]["value"] == "nan"
    assert rows["loss"]["max"] == 1.0
    chart = by_kind["markdown"].data
    assert chart.count("<svg") == 4 and "### loss" in chart

    events = _events(prefect_api, flow_run_id, since, until="prefect-nemo.job.succeeded")
    progress = [e for e in events if e["event"] == "prefect-nemo.job.progress"]
    # rate-limited: the first report, at most one every PROGRESS_EVENT_S, the newest at the end
    assert 1 <= len(progress) <= 2 + took / reporting.PROGRESS_EVENT_S, len(progress)
    last = progress[-1]["payload"]
    assert last["step"] == 1000 and last["total"] == 1000 and last["percent"] == 100.0
    assert last["metrics"]["nan_check"] == "nan" and last["metrics"]["loss"] == 0.001
    # report lines are not copied into the task's log; their summary lines are, rate-limited
    summaries = [r.getMessage() for r in caplog.records if "step 1000/1000" in r.getMessage()]
    assert summaries and "@@prefect-nemo.report" not in caplog.text
    assert "starting" in caplog.text

    texts = {
        "artifacts": json.dumps([a.model_dump(mode="json") for a in artifacts]),
        "events": json.dumps(events),
        "caplog": caplog.text,
        "captured output": "".join(capfd.readouterr()),
    }
    assert "x **********" in texts["artifacts"] and "x **********" in texts["events"]
    for where, text in texts.items():
        assert CANARY not in text, f"the secret leaked into {where}"
    print(f"1000 steps: flow {took:.1f}s, {len(progress)} progress events")


def test_a_silent_job_is_reported_stalled_and_stopped(ray_head, prefect_api, tmp_path, ray_client):
    since = datetime.now(UTC).isoformat()
    body = (
        "progress(5, 100, loss=0.5)\n"
        "print('quiet from', time.time(), flush=True)\n"
        "time.sleep(120)\n"
    )
    spec = JobSpec(
        entrypoint="python job.py", name="stalls", working_dir=_job_dir(tmp_path, body),
        stall_after_s=3, stop_on_stall=True,
    )  # fmt: skip

    failed_at: list[float] = []

    @flow
    def stalling_flow():
        try:
            return run_job(spec, cluster=ray_head.block())
        finally:
            failed_at.append(time.time())

    state = stalling_flow(return_state=True)
    with pytest.raises(JobStalled) as info:
        state.result()
    message = str(info.value)
    assert "past its stall_after_s of 3s" in message
    assert "its last report: step 5/100 loss=0.5" in message
    job_id = info.value.result.handle.job_id
    assert job_id in message and info.value.result.state is JobState.STOPPED
    assert ray_client.get_job_status(job_id).value == "STOPPED"

    log = ray_client.get_job_logs(job_id)
    quiet_from = float(log.split("quiet from ")[1].split()[0])

    events = _events(prefect_api, state.state_details.flow_run_id, since,
                     until="prefect-nemo.job.stalled")  # fmt: skip
    stalled = [e for e in events if e["event"] == "prefect-nemo.job.stalled"]
    assert len(stalled) == 1
    assert 3 <= stalled[0]["payload"]["silent_s"] < 3 + 5
    # from the job's last line: reported stalled within stall_after_s + 5 s, and the task
    # failed once the cluster confirmed the stop
    reported = datetime.fromisoformat(stalled[0]["occurred"]).timestamp() - quiet_from
    failed = failed_at[0] - quiet_from
    assert reported < 3 + 5, reported
    assert failed < 3 + 5 + 5, failed
    assert stalled[0]["payload"]["last_report"] == {
        "step": 5, "total": 100, "metrics": {"loss": 0.5},
    }  # fmt: skip
    assert wait_until(lambda: "prefect-nemo.job.stopped" in json.dumps(
        _events(prefect_api, state.state_details.flow_run_id, since,
                until="prefect-nemo.job.stopped")), timeout_s=10)  # fmt: skip
    print(f"stalled: reported {reported:.1f}s, failed {failed:.1f}s after the job's last line")
