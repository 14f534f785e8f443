"""How soon a flow sees a queued job start: Kueue admission to RUNNING, ours against a raw watch.

On the loopback API server, 20 RayJobs are submitted through prefect-nemo's KubeRay backend with
a Kueue LocalQueue (labelled, created suspended) and held the way Kueue and KubeRay hold them
(`jobDeploymentStatus: Suspended`); prefect-nemo's ClusterWatcher sees each QUEUED. Then the
bench plays Kueue admitting them one at a time, at uneven moments (it unsuspends the RayJob, and
KubeRay's status goes Running), and times how long each waiter takes to see it run: ours (the
watcher every task of a flow waits through) and a raw `kubernetes` watch on the same RayJobs, in
the same run. No Kueue or KubeRay runs: the bench writes what they would, since it measures
seeing the admission (the real Kueue's admissions are in tests/test_real_kueue.py).

It runs ROUNDS rounds of JOBS jobs (bench._rounds); both waiters see the same admissions at
once, so a round needs no alternating order. Figures: queue_admit_detect_p50_s (goal <= 0.5),
queue_admit_detect_p95_s, queue_admit_detect_raw_p50_s (over every job of every round),
queue_admit_detect_ratio (ours / raw p50 per round, `median [min, max]`).
"""

from __future__ import annotations

import random
import sys
import threading
import time
from collections.abc import Callable

from kubernetes import watch
from kubernetes.client import CustomObjectsApi

from bench._rounds import ROUNDS, Spread
from bench.ray_overhead import percentile
from prefect_nemo import kube
from prefect_nemo.backends.kuberay import KubeRayBackend, RayJobConfig
from prefect_nemo.blocks.kubernetes import KubernetesCluster
from prefect_nemo.jobs import JobSpec, JobState
from prefect_nemo.testing.kube_api import LoopbackKubeServer, crd_dir
from prefect_nemo.watcher import ClusterWatcher

Report = Callable[[str, object], None]

JOBS = 8  # per round
NAMESPACE = "bench-queue"
QUEUE = "team-a"
CLUSTER_SPEC = {
    "rayVersion": "2.60.0",
    "headGroupSpec": {
        "rayStartParams": {},
        "template": {"spec": {"containers": [{"name": "ray-head", "image": "rayproject/ray"}]}},
    },
}
SUSPENDED = {"jobDeploymentStatus": "Suspended"}
RUNNING = {"jobDeploymentStatus": "Running", "jobStatus": "RUNNING", "jobId": "x"}
DONE = {"jobDeploymentStatus": "Complete", "jobStatus": "SUCCEEDED", "jobId": "x"}


def log(message: str) -> None:
    print(f"[queue_admit] {message}", file=sys.stderr, flush=True)


def set_status(api: kube.KubeApi, name: str, status: dict[str, str]) -> None:
    api.patch(kube.RAY_JOB, name, {"status": status}, NAMESPACE, subresource="status")


def ours_until(
    watcher: ClusterWatcher, job_id: str, state: JobState, seen_at: dict[str, float]
) -> None:
    """Wait through our watcher until the job is `state`; note when."""
    with watcher.watching(job_id):
        seen = None
        while seen is None or seen.state is not state:
            seen = watcher.next_status(job_id, seen, timeout_s=300) or seen
        seen_at[job_id] = time.monotonic()


def raw_until_running(
    api: CustomObjectsApi, names: set[str], seen_at: dict[str, float], stop: Callable[[], bool]
) -> None:
    """A plain kubernetes watch of the RayJobs: the first moment each reads Running."""
    stream = watch.Watch()
    for event in stream.stream(
        api.list_namespaced_custom_object, "ray.io", "v1", NAMESPACE, "rayjobs",
        timeout_seconds=300,
    ):  # fmt: skip
        obj = event["object"]
        name = obj["metadata"]["name"]
        status = obj.get("status") or {}
        if name in names and name not in seen_at and status.get("jobDeploymentStatus") == "Running":
            seen_at[name] = time.monotonic()
        if stop():
            stream.stop()


def run(report: Report) -> None:
    with LoopbackKubeServer(crds=[crd_dir()], namespaces=("default", NAMESPACE)) as server:
        block = KubernetesCluster(kubeconfig=server.kubeconfig(), namespace=NAMESPACE)
        config = RayJobConfig(ray_cluster_spec=CLUSTER_SPEC, queue_name=QUEUE)
        backend = KubeRayBackend(block.api(), config)
        try:
            measure(report, server, block, backend)
        finally:
            backend.close()


def measure(
    report: Report, server: LoopbackKubeServer, block: KubernetesCluster, backend: KubeRayBackend
) -> None:
    watcher = ClusterWatcher(backend, max_interval_s=2.0)
    rounds = [admit_round(server, block, backend, watcher, f"r{i}") for i in range(ROUNDS)]
    ours = [s for o, _ in rounds for s in o]
    raws = [s for _, r in rounds for s in r]
    report("queue_admit_detect_p50_s", percentile(ours, 50))
    report("queue_admit_detect_p95_s", percentile(ours, 95))
    report("queue_admit_detect_raw_p50_s", percentile(raws, 50))
    ratios = (percentile(o, 50) / max(percentile(r, 50), 1e-3) for o, r in rounds)
    report("queue_admit_detect_ratio", Spread.of(ratios))


def admit_round(
    server: LoopbackKubeServer,
    block: KubernetesCluster,
    backend: KubeRayBackend,
    watcher: ClusterWatcher,
    tag: str,
) -> tuple[list[float], list[float]]:
    """JOBS held RayJobs admitted one at a time; seconds from each admission to ours and to
    the raw watch seeing it run."""
    driver = block.api()  # what Kueue and KubeRay would write
    names = [f"queued-{tag}-{i:02d}" for i in range(JOBS)]
    for name in names:
        backend.submit(JobSpec(entrypoint="sleep 600", name=name), name, {})
        set_status(driver, name, SUSPENDED)
    queued_at: dict[str, float] = {}
    waiters = [
        threading.Thread(target=ours_until, args=(watcher, n, JobState.QUEUED, queued_at))
        for n in names
    ]
    for thread in waiters:
        thread.start()
    for thread in waiters:
        thread.join(120)
    if len(queued_at) < JOBS:
        raise RuntimeError(f"only {len(queued_at)} of {JOBS} jobs were seen QUEUED")
    log(f"{tag}: {JOBS} RayJobs held by the 'Kueue' of the bench, all seen QUEUED")

    ours_at: dict[str, float] = {}
    raw_at: dict[str, float] = {}
    waiters = [
        threading.Thread(target=ours_until, args=(watcher, n, JobState.RUNNING, ours_at))
        for n in names
    ]
    raw = threading.Thread(
        target=raw_until_running,
        args=(CustomObjectsApi(server.api_client()), set(names), raw_at,
              lambda: len(raw_at) == JOBS),
    )  # fmt: skip
    for thread in [*waiters, raw]:
        thread.start()
    time.sleep(2.0)  # both waiters are watching

    admitted_at: dict[str, float] = {}
    for name in names:  # admit one at a time, at uneven moments
        time.sleep(random.uniform(0.2, 0.8))
        driver.patch(kube.RAY_JOB, name, {"spec": {"suspend": False}}, NAMESPACE)  # Kueue
        admitted_at[name] = time.monotonic()
        set_status(driver, name, RUNNING)  # KubeRay, the moment it runs
    for thread in [*waiters, raw]:
        thread.join(60)
    if len(ours_at) < JOBS or len(raw_at) < JOBS:
        raise RuntimeError(f"seen running: ours {len(ours_at)}, raw {len(raw_at)} of {JOBS}")
    for name in names:  # end them, so the watcher lets go
        set_status(driver, name, DONE)
    ours = [ours_at[n] - admitted_at[n] for n in names]
    raws = [raw_at[n] - admitted_at[n] for n in names]
    log(f"{tag}: p50 ours {percentile(ours, 50):.3f}s, raw {percentile(raws, 50):.3f}s")
    return ours, raws


if __name__ == "__main__":
    from bench.run_all import report as print_figure

    run(print_figure)
