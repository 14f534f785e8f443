"""Kubernetes API load of waiting on RayJobs: prefect-nemo's watch vs a 5-second polling loop.

On the loopback API server (which counts every request), 20 RayJobs wait RUNNING for 60 s in
each of two namespaces: one watched by prefect-nemo's ClusterWatcher over the KubeRay backend
(one list+watch for the namespace, statuses served from its cache), one polled the way
prefect-kubernetes waits on a job (a GET per job every 5 s, `kubernetes` client unchanged).
Both run in the same window. Then each job is completed by a status patch, one at a time, and
we time how long each waiter takes to notice.

Figures: kube_requests_ours, kube_requests_polling, kube_request_ratio (polling / ours; goal
>= 10), kube_detect_p50_s / _p95_s (ours; goal p50 <= 0.5), kube_detect_polling_p50_s.
kube_request_ratio counts requests made in one shared window, not time: the load on the
machine does not move it, so it is one window, not rounds (bench._rounds).
No KubeRay operator runs: the bench drives RayJob status itself, since it measures waiting.
It closes what it opens (the backend, then the server) and fails if a thread prefect-nemo
started is still alive 2 s later (kube_threads_left; goal 0).
"""

from __future__ import annotations

import random
import sys
import threading
import time
from collections.abc import Callable

from kubernetes.client import CustomObjectsApi

from bench.ray_overhead import percentile
from prefect_nemo import kube
from prefect_nemo.backends.kuberay import KubeRayBackend, RayJobConfig
from prefect_nemo.blocks.kubernetes import KubernetesCluster
from prefect_nemo.jobs import JobSpec, JobState
from prefect_nemo.testing.kube_api import LoopbackKubeServer, crd_dir
from prefect_nemo.watcher import ClusterWatcher

Report = Callable[[str, object], None]

JOBS = 20
WINDOW_S = 60.0
POLL_INTERVAL_S = 5.0  # prefect-kubernetes' default job watch poll interval
WARMUP_S = 3.0
OURS, POLLING = "bench-ours", "bench-polling"
RUNNING = {"jobDeploymentStatus": "Running", "jobStatus": "RUNNING", "jobId": "x"}
DONE = {"jobDeploymentStatus": "Complete", "jobStatus": "SUCCEEDED", "jobId": "x"}


def log(message: str) -> None:
    print(f"[kube_watch] {message}", file=sys.stderr, flush=True)


def set_status(api: kube.KubeApi, namespace: str, name: str, status: dict[str, str]) -> None:
    api.patch(kube.RAY_JOB, name, {"status": status}, namespace, subresource="status")


class PollingWaiter:
    """prefect-kubernetes style: each job has its own loop that GETs it every 5 s."""

    def __init__(self, custom: CustomObjectsApi, namespace: str, name: str) -> None:
        self.custom, self.namespace, self.name = custom, namespace, name
        self.done_at: float | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            obj = self.custom.get_namespaced_custom_object(
                "ray.io", "v1", self.namespace, "rayjobs", self.name
            )
            if obj.get("status", {}).get("jobDeploymentStatus") in ("Complete", "Failed"):
                self.done_at = time.monotonic()
                return
            time.sleep(POLL_INTERVAL_S)


def watch_until_terminal(watcher: ClusterWatcher, job_id: str, seen_at: dict[str, float]) -> None:
    with watcher.watching(job_id):
        seen = None
        while seen is None or not seen.state.is_terminal():
            seen = watcher.next_status(job_id, seen, timeout_s=600) or seen
        seen_at[job_id] = time.monotonic()


def ours_left(before: set[threading.Thread], wait_s: float = 2.0) -> list[str]:
    """Names of the threads prefect-nemo started since `before` still alive after wait_s."""
    deadline = time.monotonic() + wait_s
    while True:
        left = [
            t.name for t in threading.enumerate()
            if t not in before and t.name.startswith("prefect-nemo")
        ]  # fmt: skip
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def run(report: Report) -> None:
    before = set(threading.enumerate())
    with LoopbackKubeServer(crds=[crd_dir()], namespaces=("default", OURS, POLLING)) as server:
        block = KubernetesCluster(kubeconfig=server.kubeconfig(), namespace=OURS)
        backend = KubeRayBackend(block.api(), RayJobConfig(ray_cluster_name="bench"))
        try:
            measure(report, server, block, backend)
        finally:
            backend.close()
    left = ours_left(before)
    report("kube_threads_left", len(left))
    if left:
        raise RuntimeError(f"threads left running after close() and server stop: {left}")


def measure(
    report: Report, server: LoopbackKubeServer, block: KubernetesCluster, backend: KubeRayBackend
) -> None:
    """The two ways of waiting, side by side, in one window; then the time to notice."""
    driver = block.api()  # our own status writes; counted apart (PATCH)
    names = [f"bench-job-{i:02d}" for i in range(JOBS)]
    for name in names:
        backend.submit(JobSpec(entrypoint="sleep 600", name=name), name, {})
        manifest = {
            "apiVersion": "ray.io/v1", "kind": "RayJob",
            "metadata": {"name": name, "namespace": POLLING},
            "spec": {"entrypoint": "sleep 600", "clusterSelector": {"ray.io/cluster": "b"}},
        }  # fmt: skip
        driver.create(kube.RAY_JOB, manifest, POLLING)
        set_status(driver, OURS, name, RUNNING)
        set_status(driver, POLLING, name, RUNNING)

    watcher = ClusterWatcher(backend, max_interval_s=2.0)
    seen_at: dict[str, float] = {}
    waiters = [
        threading.Thread(target=watch_until_terminal, args=(watcher, n, seen_at), daemon=True)
        for n in names
    ]
    pollers = [PollingWaiter(CustomObjectsApi(server.api_client()), POLLING, n) for n in names]
    for thread in waiters:
        thread.start()
    for poller in pollers:
        poller.thread.start()

    time.sleep(WARMUP_S)  # first list, watch and polls are under way
    window_start = time.time()
    time.sleep(WINDOW_S)
    window_end = time.time()

    def counted(namespace: str) -> int:
        return sum(
            1
            for e in server.requests.entries
            if window_start <= e.time < window_end
            and e.method == "GET"
            and f"/namespaces/{namespace}/" in e.path
        )

    ours, polling = counted(OURS), counted(POLLING)
    log(f"{JOBS} RUNNING RayJobs for {WINDOW_S:.0f}s: ours {ours} requests, polling {polling}")
    report("kube_requests_ours", ours)
    report("kube_requests_polling", polling)
    report("kube_request_ratio", polling / max(ours, 1))

    patched_at: dict[str, float] = {}
    for name in names:  # complete one job at a time, at uneven moments
        time.sleep(random.uniform(0.2, 0.8))
        patched_at[name] = time.monotonic()
        set_status(driver, OURS, name, DONE)
        set_status(driver, POLLING, name, DONE)
    deadline = time.monotonic() + POLL_INTERVAL_S + 30
    while time.monotonic() < deadline and (
        len(seen_at) < JOBS or any(p.done_at is None for p in pollers)
    ):
        time.sleep(0.1)
    ours_detect = [seen_at[n] - patched_at[n] for n in names if n in seen_at]
    polling_detect = [p.done_at - patched_at[p.name] for p in pollers if p.done_at]
    if len(ours_detect) < JOBS:
        raise RuntimeError(f"only {len(ours_detect)} of {JOBS} completions were noticed")
    report("kube_detect_p50_s", percentile(ours_detect, 50))
    report("kube_detect_p95_s", percentile(ours_detect, 95))
    report("kube_detect_polling_p50_s", percentile(polling_detect, 50))
    states = {s.state for s in backend.statuses(names).values()}
    assert states == {JobState.SUCCEEDED}, states


if __name__ == "__main__":
    from bench.run_all import report as print_figure

    run(print_figure)
