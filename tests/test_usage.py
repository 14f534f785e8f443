"""GPU-hours (issue 31, item 4): the arithmetic, the roll-ups, the block's price, and a job's
usage on its JobResult, its terminal event, its row and the run's artifact on real local Ray."""

from __future__ import annotations

import json
import logging
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

from prefect_nemo import JobSpec, JobState
from prefect_nemo.jobs import JobHandle, JobStatus, Resources
from prefect_nemo.lifecycle import Supervisor, WaitPolicy
from prefect_nemo.placement import PlacementSpec
from prefect_nemo.redaction import Redactor
from prefect_nemo.usage import JobShape, JobUsage, cost, gpu_hours, measure, roll_up
from prefect_nemo.watcher import JobClock

# -- the arithmetic ------------------------------------------------------------------------------


def test_a_two_node_8_gpu_job_that_ran_90s_used_0_4_gpu_hours():
    shape = JobShape(nodes=2, gpus_per_node=8)
    assert gpu_hours(shape, 90) == pytest.approx(0.4, abs=0.01)
    usage = measure(shape, run_s=90, queue_wait_s=600, price=2.5)
    assert usage.gpu_hours == pytest.approx(0.4, abs=0.01)
    assert usage.cost == pytest.approx(1.0), "queue time holds no GPU and costs nothing"
    assert measure(shape, run_s=90).cost is None, "no price, no cost"


def test_a_spec_says_its_gpus_by_placement_or_by_its_entrypoint_resources():
    spread = PlacementSpec(nodes=2, gpus_per_node=8, strategy="spread")
    assert JobSpec(entrypoint="x", placement=spread).shape() == JobShape(nodes=2, gpus_per_node=8)
    one = JobSpec(entrypoint="x", resources=Resources(gpus=0.5)).shape()
    assert (one.nodes, one.gpus) == (1, 0.5)
    assert JobSpec(entrypoint="x").shape().gpus == 0


def test_a_job_without_placement_gets_the_nodes_and_gpus_of_its_slurm_block():
    from prefect_nemo.blocks import SlurmCluster

    ssh = {"host": "h", "user": "u", "job_dir": "/j", "account": "a", "identity": "/k"}
    block = SlurmCluster(**ssh, nodes=2, gpus_per_node=8)
    eight = block.default_shape()
    assert eight == JobShape(nodes=2, gpus_per_node=8)
    assert JobSpec(entrypoint="x").shape(eight) == eight
    one = PlacementSpec(gpus_per_node=1)
    assert JobSpec(entrypoint="x", placement=one).shape(eight).gpus == 1, "placement wins"
    assert SlurmCluster(**ssh).default_shape() == JobShape(nodes=1, gpus_per_node=0)


def test_a_job_without_placement_or_gpus_counts_its_slurm_or_kubeflow_blocks_nodes_x_gpus():
    from prefect_nemo.blocks import KubeflowTrainerCluster, SlurmCluster
    from prefect_nemo.blocks.kubernetes import KubernetesCluster
    from prefect_nemo.blocks.ray_jobs import RayJobsCluster
    from prefect_nemo.tasks.jobs import wait_policy

    ssh = {"host": "h", "user": "u", "job_dir": "/j", "account": "a", "identity": "/k"}
    slurm = SlurmCluster(**ssh, nodes=2, gpus_per_node=8, gpu_hour_price=2.0)
    trainer = KubeflowTrainerCluster(
        kubernetes=KubernetesCluster(), image="x", num_nodes=4, gpus_per_node=2
    )
    ray = RayJobsCluster(dashboard_url="http://127.0.0.1:8265")

    def policy(block: Any, spec: JobSpec | None) -> WaitPolicy:
        return wait_policy(block, timeout_s=None, queue_timeout_s=None, stream_logs=True,
                           spec=spec)  # fmt: skip

    bare = JobSpec(entrypoint="x")
    assert trainer.default_shape() == JobShape(nodes=4, gpus_per_node=2)
    assert policy(slurm, bare).shape == JobShape(nodes=2, gpus_per_node=8)
    assert policy(trainer, bare).shape == JobShape(nodes=4, gpus_per_node=2)
    assert ray.default_shape() is None and policy(ray, bare).shape == JobShape(gpus_per_node=0)
    # resources.gpus is per node: Slurm runs it on each of the block's nodes, Ray on one
    four = JobSpec(entrypoint="x", resources=Resources(gpus=4))
    assert policy(slurm, four).shape == JobShape(nodes=2, gpus_per_node=4)
    assert policy(ray, four).shape == JobShape(nodes=1, gpus_per_node=4)
    assert policy(slurm, None).shape is None, "waited for without its spec: GPUs unknown"

    t0 = datetime.now(UTC)  # 2 nodes x 8 GPUs for 90 s at the block's price: 0.4 GPU-h, 0.8
    clock = JobClock(now=t0)
    clock.observe(_ended(JobState.RUNNING), now=t0)
    clock.observe(_ended(JobState.SUCCEEDED), now=t0 + timedelta(seconds=90))
    usage = Supervisor(None, policy(slurm, bare))._usage(_ended(JobState.SUCCEEDED), clock)  # type: ignore[arg-type]
    assert usage is not None and (usage.nodes, usage.gpus_per_node) == (2, 8)
    assert usage.gpu_hours == pytest.approx(0.4, abs=0.01) and usage.cost == pytest.approx(0.8)


def test_a_roll_up_is_the_sum_of_its_jobs_wasted_counted_apart_and_cost_is_hours_times_price():
    price = 3.0
    eight = JobShape(nodes=1, gpus_per_node=8)
    jobs = [
        measure(eight, run_s=3600, queue_wait_s=10, price=price),  # 8 GPU-h
        measure(eight, run_s=1800, price=price, wasted=True),  # failed: 4 GPU-h wasted
        measure(JobShape(nodes=2, gpus_per_node=8), run_s=90, price=price, wasted=True),  # 0.4
    ]
    total = roll_up(jobs)
    assert total.jobs == 3
    assert total.gpu_hours == pytest.approx(sum(j.gpu_hours for j in jobs)) == pytest.approx(12.4)
    assert total.wasted_gpu_hours == pytest.approx(4.4)
    assert total.cost == pytest.approx(total.gpu_hours * price)
    assert total.wasted_cost == pytest.approx(4.4 * price)
    assert total.queue_wait_s == 10 and total.run_s == 3600 + 1800 + 90
    assert cost(2.0, None) is None and roll_up([measure(eight, run_s=60)]).cost is None
    assert roll_up([]).gpu_hours == 0 and roll_up([]).cost is None


def test_a_negative_gpu_hour_price_is_refused_naming_the_field():
    from prefect_nemo.blocks.ray_jobs import RayJobsCluster

    url = "http://127.0.0.1:8265"
    with pytest.raises(ValueError, match="gpu_hour_price") as caught:
        RayJobsCluster(dashboard_url=url, gpu_hour_price=-1.0)
    assert "greater than or equal to 0" in str(caught.value)
    assert RayJobsCluster(dashboard_url=url, gpu_hour_price=2.5).gpu_hour_price == 2.5
    assert RayJobsCluster(dashboard_url=url).gpu_hour_price is None


# -- the supervisor measures, the reporter carries ------------------------------------------------


def _ended(state: JobState, **fields: Any) -> JobStatus:
    return JobStatus(job_id="j-1", state=state, **fields)


def test_run_time_is_the_time_seen_running_else_the_clusters_span_for_a_job_that_ran():
    t0 = datetime.now(UTC)
    shape = JobShape(nodes=2, gpus_per_node=8)
    supervisor = Supervisor(None, WaitPolicy(shape=shape, gpu_hour_price=2.0))  # type: ignore[arg-type]
    clock = JobClock(now=t0)
    clock.observe(_ended(JobState.QUEUED), now=t0)
    clock.observe(_ended(JobState.RUNNING), now=t0 + timedelta(seconds=30))
    clock.observe(_ended(JobState.SUCCEEDED), now=t0 + timedelta(seconds=120))
    usage = supervisor._usage(_ended(JobState.SUCCEEDED), clock)
    assert usage is not None
    assert (usage.queue_wait_s, usage.run_s) == (30, 90) and not usage.wasted
    assert usage.gpu_hours == pytest.approx(0.4, abs=0.01) and usage.cost == pytest.approx(0.8)

    between_polls = JobClock(now=t0)  # seen waiting, then ended: the cluster's own times
    between_polls.observe(_ended(JobState.PENDING), now=t0)
    span = {"start_time": t0, "end_time": t0 + timedelta(seconds=45)}
    failed = supervisor._usage(_ended(JobState.FAILED, exit_code=1, **span), between_polls)
    assert failed is not None and failed.run_s == 45 and failed.wasted
    stopped_queued = supervisor._usage(_ended(JobState.STOPPED, **span), between_polls)
    assert stopped_queued is not None and stopped_queued.run_s == 0, "it never ran"
    assert supervisor._usage(_ended(JobState.RUNNING), clock) is None, "not ended yet"
    unknown = Supervisor(None, WaitPolicy())  # type: ignore[arg-type]
    assert unknown._usage(_ended(JobState.SUCCEEDED), clock) is None, "GPUs unknown"


def test_kubeflow_trainer_says_the_nodes_and_gpus_and_its_word_wins_over_the_specs():
    from prefect_nemo.backends.kubeflow import TrainerConfig, status_from_trainjob
    from prefect_nemo.backends.kubeflow.trainjob import trainjob_manifest

    config = TrainerConfig(image="x", num_nodes=2, gpus_per_node=8)
    manifest = trainjob_manifest(JobSpec(entrypoint="python t.py"), "j", {}, config, namespace="n")
    manifest["status"] = {"conditions": [{"type": "Complete", "status": "True"}]}
    status = status_from_trainjob(manifest, [])
    assert status.state is JobState.SUCCEEDED and status.shape == JobShape(nodes=2, gpus_per_node=8)
    cpu = trainjob_manifest(
        JobSpec(entrypoint="x"), "j", {}, TrainerConfig(image="x"), namespace="n"
    )
    assert status_from_trainjob(cpu, []).shape == JobShape(nodes=1, gpus_per_node=0)
    assert status_from_trainjob({"metadata": {"name": "j"}}, []).shape is None

    t0 = datetime.now(UTC)
    clock = JobClock(now=t0)
    clock.observe(_ended(JobState.RUNNING), now=t0)
    clock.observe(_ended(JobState.SUCCEEDED), now=t0 + timedelta(seconds=90))
    ended = status.model_copy(update={"job_id": "j-1"})
    for policy in (WaitPolicy(), WaitPolicy(shape=JobShape(gpus_per_node=1))):  # no spec, a spec
        usage = Supervisor(None, policy)._usage(ended, clock)  # type: ignore[arg-type]
        assert usage is not None and usage.gpu_hours == pytest.approx(0.4, abs=0.01)


def test_the_terminal_event_and_row_carry_the_usage_and_the_artifact_rolls_up(monkeypatch):
    from prefect_nemo.tasks import reporting
    from prefect_nemo.tasks._run import RunContext

    events: list[tuple[str, dict[str, Any]]] = []
    monkeypatch.setattr(reporting, "emit", lambda name, resource, payload: events.append(
        (name, payload)))  # fmt: skip
    monkeypatch.setattr(reporting, "say", lambda run, level, message: None)
    ledger = reporting.RunUsage()
    monkeypatch.setattr(ledger, "_changed", lambda key: None)  # no API: the data is checked
    monkeypatch.setattr(reporting, "_usage", ledger)
    table = reporting.RunTable("jobs")
    monkeypatch.setattr(table, "_changed", lambda key: None)
    monkeypatch.setattr(reporting, "_job_table", table)
    secret = "hush-hush-1234"

    def reporter(flow_run: str) -> reporting.JobReporter:
        run = RunContext(flow_run, "", None, None, f"sft-{secret}", None, logging.getLogger("t"))
        return reporting.JobReporter(run, Redactor([secret]))

    eight = JobShape(nodes=2, gpus_per_node=8)
    ok = measure(eight, run_s=90, price=2.0)
    lost = measure(eight, run_s=45, price=2.0, wasted=True)
    first, second = reporter("run-1"), reporter("run-2")
    for rep, job, state, usage in (
        (first, "train", JobState.SUCCEEDED, ok),
        (first, "eval", JobState.FAILED, lost),
        (second, "train-again", JobState.STOPPED, lost),
    ):
        rep.changed(JobHandle(job_id=job, backend="ray-jobs", cluster="c"), _ended(state), None,
                    usage)  # fmt: skip
    succeeded = dict(events)["prefect-nemo.job.succeeded"]
    assert succeeded["usage"]["gpu_hours"] == pytest.approx(0.4)
    assert succeeded["usage"] == json.loads(ok.model_dump_json())
    assert dict(events)["prefect-nemo.job.failed"]["usage"]["wasted"] is True
    row = next(r for r in table.rows("run-1") if r["job_id"] == "train")
    assert row["gpus"] == "2 x 8" and row["gpu_hours"] == 0.4 and row["cost"] == 0.8

    of_run, of_experiment = reporting.usage_rolled_up("run-1")
    assert of_run.gpu_hours == pytest.approx(0.6) and of_run.wasted_gpu_hours == pytest.approx(0.2)
    assert of_experiment is not None, "both runs are experiment sft-..."
    expected = roll_up([ok, lost, lost]).model_dump()
    assert of_experiment.model_dump() == pytest.approx(expected), "the sum of its jobs"
    kind, markdown, _ = ledger._data("run-1")
    assert kind == "markdown"
    assert "| this flow run | 2 | 0.6000 | 0.2000 | 1.20 | 0.40 |" in markdown
    assert "| experiment `sft-**********` | 3 | 0.8000 | 0.4000 | 1.60 | 0.80 |" in markdown
    assert secret not in markdown and secret not in json.dumps(events)


# -- real local Ray ------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_ray_job_carries_its_gpu_hours_in_result_event_row_and_artifact(
    ray_head, prefect_api, tmp_path: Path
):
    from prefect_nemo import run_job
    from prefect_nemo.tasks import reporting
    from tests.progress_checks import events as flow_run_events

    (tmp_path / "job.py").write_text("import time\ntime.sleep(3)\n")
    spec = JobSpec(entrypoint="python job.py", name="gpu-hours", working_dir=tmp_path,
                   resources=Resources(gpus=1))  # fmt: skip
    block = ray_head.block(gpu_hour_price=3.0)
    since = datetime.now(UTC).isoformat()

    @flow
    def metered():
        return run_job(spec, cluster=block)

    started = time.monotonic()
    state = metered(return_state=True)
    result = state.result()
    took = time.monotonic() - started
    flow_run_id = state.state_details.flow_run_id
    assert result.state is JobState.SUCCEEDED and result.usage is not None
    usage: JobUsage = result.usage
    assert (usage.nodes, usage.gpus_per_node) == (1, 1)
    assert 1.0 <= usage.run_s <= took, usage  # seen RUNNING: within a poll of the 3 s sleep
    assert result.gpu_hours == pytest.approx(usage.run_s / 3600)
    assert result.cost == pytest.approx(result.gpu_hours * 3.0)

    events = flow_run_events(prefect_api, flow_run_id, since, until="prefect-nemo.job.succeeded")
    ended = next(e for e in events if e["event"] == "prefect-nemo.job.succeeded")
    assert ended["payload"]["usage"] == json.loads(usage.model_dump_json())
    row = reporting.job_rows(str(flow_run_id))[0]
    assert row["gpu_hours"] == round(usage.gpu_hours, 4) and row["gpus"] == "1 x 1"
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        )
    rolled = [a for a in artifacts if a.description and a.description.startswith("GPU-hours")]
    assert len(rolled) == 1 and result.handle.job_id in rolled[0].data
    assert f"| this flow run | 1 | {usage.gpu_hours:.4f} | 0.0000 |" in rolled[0].data
