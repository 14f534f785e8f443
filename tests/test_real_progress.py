"""A job's progress on the real Kubeflow Trainer (v2.3.0): the log line Prefect reads and the
`status.trainerStatus` the Trainer's own status server stores (issue 31), on the real control
plane with its pods run by the node agent."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import IN_CI
from tests.progress_checks import CANARY, run_reporting_job

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("control-plane")]


def test_a_trainjob_reporting_1000_steps_shows_in_prefect_and_in_its_trainer_status(
    control_plane: Any, prefect_api: str, tmp_path: Path, caplog: Any, capfd: Any
) -> None:
    """Issue 31: "A job that reports 1,000 steps shows its progress and metrics in Prefect on
    ... Kubeflow Trainer (the real v2.3.0 controller, `trainerStatus`)". KEP-2779 (Trainer
    progress and metrics): "Currently, users need to inspect logs to determine progress"; with
    the TrainJobStatus feature gate the controller gives each trainer container
    KUBEFLOW_TRAINER_SERVER_URL, a CA and a projected token (pkg/runtime/framework/plugins/
    trainjobstatus), and its status server applies what a container posts as the TrainJob's
    `status.trainerStatus` (pkg/statusserver/server.go). Here the job's `progress()` calls do
    both: Prefect shows the log lines' reports (run_reporting_job's checks), and the TrainJob as
    the controller stored it says 100% with the last step's metrics. The metric whose name holds
    the secret is not posted (its name is no identifier), so the stored TrainJob holds no
    secret."""
    from kubernetes import client

    from prefect_nemo.blocks import KubeflowTrainerCluster, KubernetesCluster
    from prefect_nemo.testing.control_plane.controllers import TRAINER_NAMESPACE

    plane = control_plane
    if reason := plane.controllers_unavailable or plane.trainer_status_unavailable:
        (pytest.fail if IN_CI else pytest.skip)(reason)
    kube = KubernetesCluster(kubeconfig=plane.kubeconfig(), namespace=TRAINER_NAMESPACE)
    block = KubeflowTrainerCluster(kubernetes=kube, image="python:3.11-slim")
    result, took, _ = run_reporting_job(block, tmp_path / "job", prefect_api, caplog, capfd)

    api = client.CustomObjectsApi(plane.api_client())
    trainjob = api.get_namespaced_custom_object(
        "trainer.kubeflow.org", "v1alpha1", TRAINER_NAMESPACE, "trainjobs", result.handle.job_id
    )
    status = trainjob["status"]["trainerStatus"]
    assert status["progressPercentage"] == 100
    assert status["lastUpdatedTime"]
    # the last post is the last report's: progress(1000, 1000, nan_check=nan)
    assert status["metrics"] == [{"name": "nan_check", "value": "nan"}]
    assert status.get("estimatedRemainingSeconds", 0) == 0
    # the status server applies it as its own field manager (pkg/statusserver/server.go)
    managers = {m["manager"] for m in trainjob["metadata"].get("managedFields") or []}
    assert "trainer-status" in managers, managers
    assert CANARY not in json.dumps(trainjob), "the secret reached the stored TrainJob"
    # the Trainer gave the pod its status server (the feature is on), and its log says no post
    # failed
    log = block.backend().logs(result.handle.job_id)
    assert "posting progress" not in log, log[-2000:]
    assert took < 300


# A job that reports to the Trainer alone (no report line in its log): 10% ... 100%.
POSTING_ONLY_JOB = (
    "from report import StatusPoster\n"
    "poster = StatusPoster(every_s=0)\n"
    "print('starting', flush=True)\n"
    "for n in range(1, 11):\n"
    "    poster.report(10 * n, 100, {'loss': 1.0 / n})\n"
    "    time.sleep(1.5)\n"
)


def test_a_trainjob_reporting_to_the_trainer_alone_shows_its_progress_in_prefect(
    control_plane: Any, prefect_api: str, tmp_path: Path
) -> None:
    """The backend's side of issue 31 ("read `status.trainerStatus` as well where the
    controller publishes it"): a job whose log carries no report line, which posts only to the
    Trainer's status server, still shows its progress and metrics in Prefect, read from the
    TrainJob's `status.trainerStatus` as the real controller stored it (percent as the step of
    100)."""
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from prefect_nemo import JobSpec, JobState, run_job
    from prefect_nemo.blocks import KubeflowTrainerCluster, KubernetesCluster
    from prefect_nemo.testing.control_plane.controllers import TRAINER_NAMESPACE
    from tests.progress_checks import job_dir

    plane = control_plane
    if reason := plane.controllers_unavailable or plane.trainer_status_unavailable:
        (pytest.fail if IN_CI else pytest.skip)(reason)
    kube = KubernetesCluster(kubeconfig=plane.kubeconfig(), namespace=TRAINER_NAMESPACE)
    block = KubeflowTrainerCluster(kubernetes=kube, image="python:3.11-slim")
    spec = JobSpec(entrypoint="python3 job.py", name="poster",
                   working_dir=job_dir(tmp_path / "job", POSTING_ONLY_JOB))  # fmt: skip

    @flow
    def posting_flow() -> Any:
        return run_job(spec, cluster=block)

    state = posting_flow(return_state=True)
    result = state.result()
    assert result.state is JobState.SUCCEEDED
    assert "@@prefect-nemo.report" not in block.backend().logs(result.handle.job_id)
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(flow_run_filter=FlowRunFilter(
            id=FlowRunFilterId(any_=[state.state_details.flow_run_id])))  # fmt: skip
    by_kind = {a.type: a for a in artifacts if result.handle.job_id in (a.description or "")}
    assert by_kind["progress"].data == 100.0, by_kind["progress"].description
    rows = {row["metric"]: row for row in json.loads(by_kind["table"].data)}
    assert rows["loss"]["value"] == pytest.approx(0.1) and rows["loss"]["step"] == 100
