"""What every backend's progress test asserts: a job printing `progress(...)` 1,000 times shows its
progress, metrics and charts in Prefect, its events are rate-limited, and its secret reaches none of
them. One copy, so the Ray Jobs, KubeRay, Kubeflow Trainer, Slurm, run:ai and Lepton tests agree."""

from __future__ import annotations

import json
import logging
import shutil
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from pydantic import SecretStr

import prefect_nemo.report as report_module
from prefect_nemo import JobSpec, JobState, run_job
from prefect_nemo.tasks import reporting

CANARY = "canary-report-5be2d1"

# The job every backend runs: 1,000 reports, a secret inside a metric's name, a NaN at the end.
REPORTING_JOB = (
    "print('starting', flush=True)\n"
    "for step in range(1, 1001):\n"
    "    progress(step, 1000, loss=1.0 / step, lr=2e-5, **{'x ' + os.environ['CANARY']: 1})\n"
    "    time.sleep(0.004)\n"
    "progress(1000, 1000, nan_check=float('nan'))\n"
)


def job_dir(path: Path, body: str = REPORTING_JOB) -> Path:
    """`path` holding job.py and report.py, shipped as a plain file (no prefect_nemo installed)."""
    path.mkdir(parents=True, exist_ok=True)
    shutil.copy(report_module.__file__, path / "report.py")
    (path / "job.py").write_text("import os, sys, time\nfrom report import progress\n" + body)
    return path


def events(prefect_api: str, flow_run_id: object, since: str, until: str) -> list[dict]:
    """Our events related to the flow run (through its task run), once `until` is among them."""
    found: list[dict] = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        body = {"filter": {"occurred": {"since": since},
                           "related": {"id": [f"prefect.flow-run.{flow_run_id}"]},
                           "event": {"prefix": ["prefect-nemo.job."]}}, "limit": 50}  # fmt: skip
        page = httpx.post(f"{prefect_api}/events/filter", json=body).json()
        found = page["events"]
        while page.get("next_page"):
            page = httpx.get(page["next_page"]).json()
            found += page["events"]
        if any(e["event"] == until for e in found):
            break
        time.sleep(0.5)
    return sorted(found, key=lambda e: e["occurred"])


def assert_1000_steps_reached_prefect(
    *, state: Any, job_id: str, prefect_api: str, since: str, took: float, caplog: Any, capfd: Any,
    secret_env: bool = True,
) -> list[dict]:  # fmt: skip
    """The REPORTING_JOB's reports as Prefect shows them; returns the job's progress events.

    `secret_env=False` for a backend that refuses secret values in JobSpec.env (run:ai, Lepton:
    they would be stored in the workload in plain text): its job gets a plain CANARY, so its
    masked metric name is not looked for (CANARY itself is still looked for everywhere)."""
    flow_run_id = state.state_details.flow_run_id
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        )
    by_kind = {a.type: a for a in artifacts if job_id in (a.description or "")}
    assert {"progress", "table", "markdown"} <= set(by_kind), [a.type for a in artifacts]
    assert all(by_kind[k].task_run_id is not None for k in ("progress", "table", "markdown"))
    assert by_kind["progress"].data == 100.0
    assert "step 1000/1000 (100.0%)" in by_kind["progress"].description
    rows = {row["metric"]: row for row in json.loads(by_kind["table"].data)}
    assert rows["loss"]["value"] == pytest.approx(0.001) and rows["loss"]["step"] == 1000
    assert rows["lr"]["value"] == 2e-5 and rows["nan_check"]["value"] == "nan"
    assert rows["loss"]["max"] == 1.0
    chart = by_kind["markdown"].data
    assert chart.count("<svg") == 4 and "### loss" in chart

    found = events(prefect_api, flow_run_id, since, until="prefect-nemo.job.succeeded")
    progress = [e for e in found if e["event"] == "prefect-nemo.job.progress"]
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
        "events": json.dumps(found),
        "caplog": caplog.text,
        "captured output": "".join(capfd.readouterr()),
    }
    if secret_env:
        assert "x **********" in texts["artifacts"] and "x **********" in texts["events"]
    for where, text in texts.items():
        assert CANARY not in text, f"the secret leaked into {where}"
    return progress


def run_reporting_job(
    block: Any,
    path: Path,
    prefect_api: str,
    caplog: Any,
    capfd: Any,
    *,
    secret_env: bool = True,
    **spec_fields: Any,
) -> tuple[Any, float, list[dict]]:
    """Run REPORTING_JOB on `block` in a flow (CANARY a secret env value, or a plain stand-in
    where the backend refuses secret values; `spec_fields` what the backend needs besides) and
    assert what Prefect shows and that the job's log holds every report. Returns the result,
    the flow's wall time and the job's progress events."""
    caplog.set_level(logging.INFO)
    since = datetime.now(UTC).isoformat()
    canary = SecretStr(CANARY) if secret_env else "plain-not-secret"
    spec = JobSpec(
        **{"entrypoint": "python3 job.py", **spec_fields}, name="reporter",
        working_dir=job_dir(path), env={"CANARY": canary},
    )  # fmt: skip

    @flow
    def reporting_flow() -> Any:
        return run_job(spec, cluster=block)

    started = time.monotonic()
    state = reporting_flow(return_state=True)
    result = state.result()
    took = time.monotonic() - started
    assert result.state is JobState.SUCCEEDED
    progress = assert_1000_steps_reached_prefect(
        state=state, job_id=result.handle.job_id, prefect_api=prefect_api, since=since,
        took=took, caplog=caplog, capfd=capfd, secret_env=secret_env,
    )  # fmt: skip
    log = block.backend().logs(result.handle.job_id)
    assert log.count("@@prefect-nemo.report ") == 1001, "the job printed every report"
    return result, took, progress
