"""Every job's log reaches the task log and a saved file to its last line: real Prefect API,
real local Ray (Ray Jobs)."""

from __future__ import annotations

import asyncio
import logging
import re
import stat
import time
from pathlib import Path

import pytest
from prefect import flow, task

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


def test_rays_entrypoint_line_never_cuts_a_line_of_a_job_that_prints_at_once(
    ray_head, ray_client
) -> None:
    """Ray's job supervisor writes "Running entrypoint for job <id>: <entrypoint>" through a
    buffered file it hands to the job's process before flushing it (ray/dashboard/modules/job/
    job_supervisor.py, `_exec_entrypoint`), so a job that prints at once can have Ray's line land
    inside one of its own (CI's KubeRay run: "line 0Running entrypoint for job ...: seq -f 'line
    %05g' 0 9999" then "2606"). Twelve such jobs on the real Ray head: in Ray's own log its line
    cut a job's line in some of them (6 of 12 here); read through our backend, whole and
    streamed, every job line is whole and in order, and Ray's line stands on its own."""
    from prefect_nemo.backends import ray_logs

    backend = ray_head.block().backend()
    entrypoint, count = "seq -f 'line %06g' 0 99999", 100_000
    ids = [ray_client.submit_job(entrypoint=entrypoint) for _ in range(12)]
    for job_id in ids:
        deadline = time.monotonic() + 120
        while not ray_client.get_job_status(job_id).is_terminal():
            assert time.monotonic() < deadline, f"{job_id} did not end"
            time.sleep(0.2)

    raw = {job_id: ray_client.get_job_logs(job_id) for job_id in ids}
    cut = [job_id for job_id in ids if ray_logs.cut_at(raw[job_id], job_id) is not None]
    assert cut, "in none of 12 jobs did Ray's line cut a job line: the race was not played"

    async def streamed(job_id: str) -> str:
        return "".join([chunk async for chunk in backend.tail_logs(job_id)])

    def check(how: str, job_id: str, text: str) -> None:
        lines = text.splitlines()
        assert [ln for ln in lines if ln.startswith("line ")] == expected, (how, job_id)
        assert f"Running entrypoint for job {job_id}: {entrypoint}" in lines, (how, job_id)
        assert len(text) == len(raw[job_id]), "the same text, Ray's line moved"

    expected = [f"line {n:06d}" for n in range(count)]
    for job_id in ids:
        check("read whole", job_id, backend.logs(job_id))
    for job_id in cut[:2]:  # Ray's tail takes ~5 s to stream one of these logs
        check("streamed", job_id, asyncio.run(streamed(job_id)))
    print(f"rays_line_cut_a_job_line={len(cut)} of {len(ids)}")


def test_a_saved_log_is_copied_into_a_storage_block(prefect_api, tmp_path: Path) -> None:
    """ "saved [...] to a Prefect storage block or a local folder by default": the cluster
    block's `log_storage` names a writable file system block; the copy keeps the file's
    <flow run>/<job id>.log place and is what the row links. run_jobs' waits are in an async
    task, where Prefect's block methods return coroutines: the copy is made there too."""
    from prefect.filesystems import LocalFileSystem, RemoteFileSystem

    from prefect_nemo.tasks.reporting import store_log

    saved = tmp_path / "saved" / "flow-run-1" / "job-1.log"
    saved.parent.mkdir(parents=True)
    saved.write_text("one\ntwo\n")
    LocalFileSystem(basepath=str(tmp_path / "kept")).save("i29-job-logs", overwrite=True)
    where = store_log("local-file-system/i29-job-logs", saved)
    assert Path(where) == tmp_path / "kept" / "flow-run-1" / "job-1.log"
    assert Path(where).read_text() == "one\ntwo\n"

    # a RemoteFileSystem takes no file:// base path (Prefect sends local paths to
    # LocalFileSystem); fsspec's in-memory file system stands for S3 and the like
    remote = RemoteFileSystem(basepath=f"memory://i29-job-logs/{tmp_path.name}")
    remote.save("i29-job-logs", overwrite=True)
    where = store_log("remote-file-system/i29-job-logs", saved)
    assert where == f"memory://i29-job-logs/{tmp_path.name}/flow-run-1/job-1.log"
    assert remote.read_path("flow-run-1/job-1.log") == b"one\ntwo\n"

    @task
    async def copy_in_an_async_task(path: Path) -> str:
        # as the batch's wait does: the blocking work on a thread, in the task's context
        return await asyncio.to_thread(store_log, "local-file-system/i29-job-logs", path)

    @flow
    async def copying_flow(path: Path) -> str:
        return await copy_in_an_async_task(path)

    other = saved.with_name("job-2.log")
    other.write_text("three\n")
    where = asyncio.run(copying_flow(other))
    assert Path(where).read_text() == "three\n"


def test_run_jobs_saves_a_failed_jobs_log_unstreamed_copies_it_and_masks_secrets(
    cluster, prefect_api, caplog, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ "every job's whole log is saved [...] to a Prefect storage block or a local folder":
    run_jobs' jobs too, whose logs it does not follow (stream_logs=False, its default): a
    failed job's log is read whole once it ended (the read its tail needs anyway), into the
    saved file alone (not the task log), and copied into the cluster block's `log_storage`,
    which the row links; a succeeded job's log is not read (our choice: run_jobs' request
    budget). "secrets must never reach files on disk": the secret is masked in the file and in
    the copy."""
    from prefect.filesystems import LocalFileSystem
    from pydantic import SecretStr

    from prefect_nemo import run_jobs

    secret = "batch-secret-5be1c0"
    monkeypatch.setenv(LOGS_DIR_ENV, str(tmp_path / "logs"))
    caplog.set_level(logging.INFO)
    LocalFileSystem(basepath=str(tmp_path / "kept")).save("i29-batch-logs", overwrite=True)
    block = cluster.model_copy(update={"log_storage": "local-file-system/i29-batch-logs"})
    code = tmp_path / "job"
    code.mkdir()
    (code / "job.py").write_text(
        "import os, sys\n"
        "print('\\n'.join(f'line {n:03d}' for n in range(200)))\n"
        "print('token=' + os.environ['TOKEN'])\n"
        "sys.exit(int(os.environ['EXIT']))\n"
    )
    specs = [
        JobSpec(
            entrypoint="python job.py",
            name=f"saved-{exit_code}",
            working_dir=code,
            env={"TOKEN": SecretStr(secret), "EXIT": str(exit_code)},
        )
        for exit_code in (0, 3)
    ]

    @flow
    def batch_flow():
        return run_jobs(specs, block, raise_on_failure=False)

    state = batch_flow(return_state=True)
    results = state.result()
    flow_run_id = str(state.state_details.flow_run_id)
    assert [r.state for r in results] == [JobState.SUCCEEDED, JobState.FAILED]
    expected = [f"line {n:03d}" for n in range(200)] + ["token=**********"]
    rows = {row["job_id"]: row for row in job_rows(flow_run_id)}
    succeeded = results[0].handle.job_id
    assert not (tmp_path / "logs" / flow_run_id / f"{succeeded}.log").exists()
    assert not rows[succeeded].get("log")
    for result in results[1:]:
        job_id = result.handle.job_id
        path = tmp_path / "logs" / flow_run_id / f"{job_id}.log"
        copy = tmp_path / "kept" / flow_run_id / f"{job_id}.log"
        for kept in (path, copy):
            text = kept.read_text()
            assert secret not in text, f"the secret reached {kept}"
            assert [s for s in text.splitlines() if s in expected] == expected, kept
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert rows[job_id]["log"] == str(copy)
        assert not [r for r in caplog.records if r.getMessage().startswith(f"[{job_id}] line ")]
    assert "token=**********" in results[1].log_tail, "the tail came from the same read"
