"""Secrets never leak: a canary in the block (token, header, cluster-wide secret env) and in a
job's env var is scanned for everywhere, after a dry run and a real run of the same job."""

from __future__ import annotations

import json
import logging
import time
import traceback
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterId,
    LogFilter,
    LogFilterFlowRunId,
)
from pydantic import SecretStr

from prefect_nemo import JobFailed, JobSpec, run_job
from prefect_nemo.packaging import default_cache_dir
from prefect_nemo.tasks.reporting import job_rows

pytestmark = pytest.mark.slow

HEADER_CANARY = "canary-header-7f3a9b"
ENV_CANARY = "canary-env-c41d2e"
CLUSTER_CANARY = "canary-cluster-env-9e05b7"


def test_canaries_never_leak(ray_head, prefect_api, ray_client, caplog, capfd, tmp_path):
    caplog.set_level(logging.DEBUG)
    since = datetime.now(UTC).isoformat()
    token = ray_head.token
    assert token, "the session cluster runs with token auth"
    block = ray_head.block(
        headers={"X-Canary": HEADER_CANARY}, secret_env={"CLUSTER_CANARY": CLUSTER_CANARY}
    )
    (tmp_path / "job.py").write_text(
        "import os\nprint('value=' + os.environ['CANARY'])\n"
        "print('cluster=' + os.environ['CLUSTER_CANARY'])\n"
    )
    spec = JobSpec(
        entrypoint="python job.py; echo token=$RAY_AUTH_TOKEN; exit 3",
        name="leaky",
        working_dir=tmp_path,
        env={"CANARY": SecretStr(ENV_CANARY)},
    )

    @flow
    def leaky():
        # The dry run writes its rendering (with every secret value in it) to a log line and an
        # artifact; the job prints the secrets itself and fails, so they are in Ray's failure
        # message too.
        run_job(spec, cluster=block, dry_run=True)
        run_job(spec, cluster=block)

    state = leaky(return_state=True)
    with pytest.raises(JobFailed) as info:
        state.result()
    flow_run_id = state.state_details.flow_run_id
    error = info.value
    assert "value=**********" in str(error), "the job's output is there, masked"
    assert "cluster=**********" in str(error), "the cluster-wide secret reached the job, masked"

    haystacks: dict[str, str] = {
        "exception": str(error) + repr(error.result) + "".join(traceback.format_exception(error)),
        "caplog": caplog.text,
        "stdout/stderr": "".join(capfd.readouterr()),
        "block repr": repr(block) + str(block) + block.model_dump_json(),
    }
    with get_client(sync_client=True) as client:
        job_id = error.result.handle.job_id
        haystacks["prefect logs"] = _logs_of_flow_run(client, flow_run_id, until=job_id)
        artifacts = client.read_artifacts(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        )
        haystacks["artifacts"] = json.dumps([a.model_dump(mode="json") for a in artifacts])
        flow_run = client.read_flow_run(flow_run_id)
        haystacks["flow run state"] = flow_run.model_dump_json()
    haystacks["events"] = _events_of_flow_run(prefect_api, since, flow_run_id)
    haystacks["ray job metadata"] = json.dumps(ray_client.get_job_info(job_id).metadata)
    cache = default_cache_dir()
    haystacks["staged files"] = "".join(
        p.read_text(errors="ignore") for p in Path(cache).rglob("*") if p.is_file()
    ) if Path(cache).exists() else ""
    (row,) = [r for r in job_rows(str(flow_run_id)) if r["job_id"] == job_id]
    haystacks["saved log"] = Path(row["log"]).read_text()  # the job's whole log, on disk
    assert "value=**********" in haystacks["saved log"]

    assert "CLUSTER_CANARY: '**********'" in haystacks["artifacts"], "the dry run was written"
    assert "CLUSTER_CANARY: '**********'" in haystacks["caplog"]
    assert "prefect-nemo.job.submitted" in haystacks["events"]
    assert "prefect-nemo.job.failed" in haystacks["events"]
    assert job_id in haystacks["prefect logs"]
    for where, text in haystacks.items():
        for canary in (token, HEADER_CANARY, ENV_CANARY, CLUSTER_CANARY):
            assert canary not in text, f"a secret leaked into {where}"


def _events_of_flow_run(prefect_api: str, since: str, flow_run_id: object) -> str:
    """Every event about the flow run or related to it (ours are related through the task run)."""
    texts: list[str] = []
    for _ in range(60):  # events are written asynchronously: wait for ours to land
        texts = []
        for query in ({"related": {"id": [f"prefect.flow-run.{flow_run_id}"]}},
                      {"resource": {"id": [f"prefect.flow-run.{flow_run_id}"]}}):
            body = {"filter": {"occurred": {"since": since}, **query}, "limit": 50}
            page = httpx.post(f"{prefect_api}/events/filter", json=body).json()
            texts.append(json.dumps(page))
            while page.get("next_page"):
                page = httpx.get(page["next_page"]).json()
                texts.append(json.dumps(page))
        if "prefect-nemo.job.failed" in "".join(texts):
            break
        time.sleep(0.5)
    return "".join(texts)


def _logs_of_flow_run(client, flow_run_id: object, until: str) -> str:
    """The run's logs from the API; Prefect ships them in the background, so wait for `until`."""
    text = ""
    for _ in range(60):
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
        text = "\n".join(log.message for log in logs)
        if until in text:
            break
        time.sleep(0.5)
    return text
