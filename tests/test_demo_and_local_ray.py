"""The demo pipeline end to end, and the embedded default cluster's start / reuse / stop.

(`prefect-nemo demo` itself runs from the installed wheel in test_wheel.py.)"""

from __future__ import annotations

import os
import subprocess

import pytest

from prefect_nemo import JobState, local_ray

pytestmark = pytest.mark.slow


def test_demo_pipeline_runs_three_experiments(ray_head, prefect_api, tmp_path, monkeypatch):
    from flows.demo import demo_pipeline

    # The embedded default finds the session's cluster instead of starting another one.
    monkeypatch.setenv("RAY_API_SERVER_ADDRESS", ray_head.dashboard_url)
    monkeypatch.setenv("RAY_AUTH_TOKEN", ray_head.token or "")
    monkeypatch.setattr(local_ray, "_default", None)
    outputs = demo_pipeline(run_dir=str(tmp_path), name="demo-test")
    assert list(outputs) == ["demo-test-data-prep", "demo-test-train", "demo-test-eval"]
    jobs = [job for out in outputs.values() for job in out["jobs"]]
    assert len(jobs) == 2 + 2 + 5
    assert {job["state"] for job in jobs} == {JobState.SUCCEEDED.value}
    assert outputs["demo-test-eval"]["accuracy"] > 0.8, "the trained model learned something"
    assert outputs["demo-test-train"]["train_loss"] < 0.5
    assert local_ray._default is not None and not local_ray._default.owned, "reused, not started"


def test_default_cluster_reuses_a_running_one(ray_head, monkeypatch):
    monkeypatch.setenv("RAY_API_SERVER_ADDRESS", ray_head.dashboard_url)
    monkeypatch.setenv("RAY_AUTH_TOKEN", ray_head.token or "")
    monkeypatch.setattr(local_ray, "_default", None)
    block = local_ray.default_cluster()
    assert block.dashboard_url == ray_head.dashboard_url
    local_ray.stop_default()  # a reused cluster is left running
    assert block.backend().find("no-such-job") is None


def test_started_cluster_is_stopped_by_process_group(prefect_api):
    cluster = local_ray.start_local_ray(num_cpus=1)
    pgid = os.getpgid(cluster.process.pid)
    assert cluster.block().backend().find("nothing") is None  # serving, token accepted
    cluster.stop()
    assert _live_processes_in_group(pgid) == [], "a process of the stopped head survived"
    # ps -g selects by session: Ray workers (own process groups, same session) count too.


def _live_processes_in_group(pgid: int) -> list[str]:
    """Processes of the session that are not zombies (a container's PID 1 may not reap them)."""
    ps = subprocess.run(["ps", "-o", "stat=,cmd=", "-g", str(pgid)], capture_output=True,
                        text=True)
    return [line for line in ps.stdout.splitlines() if line.strip() and line.split()[0][0] != "Z"]

