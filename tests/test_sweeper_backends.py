"""The sweeper (issue 17 item 1) beyond Ray Jobs: its bad inputs, its report, and the kill -9
scenario on KubeRay (loopback API server, KubeRay simulator, real Ray) and a real Slurm.

Issue 17, "Must hold": "The sweeper's own bad inputs (unknown block, unreachable backend, a job
without our labels) give a clear message and stop nothing they should not", and "kill -9 of a
flow process with 6 running Ray jobs ..., no retry: 0 jobs of the killed run still running
`sweep_grace_s + 60 s` after the kill; with a retry inside the grace period, 6 of 6 attached
and 0 stopped. The same for KubeRay and Slurm (loopback API / real Slurm)."
"""

from __future__ import annotations

import logging
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from prefect_nemo import InvalidJobSpec, JobSpec
from prefect_nemo.backends.kuberay import rayjob_manifest
from prefect_nemo.blocks import KubeRayCluster
from prefect_nemo.blocks.kubernetes import KubernetesCluster
from prefect_nemo.jobs import META_FLOW_RUN, JobState
from prefect_nemo.kube import RAY_JOB
from prefect_nemo.lifecycle import job_metadata
from prefect_nemo.tasks.sweeper import sweep  # imports Prefect's flow: its logging is set up
from tests.conftest import subprocess_env

# ---------------------------------------------------------------------------------------------
# Bad inputs, on the loopback Kubernetes API: RayJobs on a RayCluster that does not exist stay
# PENDING (nothing runs), which is all the sweeper looks at.


@pytest.fixture
def logged() -> Iterator[list[str]]:
    """Messages of Prefect's loggers (the sweeper's own lines included) during the test."""
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    handler = Collect(logging.DEBUG)
    logger = logging.getLogger("prefect")
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)


def pending_block(kube_block: KubernetesCluster, **kw: Any) -> KubeRayCluster:
    """RayJobs on a RayCluster nobody creates: they stay PENDING; a sweep stops at once."""
    kw.setdefault("sweep_grace_s", 0)
    return KubeRayCluster(kubernetes=kube_block, ray_cluster_name="never-there", **kw)


def submit(block: KubeRayCluster, owner: str | None) -> str:
    """A RayJob as prefect-nemo submits it for flow run `owner` (None: outside any run)."""
    spec = JobSpec(entrypoint="sleep 120", name=f"j-{uuid.uuid4().hex[:6]}")
    job_id = spec.name or ""
    meta = job_metadata(spec, "test", job_id, {META_FLOW_RUN: owner or ""})
    block.backend().submit(spec, job_id, meta)
    return job_id


def live(block: KubeRayCluster, job_id: str) -> bool:
    status = block.backend().find(job_id)
    return status is not None and not status.state.is_terminal()


def cli(prefect_api: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`prefect-nemo ARGS` against the session's Prefect API."""
    return subprocess.run(
        [sys.executable, "-m", "prefect_nemo.cli", *args],
        env=subprocess_env(prefect_api), capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_an_unknown_block_fails_before_anything_is_stopped(
    prefect_api: str, kube_server: Any, kube_block: KubernetesCluster
) -> None:
    """An unknown block name is bad input: it fails before any job is judged or stopped (the
    project's rule: "Bad input fails before anything is submitted or applied, with an error
    naming the field and the fix"), and `prefect-nemo sweep` exits non-zero saying so."""
    block = pending_block(kube_block)
    dead = submit(block, str(uuid.uuid4()))  # a run that no longer exists: stopped by a sweep
    with pytest.raises(InvalidJobSpec) as info:
        sweep(["kube-ray-cluster/no-such-block", block])
    message = str(info.value)
    assert "'kube-ray-cluster/no-such-block': no such block document" in message
    assert "prefect-nemo blocks apply" in message, "the fix"
    with pytest.raises(InvalidJobSpec, match="name a saved block as '<block-type-slug>/<name>'"):
        sweep(["no-slash", block])
    assert live(block, dead), "nothing was stopped"

    done = cli(prefect_api, "sweep", "kube-ray-cluster/no-such-block")
    assert done.returncode == 2
    assert "error: blocks='kube-ray-cluster/no-such-block': no such block document" in done.stderr
    assert live(block, dead)
    block.backend().request_stop(dead)


def test_an_unreachable_cluster_is_reported_and_the_others_are_swept(
    prefect_api: str, kube_server: Any, kube_block: KubernetesCluster, logged: list[str]
) -> None:
    """"a block whose cluster is unreachable": said (which block, why), and the clusters that
    answer are still swept."""
    block = pending_block(kube_block)
    dead = submit(block, str(uuid.uuid4()))
    config = kube_server.kubeconfig()
    config["clusters"][0]["cluster"]["server"] = "http://127.0.0.1:9"  # nothing listens there
    away = pending_block(KubernetesCluster(kubeconfig=config, request_timeout_s=2))
    verdicts = sweep([away, block])
    assert [(v.job_id, v.stop, v.outcome) for v in verdicts] == [(dead, True, "STOPPED")]
    assert not live(block, dead)
    said = "\n".join(logged)
    assert (
        "sweep: cannot list the jobs of KubeRayCluster, so none of them was judged or stopped "
        "(the other clusters are swept): cannot reach the Kubernetes API at http://127.0.0.1:9"
    ) in said, said


def test_a_job_without_our_labels_or_owner_is_left_alone(
    prefect_api: str, kube_server: Any, kube_block: KubernetesCluster, logged: list[str]
) -> None:
    """"it never touches ... a job we did not submit": a RayJob made by hand (no labels of
    ours) is never listed; one we submitted outside any flow run (no owner) is listed, kept,
    and the verdict says why."""
    block = pending_block(kube_block)
    hand = f"hand-{uuid.uuid4().hex[:6]}"
    manifest = rayjob_manifest(
        JobSpec(entrypoint="sleep 120"), hand, {}, block._config(), namespace="default"
    )
    manifest["metadata"]["labels"] = {}  # made by someone else
    kube_block.api().create(RAY_JOB, manifest)
    orphan = submit(block, None)
    verdicts = {v.job_id: v for v in sweep([block])}
    assert hand not in verdicts
    assert not verdicts[orphan].stop
    assert verdicts[orphan].why == "it names no flow run (submitted outside any run)"
    assert live(block, hand) and live(block, orphan)
    for job_id in (hand, orphan):
        block.backend().request_stop(job_id)


def test_dry_run_stops_nothing_and_says_what_it_would_stop(
    prefect_api: str, kube_server: Any, kube_block: KubernetesCluster
) -> None:
    """`prefect-nemo sweep --dry-run BLOCK` judges, stops nothing, and names each job it
    would stop with the reason."""
    block = pending_block(kube_block)
    name = f"sweep-dry-{uuid.uuid4().hex[:6]}"
    block.save(name)
    dead = submit(block, str(uuid.uuid4()))
    done = cli(prefect_api, "sweep", "--dry-run", f"kube-ray-cluster/{name}")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    line = f"kube-ray-cluster/{name}: {dead}: its flow run no longer exists"
    assert f"{line} (" in out and "-> would stop\n" in out, out
    assert "would stop 1" in out
    assert live(block, dead)
    assert block.backend().find(dead).state is JobState.PENDING
    block.backend().request_stop(dead)
