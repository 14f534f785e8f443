"""How fast a failed attempt is resubmitted (issue 29, goal <= 2 s on Ray Jobs and KubeRay).

Figures, each median [min, max] of 5 rounds (bench._rounds):

- recover_resubmit_s_ray: a job on a real local Ray cluster (Jobs API) exits 1 on its first
  attempt (its policy: one restart on errors, no backoff); from the moment our watcher sees the
  attempt FAILED to the moment the next attempt (`-r1`) is submitted: its log read to the end,
  its failure classified, the next id's submit.
- recover_resubmit_s_kuberay: the same job as a RayJob on a running RayCluster, on the loopback
  Kubernetes API server with the KubeRay simulator, against the same Ray cluster.
- recover_raw_submit_s_ray: the raw client's own share of it, Ray's JobSubmissionClient
  submitting one job (what any resubmission must pay), measured in the same rounds.

    .venv/bin/python -m bench.recover
"""

from __future__ import annotations

import statistics
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

from bench._rounds import Spread
from prefect_nemo.jobs import Backend, JobHandle, JobSpec, JobState, JobStatus, RecoveryPolicy
from prefect_nemo.lifecycle import JobIdentity, QuietObserver, Supervisor, WaitPolicy
from prefect_nemo.local_ray import start_local_ray
from prefect_nemo.usage import JobUsage
from prefect_nemo.watcher import JobClock

Report = Callable[[str, object], None]
ROUNDS = 5
# fails on its first attempt, succeeds on the next
JOB = 'python -c \'import os, sys; sys.exit(os.environ["PREFECT_NEMO_ATTEMPT"] == "0")\''
POLICY = RecoveryPolicy(max_restarts_on_errors=1, backoff_s=0)


def log(message: str) -> None:
    print(f"[recover] {message}", file=sys.stderr, flush=True)


class _Timer(QuietObserver):
    """When the first attempt was seen FAILED, and when the next one was submitted."""

    def __init__(self) -> None:
        self.failed_at: float | None = None
        self.resubmitted_s: float | None = None

    def changed(
        self,
        handle: JobHandle,
        status: JobStatus,
        clock: JobClock | None,
        usage: JobUsage | None = None,
    ) -> None:
        if status.state is JobState.FAILED and self.failed_at is None:
            self.failed_at = time.monotonic()

    def submitted(self, handle: JobHandle, *, attached: bool, drift: str | None) -> None:
        if self.failed_at is not None and self.resubmitted_s is None:
            self.resubmitted_s = time.monotonic() - self.failed_at


def resubmit_s(backend: Backend) -> float:
    """One job through its failed first attempt to its second's success."""
    timer = _Timer()
    policy = WaitPolicy(recovery=POLICY, stream_logs=True, max_poll_interval_s=0.5)
    supervisor = Supervisor(backend, policy, timer)
    key = f"recover-{uuid.uuid4().hex[:8]}"
    result = supervisor.run(JobSpec(entrypoint=JOB, name=key), JobIdentity("bench", key))
    if result.state is not JobState.SUCCEEDED or len(result.attempts) != 1:
        raise RuntimeError(f"expected one failed attempt, then success: {result}")
    assert timer.resubmitted_s is not None
    return timer.resubmitted_s


def raw_submit_s(client: Any) -> float:
    started = time.monotonic()
    client.submit_job(entrypoint="true")
    return time.monotonic() - started


def kuberay_backend(server: Any, ray: Any, stack: Any) -> Backend:
    """A KubeRay backend on a RayCluster 'bench' (the simulator points it at `ray`)."""
    from prefect_nemo.backends.kuberay import ensure_ray_cluster, wait_ray_cluster_ready
    from prefect_nemo.blocks import KubeRayCluster
    from prefect_nemo.blocks.kubernetes import KubernetesCluster
    from prefect_nemo.testing.operators import KubeRaySimulator

    stack.enter_context(KubeRaySimulator(server, ray.dashboard_url, ray.token))
    kube = KubernetesCluster(kubeconfig=server.kubeconfig())
    head = {"rayStartParams": {}, "template": {"spec": {"containers": [
        {"name": "ray-head", "image": "rayproject/ray:2.60.0"}]}}}  # fmt: skip
    ensure_ray_cluster(kube.api(), {"rayVersion": "2.60.0", "headGroupSpec": head}, "bench")
    wait_ray_cluster_ready(kube.api(), "bench", timeout_s=60)
    block = KubeRayCluster(kubernetes=kube, ray_cluster_name="bench", ray_token=ray.token)
    return block.backend()


def run(report: Report) -> None:
    """One Ray cluster, one loopback API server; the two backends and the raw submit in turn."""
    from contextlib import ExitStack

    from prefect_nemo.testing.kube_api import LoopbackKubeServer, crd_dir

    log("starting a local Ray cluster and the loopback Kubernetes API")
    with ExitStack() as stack:
        ray = stack.enter_context(start_local_ray(num_cpus=4))
        server = stack.enter_context(LoopbackKubeServer(crds=[crd_dir()]))
        on_ray = ray.block().backend()
        on_kuberay = kuberay_backend(server, ray, stack)
        client = on_ray.client
        resubmit_s(on_ray)  # warm-up: the working dir, the clients, the watchers
        resubmit_s(on_kuberay)
        ray_s, kuberay_s, raw_s = [], [], []
        for n in range(ROUNDS):
            ray_s.append(resubmit_s(on_ray))
            kuberay_s.append(resubmit_s(on_kuberay))
            raw_s.append(raw_submit_s(client))
            log(f"round {n + 1}: ray {ray_s[-1]:.3f}s kuberay {kuberay_s[-1]:.3f}s "
                f"raw submit {raw_s[-1]:.3f}s")  # fmt: skip
        report("recover_resubmit_s_ray", Spread.of(ray_s))
        report("recover_resubmit_s_kuberay", Spread.of(kuberay_s))
        report("recover_raw_submit_s_ray", statistics.median(raw_s))
        on_kuberay.close()
        on_ray.close()


if __name__ == "__main__":
    from bench.run_all import report as print_figure

    run(print_figure)
