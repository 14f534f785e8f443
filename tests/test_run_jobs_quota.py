"""run_jobs on a quota (issue 28, 5): many RayJobs through a Kueue LocalQueue with room for a
few, on the loopback API server with the simulated KubeRay (FakeRay), in a module of its own (a
fresh server: the thousand-job tests' RayJobs stay out of its way)."""

from __future__ import annotations

import time
import uuid
from collections import Counter
from typing import Any

import pytest
from prefect import flow
from prefect.context import FlowRunContext

from prefect_nemo import JobState, run_jobs
from prefect_nemo.testing.operators import KubeRaySimulator, QuotaAdmitter
from tests.test_run_jobs import SIM, artifacts_of, fake_ray, in_thread, sim, specs

__all__ = ["fake_ray", "sim"]  # the module fixtures of test_run_jobs, on this module's server


@pytest.mark.slow
def test_run_jobs_on_a_quota_waits_in_the_queue_not_in_a_loop_of_ours(
    kube_server: Any, kube_block: Any, sim: KubeRaySimulator, prefect_api: str
):
    """Issue 28: many jobs against a queue with room for a few run to the end without thrashing:
    they wait in the scheduler's queue (QUEUED, no request of ours while they wait: the
    informers tell us when one is admitted), and the progress artifact shows queued, running
    and done as they go. 120 RayJobs, quota 8 (the Kueue part played by QuotaAdmitter; the
    same at 1,000 RayJobs, quota 100: `python -m bench.scale quota`)."""
    from prefect_nemo.blocks import KubeRayCluster
    from tests.test_kuberay import cluster_spec

    queue, jobs, quota = f"q-{uuid.uuid4().hex[:6]}", 120, 8
    block = KubeRayCluster(kubernetes=kube_block, ray_cluster_spec=cluster_spec(), queue_name=queue)
    out: dict[str, Any] = {}
    seen: set[str] = set()  # the progress artifact's descriptions as the run went

    @flow
    def on_quota() -> None:
        out["run"] = str(FlowRunContext.get().flow_run.id)  # type: ignore[union-attr]
        out["results"] = run_jobs(specs(jobs, "sleep 1"), block, max_in_flight=jobs)

    before = len(kube_server.requests.entries)
    with QuotaAdmitter(sim.api_client, queue, quota) as kueue:
        thread = in_thread(on_quota)
        while thread.is_alive():
            if "run" in out:
                seen.update(a.description or "" for a in artifacts_of(out["run"])
                            if a.type == "progress")  # fmt: skip
            time.sleep(0.5)
    entries = [e for e in list(kube_server.requests.entries)[before:] if e.agent != SIM]
    results = out["results"]
    assert [r.state for r in results] == [JobState.SUCCEEDED] * jobs
    assert kueue.admitted == jobs and kueue.peak <= quota, (kueue.admitted, kueue.peak)
    assert sum(r.queue_wait_s or 0 for r in results) > 0
    assert max(r.queue_wait_s or 0 for r in results) > 5  # the last ones waited their turn
    assert any("queued" in d and "running" in d for d in seen), seen
    # a wait costs no request: one create per job, and the watches and queue positions
    # every job shares (here no Kueue serves Workloads: their informer dies once, and a held
    # job reads QUEUED by its label, with no request per status)
    kinds = Counter(
        (e.method, e.path.rsplit("/", 1)[0] if e.method in ("GET", "PATCH", "DELETE")
         and not e.path.endswith(("rayjobs", "workloads")) else e.path, e.is_watch)
        for e in entries
    )  # fmt: skip
    assert len(entries) < 2 * jobs, f"{len(entries)} requests of ours for {jobs} jobs: {kinds}"
    print(f"quota run: {len(entries)} requests of ours for {jobs} jobs, peak {kueue.peak}: {kinds}")
