"""Issue 31, "See training from Prefect", through NeMo-Run: a job printing `progress(...)` 1,000
times shows its progress, metrics and charts in Prefect, on the real local Slurm (NeMo-Run's
Slurm executor over SSH, the log read back by byte offset), on the run:ai (DGX Cloud) kit whose
pods really run (their log files on the PVC) and on the Lepton kit whose pods really run (the log
read from Lepton's replica log endpoint, serving their output). The checks are
tests/progress_checks.py's, the same as Ray Jobs'."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prefect import flow

from prefect_nemo import JobSpec, run_job
from prefect_nemo.placement import PlacementSpec
from prefect_nemo.testing.lepton import LeptonServer
from prefect_nemo.testing.runai import RunaiServer
from tests import progress_checks
from tests.test_nemo_run_dgx_cloud import SECRET as RUNAI_SECRET
from tests.test_nemo_run_dgx_cloud import cluster_block
from tests.test_nemo_run_lepton import TOKEN as LEPTON_TOKEN
from tests.test_nemo_run_lepton import workspace_block
from tests.test_nemo_run_slurm import slurm_block

pytestmark = [pytest.mark.nemo_run, pytest.mark.slow]


def run_reporting_job(
    block: Any, tmp_path: Path, prefect_api: str, caplog: Any, capfd: Any, *, secret_env: bool
) -> tuple[Any, float, list[dict]]:
    """progress_checks' run, on one CPU node (no GPU on these machines)."""
    return progress_checks.run_reporting_job(
        block, tmp_path / "code", prefect_api, caplog, capfd, secret_env=secret_env,
        placement=PlacementSpec(nodes=1, gpus_per_node=0),
    )  # fmt: skip


def test_slurm_job_reporting_1000_steps_shows_progress_metrics_and_charts(
    slurm, prefect_api, tmp_path, caplog, capfd
):
    block = slurm_block(slurm, tmp_path / "jobs")
    _, took, progress = run_reporting_job(
        block, tmp_path, prefect_api, caplog, capfd, secret_env=True
    )
    print(f"slurm 1000 steps: flow {took:.1f}s, {len(progress)} progress events")


@pytest.fixture
def runai() -> Iterator[RunaiServer]:
    """The loopback run:ai, its pods run as local processes."""
    with RunaiServer(
        client_secret=RUNAI_SECRET, creating_s=0.05, initializing_s=0.05, execute=True
    ) as server:
        yield server


def test_dgx_cloud_job_reporting_1000_steps_shows_progress_metrics_and_charts(
    runai, prefect_api, tmp_path, caplog, capfd
):
    pvc = tmp_path / "pvc"
    pvc.mkdir()
    block = cluster_block(runai, pvc)
    # run:ai takes no secret values in JobSpec.env ("secret values would be stored in the
    # run:ai workload in plain text"): the job's CANARY is a plain stand-in
    _, took, progress = run_reporting_job(
        block, tmp_path, prefect_api, caplog, capfd, secret_env=False
    )
    print(f"dgx-cloud 1000 steps: flow {took:.1f}s, {len(progress)} progress events")


@pytest.fixture
def lepton() -> Iterator[LeptonServer]:
    """The loopback Lepton workspace, its pods run as local processes."""
    with LeptonServer(token=LEPTON_TOKEN, start_s=0.05, execute=True) as server:
        yield server


def test_lepton_job_reporting_1000_steps_shows_progress_metrics_and_charts(
    lepton, prefect_api, tmp_path, caplog, capfd
):
    """Issue 31: "A job that reports 1,000 steps shows its progress and metrics in Prefect on
    ... the run:ai / Lepton kits". NeMo-Run's data mover and launch script really run (the code
    unpacked by rank 0's pre-launch line), the job's state comes from its exit code and its
    reports from Lepton's replica log endpoint."""
    block = workspace_block(lepton, tmp_path)
    # Lepton takes no secret values in JobSpec.env (a job's env values are stored in the job in
    # plain text; secrets go by reference, LeptonWorkspace.secret_vars): a plain CANARY
    _, took, progress = run_reporting_job(
        block, tmp_path, prefect_api, caplog, capfd, secret_env=False
    )
    print(f"lepton 1000 steps: flow {took:.1f}s, {len(progress)} progress events")


def test_slurm_log_with_non_utf8_and_split_characters_loses_no_line_or_report(
    slurm, prefect_api, tmp_path, caplog
):
    """The Slurm log is read by byte offset over SSH, each second. Non-ASCII text (a progress
    bar's blocks, accents) and bytes that are not UTF-8 at all must not shift that offset: every
    line reaches the task log whole, every report is read."""
    caplog.set_level(logging.INFO)
    body = (
        "for n in range(600):\n"
        "    print(f'line {n:04d} ' + 'é█' * (n % 7) + 'x' * (n % 5), flush=True)\n"
        "    if n % 100 == 0:\n"
        "        sys.stdout.buffer.write(b'latin-1 caf\\xe9\\n'); sys.stdout.flush()\n"
        "    progress(n + 1, 600, loss=1.0 / (n + 1))\n"
        "    time.sleep(0.005)\n"
    )
    block = slurm_block(slurm, tmp_path / "jobs")
    spec = JobSpec(
        entrypoint="python3 job.py", name="mixed",
        working_dir=progress_checks.job_dir(tmp_path / "code", body),
    )  # fmt: skip

    @flow
    def mixed_flow():
        return run_job(spec, cluster=block)

    result = mixed_flow()
    job_id = result.handle.job_id
    said = [
        m.removeprefix(f"[{job_id}] ")
        for r in caplog.records
        if (m := r.getMessage()).startswith(f"[{job_id}] ")
    ]
    expected = []
    for n in range(600):
        expected.append(f"line {n:04d} " + "é█" * (n % 7) + "x" * (n % 5))
        if n % 100 == 0:
            expected.append("latin-1 caf\ufffd")  # the byte that is no UTF-8, replaced
    assert said == expected, [s for s in said if s not in expected][:5]
    summaries = [r.getMessage() for r in caplog.records if "step 600/600" in r.getMessage()]
    assert summaries, "the last report was read"
