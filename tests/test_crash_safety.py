"""Cancelling, killing, or losing the cluster under a running flow: nothing is orphaned or lost."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from prefect.states import Cancelling

from prefect_nemo import BackendUnavailable, JobSpec, JobState, run_job
from prefect_nemo.lifecycle import META_FLOW_RUN, META_KEY
from prefect_nemo.testing import TcpProxy
from tests.conftest import subprocess_env

pytestmark = pytest.mark.slow
HERE = Path(__file__).parent


def wait_until(predicate, timeout_s: float, what: str, every: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def child_env(ray_head, prefect_api: str) -> dict[str, str]:
    return subprocess_env(
        prefect_api,
        TEST_RAY_URL=ray_head.dashboard_url,
        TEST_RAY_TOKEN=ray_head.token or "",
        PREFECT_RUNNER_POLL_FREQUENCY="1",
        PYTHONPATH=str(HERE.parent),
    )


def test_cancelling_a_served_flow_run_stops_its_jobs(ray_head, prefect_api, ray_client, tmp_path):
    log = open(tmp_path / "serve.log", "w")
    server = subprocess.Popen(
        [sys.executable, str(HERE / "crash_flows.py"), "serve"],
        env=child_env(ray_head, prefect_api), stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        with get_client(sync_client=True) as client:
            deployment = wait_until(
                lambda: _deployment(client, "long-jobs/long-jobs"), 90, "the served deployment"
            )
            run = client.create_flow_run_from_deployment(deployment.id, parameters={"seconds": 300})

            def running_jobs():
                jobs = [j for j in ray_client.list_jobs()
                        if (j.metadata or {}).get(META_FLOW_RUN) == str(run.id)]
                return jobs if len(jobs) == 3 and all(
                    j.status.value == "RUNNING" for j in jobs) else None

            jobs = wait_until(running_jobs, 120, "three RUNNING jobs of the served run")
            client.set_flow_run_state(run.id, Cancelling(), force=True)

            def all_stopped():
                states = [ray_client.get_job_status(j.submission_id).value for j in jobs]
                return states if all(s == "STOPPED" for s in states) else None

            wait_until(all_stopped, 90, "the cancelled run's jobs to be STOPPED")
            wait_until(
                lambda: client.read_flow_run(run.id).state.is_cancelled(), 60,
                "the flow run to be CANCELLED",
            )
    except AssertionError as exc:
        log.flush()
        raise AssertionError(f"{exc}\n--- served process log ---\n"
                             + (tmp_path / "serve.log").read_text()[-6000:]) from None
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


def _deployment(client, name: str):
    try:
        return client.read_deployment_by_name(name)
    except Exception:
        return None


def test_kill_9_then_rerun_attaches_to_the_same_jobs(ray_head, prefect_api, ray_client, tmp_path):
    experiment = f"crash-{uuid.uuid4().hex[:6]}"
    cmd = [sys.executable, str(HERE / "crash_flows.py"), "experiment", experiment, "12"]
    env = child_env(ray_head, prefect_api)
    first = subprocess.Popen(cmd, env=env, stdout=open(tmp_path / "first.log", "w"),
                             stderr=subprocess.STDOUT)

    def experiment_jobs():
        return [j for j in ray_client.list_jobs()
                if (j.metadata or {}).get(META_KEY, "").startswith(f"experiment:{experiment}/")]

    running = wait_until(
        lambda: (jobs := experiment_jobs()) and len(jobs) == 2
        and all(j.status.value == "RUNNING" for j in jobs) and jobs,
        120, "both jobs RUNNING",
    )
    os.kill(first.pid, signal.SIGKILL)
    first.wait(10)
    # Nothing could stop them: they keep running, waiting for someone to come back.
    assert {ray_client.get_job_status(j.submission_id).value for j in running} == {"RUNNING"}

    second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "ATTACHED=True,True" in second.stdout
    jobs = experiment_jobs()
    ids = [j.submission_id for j in jobs]
    assert sorted(ids) == sorted(j.submission_id for j in running), "a duplicate was submitted"
    assert len(ids) == len(set(ids)) == 2
    assert {j.status.value for j in jobs} == {"SUCCEEDED"}


def _outage(
    proxy: TcpProxy, down_at: float, up_at: float, after: Callable[[], object] | None = None
) -> threading.Thread:
    """The proxy down from `down_at` to `up_at` seconds, counted from now or from when `after()`
    first holds (polled every 0.2 s, for at most 120 s)."""

    def run():
        if after is not None:
            wait_until(after, 120, "the outage's start", every=0.2)
        time.sleep(down_at)
        proxy.go_down()
        time.sleep(up_at - down_at)
        proxy.come_back()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_dashboard_outage_within_budget_is_ridden_out(ray_head, prefect_api):
    port = int(ray_head.dashboard_url.rsplit(":", 1)[1])
    with TcpProxy("127.0.0.1", port) as proxy:
        block = ray_head.block(unreachable_budget_s=20)
        block.dashboard_url = proxy.url

        @flow
        def survives():
            return run_job(JobSpec(entrypoint="sleep 8; echo survived", name="outage"), block)

        outage = _outage(proxy, down_at=4, up_at=9)
        result = survives()
        outage.join()
    assert result.state is JobState.SUCCEEDED


def test_dashboard_outage_past_budget_stops_the_job(ray_head, prefect_api, ray_client):
    port = int(ray_head.dashboard_url.rsplit(":", 1)[1])
    with TcpProxy("127.0.0.1", port) as proxy:
        block = ray_head.block(unreachable_budget_s=3, stop_timeout_s=60)
        block.dashboard_url = proxy.url
        name = f"lost-{uuid.uuid4().hex[:6]}"

        @flow
        def gives_up():
            return run_job(JobSpec(entrypoint="sleep 120", name=name), block)

        # Down for longer than the budget once the job runs (a loaded machine can take 4 s to
        # submit it: seen in CI), back in time for the stop to get through.
        def running() -> bool:
            return any((j.metadata or {}).get(META_KEY, "").endswith(f"/{name}")
                       and j.status.value == "RUNNING" for j in ray_client.list_jobs())  # fmt: skip

        outage = _outage(proxy, down_at=1, up_at=9, after=running)
        with pytest.raises(BackendUnavailable, match="unreachable for"):
            gives_up()
        outage.join()
    jobs = [j for j in ray_client.list_jobs()
            if (j.metadata or {}).get(META_KEY, "").endswith(f"/{name}")]
    assert [j.status.value for j in jobs] == ["STOPPED"]


def test_cancelling_an_unsupervised_run_through_the_api_stops_its_jobs(
    ray_head, prefect_api, ray_client
):
    """A run started from a script (no runner to signal it) is cancelled from the UI/API."""
    import contextvars

    block = ray_head.block()
    name = f"unsupervised-{uuid.uuid4().hex[:6]}"
    outcome: dict[str, object] = {}

    @flow
    def unsupervised():
        run_job(JobSpec(entrypoint="sleep 120", name=name), block)

    def run():
        outcome["state"] = unsupervised(return_state=True)

    thread = threading.Thread(target=contextvars.copy_context().run, args=(run,), daemon=True)
    thread.start()
    job = wait_until(
        lambda: next((j for j in ray_client.list_jobs()
                      if (j.metadata or {}).get(META_KEY, "").endswith(f"/{name}")
                      and j.status.value == "RUNNING"), None),
        90, "the job RUNNING",
    )
    run_id = job.metadata[META_FLOW_RUN]
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(uuid.UUID(run_id), Cancelling(), force=True)
    wait_until(lambda: ray_client.get_job_status(job.submission_id).value == "STOPPED", 30,
               "the job of the cancelled run to be STOPPED")
    thread.join(60)
    assert not thread.is_alive(), "the flow must end once its job is stopped"
    # Issue 17 item 3: "After our cancel watch stops the jobs, the flow run's final state is
    # Cancelled (with a message that names the stopped jobs), for script-started runs".
    def final_state():
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(uuid.UUID(run_id)).state
        return state if state.is_cancelled() else None

    final = wait_until(final_state, 15, "the flow run to end Cancelled")
    assert job.submission_id in final.message, final.message
    with get_client(sync_client=True) as client:
        task_runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[uuid.UUID(run_id)]))
        )
    assert [t.state.type.value for t in task_runs] == ["FAILED"]
    assert "JobStopped" in task_runs[0].state.message
