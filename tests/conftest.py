"""Shared fixtures: one real Prefect API and one real local Ray cluster per test session."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from prefect_nemo.local_ray import LocalRayCluster, start_local_ray

IN_CI = os.environ.get("CI", "").lower() == "true"


@pytest.fixture(scope="session")
def prefect_api() -> Iterator[str]:
    """A real Prefect server (temporary database) for the whole session; yields its API URL."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield str(PREFECT_API_URL.value())


@pytest.fixture(scope="session")
def ray_head() -> Iterator[LocalRayCluster]:
    """A real Ray head with its dashboard and token auth on, on free ports."""
    with start_local_ray(num_cpus=8, resources={"slot": 4}) as cluster:
        yield cluster


@pytest.fixture
def cluster(ray_head: LocalRayCluster, prefect_api: str):
    """A RayJobsCluster block for the session's Ray head."""
    return ray_head.block()


@pytest.fixture
def ray_client(ray_head: LocalRayCluster):
    """Ray's own client, to look at the cluster behind our back."""
    return ray_head.block().backend().client


# -- Kubernetes: one loopback API server per test module, and the operator simulators on it ------


@pytest.fixture(scope="module")
def kube_server() -> Iterator[Any]:
    from prefect_nemo.testing.kube_api import LoopbackKubeServer, crd_dir

    with LoopbackKubeServer(crds=[crd_dir()]) as server:
        yield server


@pytest.fixture(scope="module")
def dynamo_sim(kube_server: Any) -> Iterator[Any]:
    from prefect_nemo.testing.operators import DynamoSimulator

    with DynamoSimulator(kube_server, start_delay_s=0.2) as sim:
        yield sim


@pytest.fixture(scope="module")
def kuberay(kube_server: Any, ray_head: Any) -> Iterator[Any]:
    from prefect_nemo.testing.operators import KubeRaySimulator

    with KubeRaySimulator(kube_server, ray_head.dashboard_url, ray_head.token) as sim:
        yield sim


@pytest.fixture(scope="module")
def kube_block(kube_server: Any) -> Any:
    from prefect_nemo.blocks.kubernetes import KubernetesCluster

    return KubernetesCluster(kubeconfig=kube_server.kubeconfig())


def subprocess_env(prefect_api: str, **extra: str) -> dict[str, str]:
    """Environment for a child process that talks to the session's Prefect API."""
    env = dict(os.environ, PREFECT_API_URL=prefect_api, PYTHONUNBUFFERED="1", **extra)
    env.pop("PREFECT_PROFILE", None)
    return env


# -- Slurm: one real local cluster (munge, MariaDB, slurmdbd, slurmctld, slurmd) and an sshd ------


@pytest.fixture(scope="session")
def slurm() -> Iterator[Any]:
    """A real one-node Slurm cluster + sshd on 127.0.0.1 (started, or the running one reused)."""
    from prefect_nemo.testing.slurm import LocalSlurm, unavailable_reason

    reason = unavailable_reason()
    if reason:
        if IN_CI:
            pytest.fail(f"CI needs the local Slurm cluster: {reason}")
        pytest.skip(reason)
    with LocalSlurm() as cluster:  # stops it at the end only if this session started it
        yield cluster
