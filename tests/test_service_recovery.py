"""Issue 29 on DGX Cloud (run:ai) and Lepton: a failed job is classified from what the service
says of it, so that its recovery (JobSpec.recovery) resubmits the cluster's failures and fails
fast on the job's own.

Neither service's job state tells the cluster's fault from the job's: run:ai documents its
Failed phase as "Image retrieval failed or containers experienced a crash" (and a preempted
workload goes back to Pending, which is QUEUED here, not an end); a Lepton job's status says
Failed and counts. What does tell is Kubernetes' own words, which both pass on for their pods:
run:ai in a workload's ``phaseMessage`` and conditions (``GET /workloads/{id}``), Lepton in a
job's events (``GET /jobs/{id}/events``, leptonai's ``LeptonEvent.reason`` and ``regarding``).
Kubernetes' pod disruption conditions (DisruptionTarget): "PreemptionByScheduler: Pod is due to
be preempted by a scheduler", "DeletionByTaintManager: Pod is due to be deleted by Taint
Manager ... due to a NoExecute taint", "EvictionByEvictionAPI: Pod has been marked for eviction
using the Kubernetes API", "DeletionByPodGC: Pod, that is bound to a no longer existing Node,
is due to be deleted", "TerminationByKubelet: Pod has been terminated by the kubelet, because
of either node pressure eviction, the graceful node shutdown, or preemption for system
critical pods"; a container waiting in ErrImagePull / ImagePullBackOff cannot start its image.
With none of these words, the class is left to the lifecycle (the log tail, else the job's own).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from prefect_nemo import lifecycle
from prefect_nemo.backends.nemo_run.service import kube_failure
from prefect_nemo.blocks.dgx_cloud import DGXCloudCluster
from prefect_nemo.blocks.lepton import LeptonWorkspace
from prefect_nemo.jobs import FailureClass, JobSpec, JobState, JobStatus
from prefect_nemo.testing.lepton import LeptonServer
from prefect_nemo.testing.runai import RunaiServer
from tests.test_nemo_run_dgx_cloud import SECRET, cluster_block, wait_for
from tests.test_nemo_run_lepton import TOKEN, workspace_block

pytestmark = pytest.mark.nemo_run


def test_kubernetes_reasons_name_the_class() -> None:
    """Whole words only, the cluster's causes before the job's, the text that says it kept."""
    table = [
        (["0/4 nodes: PreemptionByScheduler"], FailureClass.PREEMPTED),
        (["Preempted: by team-a/pod-x on node n1"], FailureClass.PREEMPTED),
        (["The node was low on resource: memory. Evicted"], FailureClass.INFRASTRUCTURE),
        (["DeletionByTaintManager: node.kubernetes.io/unreachable"], FailureClass.INFRASTRUCTURE),
        (["NodeNotReady"], FailureClass.INFRASTRUCTURE),
        (["Back-off pulling image: ImagePullBackOff"], FailureClass.SPEC),
        (["OOMKilled"], FailureClass.APPLICATION),
        # an eviction for memory pressure that also OOM-killed: the node's fault comes first
        (["OOMKilled", "Evicted"], FailureClass.INFRASTRUCTURE),
        (["exit code 1", "Error"], None),
        (["NotEvictedYet", "preempted in lower case"], None),  # not Kubernetes' words
        ([""], None),
    ]
    for texts, want in table:
        failure = kube_failure(texts)
        assert (failure.kind if failure else None) == want, (texts, failure)
    failure = kube_failure(["", "Evicted: the node was low on memory"], node="n3")
    assert failure and failure.reason == "Evicted: the node was low on memory"
    assert failure.node == "n3"


# -- DGX Cloud (run:ai) ------------------------------------------------------------------------


@pytest.fixture
def runai() -> RunaiServer:  # type: ignore[misc]
    with RunaiServer(
        client_secret=SECRET, creating_s=0.05, initializing_s=0.05, running_s=0.3, execute=True
    ) as server:
        yield server


@pytest.fixture
def dgx(runai: RunaiServer, tmp_path: Path) -> DGXCloudCluster:
    pvc = tmp_path / "pvc"
    pvc.mkdir()
    return cluster_block(runai, pvc, gpus_per_node=1)


def ended_on_runai(
    runai: RunaiServer, block: DGXCloudCluster, name: str, entrypoint: str, why: tuple[str, str]
) -> JobStatus:
    """A job's status once the service failed it for `why` (reason, message) while it ran;
    an empty reason lets it end by itself."""
    backend = block.backend()
    sub = lifecycle.submit_or_attach(
        backend, JobSpec(entrypoint=entrypoint, name=name), scope=f"flow-run:{name}", key=name
    )
    job_id = sub.handle.job_id
    if why[0]:
        wait_for(lambda: backend.find(job_id).state is JobState.RUNNING)
        runai.fail(job_id, *why)
    return wait_for(lambda: (s := backend.find(job_id)).state.is_terminal() and s)


def test_runai_failures_are_classified_from_the_workload(
    runai: RunaiServer, dgx: DGXCloudCluster
) -> None:
    evicted = ended_on_runai(
        runai, dgx, "evicted", "sleep 30",
        ("Evicted", "The node was low on resource: ephemeral-storage."),
    )  # fmt: skip
    assert evicted.state is JobState.FAILED and evicted.failure, evicted
    assert evicted.failure.kind is FailureClass.INFRASTRUCTURE
    assert "ephemeral-storage" in evicted.failure.reason and "infrastructure" in evicted.message
    bad_image = ended_on_runai(
        runai, dgx, "badimage", "sleep 30",
        ("ImagePullBackOff", 'Back-off pulling image "nvcr.io/nvidia/nemo:nope"'),
    )  # fmt: skip
    assert bad_image.failure and bad_image.failure.kind is FailureClass.SPEC, bad_image
    # the job's own exit: run:ai says only Failed, so the lifecycle reads the log
    crashed = ended_on_runai(runai, dgx, "crashed", "exit 7", ("", ""))
    assert crashed.state is JobState.FAILED and crashed.failure is None, crashed


# -- Lepton -------------------------------------------------------------------------------------


@pytest.fixture
def lepton() -> LeptonServer:  # type: ignore[misc]
    with LeptonServer(token=TOKEN, start_s=0.1, running_s=0.4) as server:
        yield server


def ended_on_lepton(
    lepton: LeptonServer, block: LeptonWorkspace, name: str, reason: str, node: str | None
) -> JobStatus:
    """A job's status once the workspace failed it with an event of `reason` (about `node`)."""
    lepton.hold(name)
    backend = block.backend()
    sub = lifecycle.submit_or_attach(
        backend, JobSpec(entrypoint="sleep 30", name=name), scope=f"flow-run:{name}", key=name
    )
    job_id = sub.handle.job_id
    wait_for(lambda: backend.find(job_id).state is JobState.RUNNING)
    lepton.fail(job_id, reason, node)
    return wait_for(lambda: (s := backend.find(job_id)).state.is_terminal() and s)


def test_lepton_failures_are_classified_from_the_job_events(
    lepton: LeptonServer, tmp_path: Path
) -> None:
    block = workspace_block(lepton, tmp_path)
    lost = ended_on_lepton(lepton, block, "lost", "NodeNotReady", "gpu-node-3")
    assert lost.state is JobState.FAILED and lost.failure, lost
    assert (lost.failure.kind, lost.failure.node) == (FailureClass.INFRASTRUCTURE, "gpu-node-3")
    preempted = ended_on_lepton(lepton, block, "bumped", "Preempted", None)
    assert preempted.failure and preempted.failure.kind is FailureClass.PREEMPTED, preempted
    plain = ended_on_lepton(lepton, block, "plain", "BackOff", None)  # no cause in it
    assert plain.state is JobState.FAILED and plain.failure is None, plain
