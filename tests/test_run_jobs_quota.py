"""run_jobs on a quota (issue 28, 5): many RayJobs through a Kueue LocalQueue with room for a
few, on the loopback API server with the simulated KubeRay (FakeRay), in a module of its own (a
fresh server: the thousand-job tests' RayJobs stay out of its way)."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import pytest
from prefect import flow
from prefect.context import FlowRunContext

from prefect_nemo import JobState, run_jobs
from prefect_nemo.testing.operators import KubeRaySimulator
from tests.test_run_jobs import SIM, artifacts_of, fake_ray, in_thread, sim, specs

__all__ = ["fake_ray", "sim"]  # the module fixtures of test_run_jobs, on this module's server


class QuotaAdmitter:
    """Kueue's part for one LocalQueue with room for `quota` jobs, by its documented rules ("Run
    A RayJob": the job with a `kueue.x-k8s.io/queue-name` label is created suspended, and Kueue
    "controls the spec.suspend field", unsuspending it once admitted; StrictFIFO admits in
    creation order): it unsuspends the oldest held RayJobs while fewer than `quota` are admitted
    and not ended. Its requests go as the simulator's (told apart from ours)."""

    def __init__(self, api_client: Any, queue: str, quota: int) -> None:
        from kubernetes import client

        self.api = client.CustomObjectsApi(api_client)
        self.queue, self.quota = queue, quota
        self.peak = 0  # the most jobs admitted and not ended at once
        self.admitted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="test-kueue", daemon=True)

    def __enter__(self) -> QuotaAdmitter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        from prefect_nemo.backends._kueue import QUEUE_LABEL

        while not self._stop.wait(0.2):
            items = self.api.list_namespaced_custom_object(
                "ray.io", "v1", "default", "rayjobs", label_selector=f"{QUEUE_LABEL}={self.queue}"
            )["items"]
            phase = lambda o: (o.get("status") or {}).get("jobDeploymentStatus")  # noqa: E731
            live = [o for o in items if not o["spec"].get("suspend")
                    and phase(o) not in ("Complete", "Failed")]  # fmt: skip
            held = sorted(
                (o for o in items if o["spec"].get("suspend") and phase(o) == "Suspended"),
                key=lambda o: (o["metadata"]["creationTimestamp"], o["metadata"]["name"]),
            )
            self.peak = max(self.peak, len(live))
            for obj in held[: max(0, self.quota - len(live))]:
                self.api.patch_namespaced_custom_object(
                    "ray.io", "v1", "default", "rayjobs", obj["metadata"]["name"],
                    {"spec": {"suspend": False}},
                )  # fmt: skip
                self.admitted += 1


@pytest.mark.slow
def test_run_jobs_on_a_quota_waits_in_the_queue_not_in_a_loop_of_ours(
    kube_server: Any, kube_block: Any, sim: KubeRaySimulator, prefect_api: str
):
    """Issue 28: many jobs against a queue with room for a few run to the end without thrashing:
    they wait in the scheduler's queue (QUEUED, no request of ours while they wait: the
    informers tell us when one is admitted), and the progress artifact shows queued, running
    and done as they go. 120 RayJobs, quota 8 (the Kueue part played by QuotaAdmitter)."""
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
    assert len(entries) < 2 * jobs, f"{len(entries)} requests of ours for {jobs} jobs"
    print(f"quota run: {len(entries)} requests of ours for {jobs} jobs, peak {kueue.peak}")
