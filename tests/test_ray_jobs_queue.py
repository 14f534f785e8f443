"""A Ray job that waits for resources no node has yet is QUEUED, on the real local Ray head: a
worker node with the resource joins (`ray start --address`), the job runs and succeeds, and its
`timeout_s` never counted the wait.

Ray's rules checked (ray 2.60, dashboard/modules/job): a job stays PENDING until its supervisor
actor, which holds the entrypoint's resources, is scheduled ("Job has not started yet. It may
be waiting for resources (CPUs, GPUs, memory, custom resources) to become available.", the
message JobInfo carries while PENDING whenever entrypoint resources were asked).
"""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from prefect import flow

from prefect_nemo.jobs import JobResult, JobSpec, JobState, Resources
from prefect_nemo.local_ray import LocalRayCluster
from prefect_nemo.tasks import run_job, submit_job, wait_for_job
from tests.conftest import job_events, wait_until
from tests.ray_nodes import worker_node

pytestmark = pytest.mark.slow

RAY_WAITING = "It may be waiting for resources (CPUs, GPUs, memory, custom resources)"


def test_ray_job_waiting_for_resources_is_queued_then_runs(
    prefect_api: str, ray_head: LocalRayCluster
) -> None:
    """Rules: a PENDING job whose entrypoint asks for a resource no alive node has is QUEUED,
    its reason Ray's own message ("It may be waiting for resources ... to become available");
    once a node with it joins, the job runs (QUEUED, then RUNNING, then SUCCEEDED);
    `timeout_s` does not count the wait in the queue, so a wait longer than it does not fire."""
    block = ray_head.block()
    backend = block.backend()
    resource = f"queue_test_{uuid.uuid4().hex[:8]}"  # only the node added later has it
    spec = JobSpec(
        entrypoint="sleep 1", name="waits", resources=Resources(custom={resource: 1}), timeout_s=15
    )  # 15 s: once the node joins, the job is PENDING while Ray starts its worker there (8 s
    # seen under load), which timeout_s counts, as Kubernetes' activeDeadlineSeconds does
    submitted: list[str] = []

    def queued() -> bool:
        return bool(submitted) and backend.find(submitted[0]).state is JobState.QUEUED

    @flow
    def waits() -> JobResult:
        handle = submit_job(spec, cluster=block)
        submitted.append(handle.job_id)
        return wait_for_job(handle, cluster=block, timeout_s=spec.timeout_s)

    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(waits)
        wait_until(queued, timeout_s=60)
        time.sleep(16)  # longer than timeout_s
        with worker_node(ray_head, {resource: 1}, num_cpus=0):  # nothing else lands there
            try:
                result = running.result(timeout=120)
            except TimeoutError:  # stop the job, or leaving the pool waits on its flow forever
                backend.request_stop(submitted[0])
                raise
    assert result.state is JobState.SUCCEEDED
    assert result.queue_wait_s is not None and result.queue_wait_s > 15.5

    events = job_events(prefect_api, result.handle.resource_id, "prefect-nemo.job.succeeded")
    names = [e["event"] for e in events]
    assert names.index("prefect-nemo.job.queued") < names.index("prefect-nemo.job.running")
    assert names.index("prefect-nemo.job.running") < names.index("prefect-nemo.job.succeeded")
    assert "prefect-nemo.job.admitted" in names
    reason = next(e for e in events if e["event"] == "prefect-nemo.job.queued")["payload"]
    assert RAY_WAITING in reason["queue"]["reason"]
    assert f"no alive node has {resource}: 1" in reason["queue"]["reason"]


def test_ray_job_whose_resources_exist_is_not_queued(
    prefect_api: str, ray_head: LocalRayCluster
) -> None:
    """Rule: Ray's PENDING also covers a job whose resources some node has (its runtime_env
    being set up, the same "may be waiting" message): that job is not reported QUEUED."""
    block = ray_head.block()
    spec = JobSpec(entrypoint="true", name="fits", resources=Resources(cpus=1))

    @flow
    def fits() -> JobResult:
        return run_job(spec, cluster=block)

    result = fits()
    assert result.state is JobState.SUCCEEDED and not result.queue_wait_s
    events = job_events(prefect_api, result.handle.resource_id, "prefect-nemo.job.succeeded")
    assert "prefect-nemo.job.queued" not in [e["event"] for e in events]
