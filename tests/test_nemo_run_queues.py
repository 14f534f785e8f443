"""Queues on run:ai (DGX Cloud) and Lepton, through Prefect, NeMo-Run and leptonai unchanged:
a job held by its run:ai project's quota or its Lepton node group's capacity is QUEUED with
the scheduler's reason, then runs; `queue_timeout_s` takes it out of the queue; JobSpec.queue
and JobSpec.priority are what each service calls them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prefect import flow

from prefect_nemo import lifecycle
from prefect_nemo.blocks.dgx_cloud import DGXCloudCluster
from prefect_nemo.blocks.lepton import LeptonWorkspace
from prefect_nemo.errors import InvalidJobSpec, QueueTimedOut
from prefect_nemo.jobs import JobResult, JobSpec, JobState
from prefect_nemo.tasks import run_job
from prefect_nemo.tasks.reporting import job_rows
from prefect_nemo.testing.lepton import LeptonServer
from prefect_nemo.testing.runai import RunaiServer
from tests.conftest import job_events
from tests.test_nemo_run_dgx_cloud import cluster_block, wait_for
from tests.test_nemo_run_lepton import TOKEN, job_posts, workspace_block

pytestmark = pytest.mark.nemo_run


def after(seconds: float, action: Callable[[], Any], when: Callable[[], Any]) -> threading.Thread:
    """In the background: once `when()` holds, wait `seconds`, then `action()`."""

    def run() -> None:
        wait_for(when, timeout_s=60)
        time.sleep(seconds)
        action()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


# -------------------------------------------------------------------------------------------------
# run:ai


@pytest.fixture
def runai() -> Iterator[RunaiServer]:
    projects = {"nemo-project": "4501", "team-b": "4502"}
    with RunaiServer(
        projects=projects, creating_s=0.05, initializing_s=0.05, running_s=0.3
    ) as server:
        yield server


@pytest.fixture
def dgx(runai: RunaiServer, tmp_path: Path) -> DGXCloudCluster:
    (tmp_path / "pvc").mkdir()
    return cluster_block(runai, tmp_path / "pvc", gpus_per_node=1)


def pending(runai: RunaiServer, name: str) -> bool:
    return any(w.phase(time.time()) == "Pending" for w in runai.by_name(name))


def test_runai_quota_queues_the_job_then_it_runs(
    prefect_api: str, runai: RunaiServer, dgx: DGXCloudCluster
) -> None:
    """Rules: run:ai's Pending ("waiting to be scheduled") is QUEUED with run:ai's
    phaseMessage as the reason and the project as the queue; JobSpec.queue is the run:ai
    project and JobSpec.priority the workload's spec.priorityClass; `timeout_s` counts from
    when the job runs, not while it is queued; the queue wait is in the JobResult, the events
    (`queued`, `admitted`) and the job table."""
    runai.set_quota("team-b", 1)
    runai.hold("blocker")
    backend = dgx.backend()
    blocker = lifecycle.submit_or_attach(
        backend, JobSpec(entrypoint="sleep 60", name="blocker", queue="team-b"),
        scope="flow-run:quota", key="blocker",
    )  # fmt: skip
    wait_for(lambda: backend.find(blocker.handle.job_id).state is JobState.RUNNING)
    spec = JobSpec(
        entrypoint="true", name="queued", queue="team-b", priority="high", timeout_s=3
    )

    @flow
    def queued_flow() -> JobResult:
        return run_job(spec, cluster=dgx)

    # the blocker ends 5 s after the job is seen waiting: longer than its timeout_s
    freed = after(
        5,
        lambda: backend.request_stop(blocker.handle.job_id),
        lambda: any(pending(runai, w.requested_name) for w in runai.workloads.values()),
    )
    state = queued_flow(return_state=True)
    result = state.result()
    freed.join()
    assert result.state is JobState.SUCCEEDED
    assert result.queue_wait_s is not None and result.queue_wait_s > 4.5

    (post,) = [p for p in runai.requests.find("POST", "/workloads/trainings")
               if p.body and p.body["name"] == result.handle.job_id]  # not the suspends
    assert post.body["projectId"] == "4502"  # team-b: JobSpec.queue is the project
    assert post.body["spec"]["priorityClass"] == "high"

    events = job_events(prefect_api, result.handle.resource_id, "prefect-nemo.job.succeeded")
    names = [e["event"] for e in events]
    assert "prefect-nemo.job.queued" in names and "prefect-nemo.job.admitted" in names
    queued = next(e for e in events if e["event"] == "prefect-nemo.job.queued")
    assert queued["payload"]["queue"]["queue"] == "team-b"
    assert "quota" in queued["payload"]["queue"]["reason"]  # run:ai's phaseMessage
    admitted = next(e for e in events if e["event"] == "prefect-nemo.job.admitted")
    assert admitted["payload"]["this_wait_s"] > 4.5
    (row,) = [r for r in job_rows(str(state.state_details.flow_run_id))
              if r["job_id"] == result.handle.job_id]  # fmt: skip
    assert row["state"] == "SUCCEEDED" and row["queue"] == "team-b" and row["queue_wait_s"] > 4.5


def test_runai_queue_timeout_takes_the_job_out_of_the_queue(
    prefect_api: str, runai: RunaiServer, dgx: DGXCloudCluster
) -> None:
    """Rule: "when queue_timeout_s expires the queued job is removed", and the task fails
    naming the queue and the scheduler's reason; on run:ai the workload is suspended (the
    documented stop): nothing of it stays Pending or holds quota."""
    runai.set_quota("nemo-project", 0)
    spec = JobSpec(entrypoint="true", name="never", queue_timeout_s=1.5)

    @flow
    def timed_out() -> JobResult:
        return run_job(spec, cluster=dgx)

    state = timed_out(return_state=True)
    with pytest.raises(QueueTimedOut, match=r"nemo-project.*quota.*queue_timeout_s of 1.5s"):
        state.result()
    (workload,) = runai.workloads.values()
    wait_for(lambda: workload.phase(time.time()) == "Stopped")
    assert runai.requests.find("POST", f"/workloads/trainings/{workload.id}/suspend")
    assert not [w for w in runai.workloads.values() if w.waiting]


def test_runai_bad_priority_and_project_are_refused_before_anything_is_sent(
    runai: RunaiServer, dgx: DGXCloudCluster
) -> None:
    """Rule: clear errors naming the field and the fix, before anything is sent."""
    backend = dgx.backend()
    with pytest.raises(InvalidJobSpec, match=r"JobSpec.priority='urgent'.*very-high"):
        backend.validate(JobSpec(entrypoint="true", priority="urgent"))
    with pytest.raises(InvalidJobSpec, match=r"DGXCloudCluster.priority_class='top'"):
        dgx.model_copy(update={"priority_class": "top"}).backend().validate(
            JobSpec(entrypoint="true")
        )
    with pytest.raises(InvalidJobSpec, match=r"JobSpec.queue.*'nope'.*team-b"):
        lifecycle.submit_or_attach(
            backend, JobSpec(entrypoint="true", queue="nope"), scope="flow-run:x", key="x"
        )
    assert not runai.requests.find("POST", "/workloads")


# -------------------------------------------------------------------------------------------------
# Lepton


@pytest.fixture
def lepton() -> Iterator[LeptonServer]:
    groups = {"nemo-nodes": 2, "small-nodes": 1}
    with LeptonServer(token=TOKEN, node_groups=groups, start_s=0.1, running_s=0.4) as server:
        yield server


@pytest.fixture
def workspace(lepton: LeptonServer, tmp_path: Path) -> LeptonWorkspace:
    return workspace_block(lepton, tmp_path)


def queueing(lepton: LeptonServer) -> bool:
    now = time.time()
    return any(j.state(now) == "Queueing" for j in lepton.jobs.values())


def test_lepton_full_node_group_queues_the_job_then_it_runs(
    prefect_api: str, lepton: LeptonServer, workspace: LeptonWorkspace
) -> None:
    """Rules: Lepton's Queueing is QUEUED (reason: Lepton's state, queue: the node group);
    JobSpec.queue is the node group and JobSpec.priority its queue_config.priority_class
    ("high" is leptonai's short name of high-7000); `timeout_s` does not count queued time;
    the queue wait is in the JobResult, the events and the job table."""
    lepton.hold("blocker")
    backend = workspace.backend()
    blocker = lifecycle.submit_or_attach(
        backend, JobSpec(entrypoint="sleep 60", name="blocker", queue="small-nodes"),
        scope="flow-run:cap", key="blocker",
    )  # fmt: skip
    wait_for(lambda: backend.find(blocker.handle.job_id).state is JobState.RUNNING)
    spec = JobSpec(
        entrypoint="true", name="queued", queue="small-nodes", priority="high", timeout_s=3
    )

    @flow
    def queued_flow() -> JobResult:
        return run_job(spec, cluster=workspace)

    freed = after(5, lambda: backend.request_stop(blocker.handle.job_id), lambda: queueing(lepton))
    state = queued_flow(return_state=True)
    result = state.result()
    freed.join()
    assert result.state is JobState.SUCCEEDED
    assert result.queue_wait_s is not None and result.queue_wait_s > 4.5

    post = next(p for p in job_posts(lepton) if p.body["metadata"]["id"] == result.handle.job_id)
    small = lepton.node_groups["small-nodes"][0]
    assert post.body["spec"]["affinity"]["allowed_dedicated_node_groups"] == [small]
    assert post.body["spec"]["queue_config"]["priority_class"] == "high-7000"

    events = job_events(prefect_api, result.handle.resource_id, "prefect-nemo.job.succeeded")
    queued = next(e for e in events if e["event"] == "prefect-nemo.job.queued")
    assert queued["payload"]["queue"]["queue"] == "small-nodes"
    assert "Queueing" in queued["payload"]["queue"]["reason"]
    assert "prefect-nemo.job.admitted" in [e["event"] for e in events]
    (row,) = [r for r in job_rows(str(state.state_details.flow_run_id))
              if r["job_id"] == result.handle.job_id]  # fmt: skip
    assert row["queue"] == "small-nodes" and row["queue_wait_s"] > 4.5


def test_lepton_queue_timeout_takes_the_job_out_of_the_queue(
    prefect_api: str, lepton: LeptonServer, workspace: LeptonWorkspace
) -> None:
    """Rule: "when queue_timeout_s expires the queued job is removed" (the task fails naming
    the queue); on Lepton it is stopped (PATCH spec.stopped), so it leaves the node group's
    queue: nothing of it is left Queueing."""
    lepton.hold("")
    backend = workspace.backend()
    hog = lifecycle.submit_or_attach(
        backend, JobSpec(entrypoint="sleep 60", name="hog", queue="small-nodes"),
        scope="flow-run:qt", key="hog",
    )  # fmt: skip
    wait_for(lambda: backend.find(hog.handle.job_id).state is JobState.RUNNING)
    spec = JobSpec(entrypoint="true", name="never", queue="small-nodes", queue_timeout_s=1.5)

    @flow
    def timed_out() -> JobResult:
        return run_job(spec, cluster=workspace)

    state = timed_out(return_state=True)
    with pytest.raises(QueueTimedOut, match=r"small-nodes.*Queueing.*queue_timeout_s of 1.5s"):
        state.result()
    wait_for(lambda: not queueing(lepton))
    (never,) = [p.body["metadata"]["id"] for p in job_posts(lepton)
                if p.body["metadata"]["id"] != hog.handle.job_id]  # fmt: skip
    assert lepton.requests.find("PATCH", f"/jobs/{never}")  # stopped: out of the queue
    wait_for(lambda: lepton.jobs[never].state(time.time()) == "Stopped")


def test_lepton_bad_priority_and_node_group_are_refused_before_anything_is_sent(
    lepton: LeptonServer, workspace: LeptonWorkspace
) -> None:
    """Rule: clear errors naming the field and the fix, before anything is sent."""
    backend = workspace.backend()
    with pytest.raises(InvalidJobSpec, match=r"JobSpec.priority='urgent'.*high-9000"):
        backend.validate(JobSpec(entrypoint="true", priority="urgent"))
    with pytest.raises(InvalidJobSpec, match=r"JobSpec.queue.*'nope'.*small-nodes"):
        lifecycle.submit_or_attach(
            backend, JobSpec(entrypoint="true", queue="nope"), scope="flow-run:x", key="x"
        )
    assert not job_posts(lepton)
