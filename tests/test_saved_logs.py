"""Every job's log reaches the task log and a saved file to its last line: real Prefect API,
real local Ray (Ray Jobs)."""

from __future__ import annotations

import logging
import re
import stat
import time
from pathlib import Path

import pytest
from prefect import flow

from prefect_nemo import JobSpec, JobState, run_job
from prefect_nemo.log_files import LOGS_DIR_ENV
from prefect_nemo.tasks.reporting import job_rows
from tests.conftest import job_events

pytestmark = pytest.mark.slow

LINES = 10_000


def test_a_job_printing_10000_lines_and_exiting_at_once_loses_none(
    cluster, prefect_api, caplog, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 29: "A job that prints 10,000 lines and exits at once: all 10,000 reach the task log
    and the saved file" ("the driver / pod log is read to its end after the terminal state (a
    line printed right before exit always arrives); every job's whole log is saved as it streams
    [...] and linked from the job table"). The job's output is buffered: it all lands at exit."""
    monkeypatch.setenv(LOGS_DIR_ENV, str(tmp_path / "logs"))
    caplog.set_level(logging.INFO)
    spec = JobSpec(
        entrypoint=f"python -c \"[print(f'line {{n:05d}}') for n in range({LINES})]\"",
        name="ten-thousand-lines",
    )

    @flow
    def printing_flow():
        return run_job(spec, cluster=cluster)

    started = time.monotonic()
    state = printing_flow(return_state=True)
    result = state.result()
    took = time.monotonic() - started
    assert result.state is JobState.SUCCEEDED
    job_id, flow_run_id = result.handle.job_id, str(state.state_details.flow_run_id)
    expected = [f"line {n:05d}" for n in range(LINES)]

    path = tmp_path / "logs" / flow_run_id / f"{job_id}.log"
    saved = [line for line in path.read_text().splitlines() if re.fullmatch(r"line \d{5}", line)]
    assert saved == expected, f"{len(saved)} of {LINES} lines saved"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600

    in_task_log = [
        m.removeprefix(f"[{job_id}] ")
        for r in caplog.records
        if (m := r.getMessage()).startswith(f"[{job_id}] line ")
    ]
    assert in_task_log == expected, f"{len(in_task_log)} of {LINES} lines in the task log"

    (row,) = job_rows(flow_run_id)
    assert row["log"] == str(path)
    events = job_events(prefect_api, result.handle.resource_id, "prefect-nemo.job.succeeded")
    (ended,) = [e for e in events if e["event"] == "prefect-nemo.job.succeeded"]
    assert ended["payload"]["log"] == str(path)
    print(f"saved_log_lines={len(saved)} task_log_lines={len(in_task_log)} took_s={took:.1f}")


def test_a_saved_log_is_copied_into_a_storage_block(prefect_api, tmp_path: Path) -> None:
    """ "saved [...] to a Prefect storage block or a local folder by default": the cluster
    block's `log_storage` names a writable file system block; the copy keeps the file's
    <flow run>/<job id>.log place and is what the row links."""
    from prefect.filesystems import LocalFileSystem, RemoteFileSystem

    from prefect_nemo.tasks.reporting import store_log

    saved = tmp_path / "saved" / "flow-run-1" / "job-1.log"
    saved.parent.mkdir(parents=True)
    saved.write_text("one\ntwo\n")
    LocalFileSystem(basepath=str(tmp_path / "kept")).save("i29-job-logs", overwrite=True)
    where = store_log("local-file-system/i29-job-logs", saved)
    assert Path(where) == tmp_path / "kept" / "flow-run-1" / "job-1.log"
    assert Path(where).read_text() == "one\ntwo\n"
    RemoteFileSystem(basepath=f"file://{tmp_path}/remote").save("i29-job-logs", overwrite=True)
    where = store_log("remote-file-system/i29-job-logs", saved)
    assert (tmp_path / "remote" / "flow-run-1" / "job-1.log").read_text() == "one\ntwo\n", where
