"""A TrainJob's whole log, on the real Kubeflow Trainer (v2.3.0), JobSet and Job controllers
of the real control plane, its pods run by the node agent (issue 29)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from prefect import flow

from prefect_nemo import JobSpec, JobState, run_job
from prefect_nemo.log_files import LOGS_DIR_ENV
from prefect_nemo.tasks.reporting import job_rows
from tests.conftest import IN_CI

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("control-plane")]
LINES = 10_000


def test_a_trainjob_printing_10000_lines_and_exiting_at_once_loses_none(
    control_plane: Any, prefect_api: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 29: "A job that prints 10,000 lines and exits at once: all 10,000 reach the task log
    and the saved file, on ... Kubeflow Trainer" ("the driver / pod log is read to its end
    after the terminal state (a line printed right before exit always arrives)"). The pod's
    output is buffered: it all lands at exit."""
    from prefect_nemo.blocks import KubeflowTrainerCluster, KubernetesCluster
    from prefect_nemo.testing.control_plane.controllers import TRAINER_NAMESPACE

    plane = control_plane
    if reason := plane.controllers_unavailable:
        (pytest.fail if IN_CI else pytest.skip)(reason)
    monkeypatch.setenv(LOGS_DIR_ENV, str(tmp_path / "logs"))
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    collect = Collect(logging.INFO)
    logging.getLogger("prefect").addHandler(collect)
    kube = KubernetesCluster(kubeconfig=plane.kubeconfig(), namespace=TRAINER_NAMESPACE)
    block = KubeflowTrainerCluster(kubernetes=kube, image="python:3.11-slim")
    code = f"[print(f'line {{n:05d}}') for n in range({LINES})]"
    spec = JobSpec(entrypoint=f'python -c "{code}"', name="ten-thousand-lines")

    @flow
    def printing_flow() -> Any:
        return run_job(spec, cluster=block)

    try:
        state = printing_flow(return_state=True)
    finally:
        logging.getLogger("prefect").removeHandler(collect)
    result = state.result()
    assert result.state is JobState.SUCCEEDED
    job_id, flow_run_id = result.handle.job_id, str(state.state_details.flow_run_id)
    expected = [f"line {n:05d}" for n in range(LINES)]
    (row,) = job_rows(flow_run_id)
    path = Path(row["log"])
    assert path.is_relative_to(tmp_path / "logs")
    saved = [ln for ln in path.read_text().splitlines() if ln.startswith("line ")]
    assert saved == expected, f"{len(saved)} of {LINES} lines in the saved file"
    in_task_log = [
        m.split("] ", 1)[1] for m in messages if m.startswith(f"[{job_id}") and "] line " in m
    ]
    assert in_task_log == expected, f"{len(in_task_log)} of {LINES} lines in the task log"
