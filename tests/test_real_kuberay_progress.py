"""Issue 31, "Must hold": "A job that reports 1,000 steps shows its progress and metrics in Prefect
on ... KubeRay (real operator on the real control plane)". The REAL KubeRay v1.6.1 operator runs
the RayJob (our node agent runs its head and submitter pods as local processes); the job's code
(job.py, report.py) and its secret env value reach the inline RayCluster together, through the
ConfigMap transport of issue 27 (code unpacked by the submitter pod's init container, the value
in a Secret the head's env reads). The checks are tests/progress_checks.py's, the same as Ray
Jobs', Slurm's and run:ai's."""

from __future__ import annotations

from typing import Any

import pytest

from prefect_nemo.kube import RAY_JOB, KubeApi
from tests import progress_checks
from tests.test_real_kuberay import (  # noqa: F401 - real_kuberay is a fixture
    NAMESPACE,
    block_for,
    rayjobs_of,
    real_kuberay,
)

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("control-plane")]


def test_kuberay_job_reporting_1000_steps_shows_progress_metrics_and_charts(
    real_kuberay: Any,  # noqa: F811 - the fixture imported above
    prefect_api: str,
    tmp_path: Any,
    caplog: Any,
    capfd: Any,
) -> None:
    """Issue 31: "A job that reports 1,000 steps shows its progress and metrics in Prefect on
    ... KubeRay (real operator on the real control plane)"; and "Secrets never leak": the
    job's CANARY is a SecretStr env value (KubeRay takes it, in a Secret we own), masked in the
    metric name it is part of and found in no artifact, event or log."""
    plane, kubeconfig, ray_token, secret = real_kuberay
    # the cluster stays 60 s after the job, so its log is read back from the head once more
    block = block_for(kubeconfig, ray_token, secret, ttl_s=60)
    try:
        _, took, progress = progress_checks.run_reporting_job(
            block, tmp_path / "code", prefect_api, caplog, capfd, secret_env=True
        )
        print(f"kuberay 1000 steps: flow {took:.1f}s, {len(progress)} progress events")
    finally:  # the RayJob (its cluster, Secret and ConfigMaps go with it), even after a failure
        kube = KubeApi(plane.api_client(), namespace=NAMESPACE)
        for rj in rayjobs_of(kube, "/reporter"):  # progress_checks' JobSpec is named "reporter"
            kube.delete(RAY_JOB, rj["metadata"]["name"])
