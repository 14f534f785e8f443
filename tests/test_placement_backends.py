"""JobSpec.placement through every backend: the JobSpec validator, the Ray Jobs submit kwargs
(head exclusion from the dashboard's node list), the RayJob's entrypoint resources and the
TrainJob's per-job pod scheduling (both accepted by the strict loopback server against the real
CRDs), and one real Ray job whose entrypoint gets its resources and label selector."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from prefect_nemo import InvalidJobSpec, JobSpec, Resources
from prefect_nemo.backends.kubeflow import (
    PATCH_MANAGER,
    PLACEMENT_GROUP_LABEL,
    PLACEMENT_MANAGER,
    KubeflowTrainerBackend,
    TrainerConfig,
    runtime_name,
    trainjob_manifest,
)
from prefect_nemo.backends.kuberay import KubeRayBackend, RayJobConfig, rayjob_manifest
from prefect_nemo.backends.ray_jobs import RayJobsBackend
from prefect_nemo.kube import RAY_JOB, TRAIN_JOB, KubeApi
from prefect_nemo.placement import PlacementSpec

ZONES = {"pool": "a100", "zone": "in(a,b)", "role": "!spot"}


def uid() -> str:
    return uuid.uuid4().hex[:8]


@pytest.fixture(scope="module")
def server() -> Iterator[Any]:
    from prefect_nemo.testing.kube_api import LoopbackKubeServer, crd_dir

    with LoopbackKubeServer(crds=[crd_dir()]) as srv:
        yield srv


@pytest.fixture(scope="module")
def api(server: Any) -> KubeApi:
    from prefect_nemo.blocks.kubernetes import KubernetesCluster

    return KubernetesCluster(kubeconfig=server.kubeconfig()).api()


# ---------------------------------------------------------------------------------------------
# JobSpec


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"resources": Resources(cpus=2)}, "JobSpec.resources.cpus"),
        ({"resources": Resources(gpus=1)}, "JobSpec.resources.gpus"),
        ({"label_selector": {"pool": "a"}}, "JobSpec.label_selector"),
    ],
)
def test_placement_with_the_old_fields_is_refused(kwargs: dict[str, Any], named: str):
    with pytest.raises(InvalidJobSpec) as info:
        JobSpec(entrypoint="x", placement=PlacementSpec(), **kwargs)
    assert "JobSpec.placement" in str(info.value) and named in str(info.value)
    assert "keep one" in str(info.value)


def test_placement_is_validated_and_fingerprinted():
    with pytest.raises(InvalidJobSpec, match=r"JobSpec\.placement: strategy='pack'"):
        JobSpec(entrypoint="x", placement={"nodes": 2})
    with pytest.raises(InvalidJobSpec, match=r"JobSpec\.placement\.node_labels"):
        JobSpec(entrypoint="x", placement={"node_labels": {"pool": "(bad"}})
    # memory and custom resources are not "where": they go with a placement
    JobSpec(entrypoint="x", placement=PlacementSpec(), resources=Resources(memory_bytes=1))
    plain = JobSpec(entrypoint="x")
    assert "placement" not in plain.model_dump(exclude_none=True)
    one = JobSpec(entrypoint="x", placement=PlacementSpec(gpus_per_node=1))
    two = JobSpec(entrypoint="x", placement=PlacementSpec(gpus_per_node=2))
    assert len({plain.fingerprint(), one.fingerprint(), two.fingerprint()}) == 3


# ---------------------------------------------------------------------------------------------
# Ray Jobs


class _Response:
    status_code = 200

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self._rows = rows

    def json(self) -> dict[str, Any]:
        return {"data": {"result": {"result": self._rows}}}


class _Client:
    """Records submit_job kwargs; answers /api/v0/nodes with one worker and the head."""

    def __init__(self) -> None:
        self.submitted: dict[str, Any] = {}
        self.requests: list[str] = []

    def _do_request(self, method: str, endpoint: str, **_: Any) -> _Response:
        self.requests.append(f"{method} {endpoint}")
        return _Response(
            [
                {"node_id": "w1", "state": "ALIVE", "is_head_node": False},
                {"node_id": "h0", "state": "ALIVE", "is_head_node": True},
            ]
        )

    def submit_job(self, **kwargs: Any) -> str:
        self.submitted = kwargs
        return kwargs["submission_id"]


@pytest.fixture
def fake_ray_client(monkeypatch: pytest.MonkeyPatch) -> _Client:
    fake = _Client()
    monkeypatch.setattr(RayJobsBackend, "client", property(lambda self: fake))
    return fake


def _submit(placement: PlacementSpec) -> dict[str, Any]:
    backend = RayJobsBackend("http://ray.invalid:8265")
    spec = JobSpec(entrypoint="echo hi", placement=placement)
    backend.validate(spec)
    backend.submit(spec, f"j-{uid()}", {})
    return backend.client.submitted  # type: ignore[attr-defined]


def test_ray_jobs_entrypoint_resources_and_selector(fake_ray_client: _Client):
    sent = _submit(PlacementSpec(gpus_per_node=2, cpus_per_node=4, node_labels={"pool": "a"}))
    assert sent["entrypoint_num_cpus"] == 4.0 and sent["entrypoint_num_gpus"] == 2.0
    assert sent["entrypoint_label_selector"] == {"pool": "a"}
    assert fake_ray_client.requests == [], "the node list is read only for exclude_head"


def test_ray_jobs_exclude_head_reads_the_head_from_the_dashboard(fake_ray_client: _Client):
    sent = _submit(PlacementSpec(exclude_head=True))
    assert sent["entrypoint_label_selector"] == {"ray.io/node-id": "!h0"}
    assert fake_ray_client.requests == ["GET /api/v0/nodes?limit=1000"]


def test_ray_jobs_refuses_multi_node_before_submit(fake_ray_client: _Client):
    spec = JobSpec(entrypoint="x", placement=PlacementSpec(nodes=2, strategy="spread"))
    with pytest.raises(InvalidJobSpec, match=r"JobSpec\.placement: nodes=2.*one node"):
        RayJobsBackend("http://ray.invalid:8265").validate(spec)
    assert fake_ray_client.requests == [] and fake_ray_client.submitted == {}


# ---------------------------------------------------------------------------------------------
# KubeRay


def test_rayjob_entrypoint_resources_from_placement(server: Any, api: KubeApi):
    config = RayJobConfig(ray_cluster_name="shared")
    spec = JobSpec(entrypoint="python x.py", placement=PlacementSpec(gpus_per_node=1))
    backend = KubeRayBackend(api, config)
    backend.validate(spec)
    job_id = f"placed-{uid()}"
    manifest = rayjob_manifest(spec, job_id, {}, config, namespace="default")
    assert manifest["spec"]["entrypointNumCpus"] == 1.0
    assert manifest["spec"]["entrypointNumGpus"] == 1.0
    api.create(RAY_JOB, manifest, "default")  # the strict server accepts it
    stored = server.get("rayjobs", "default", job_id, group="ray.io")
    assert stored["spec"]["entrypointNumGpus"] == 1.0


@pytest.mark.parametrize(
    "placement, needle",
    [
        (PlacementSpec(nodes=2, strategy="spread"), "JobSpec.placement.nodes: 2"),
        (PlacementSpec(node_labels={"pool": "a"}), "JobSpec.placement.node_labels"),
        (PlacementSpec(exclude_head=True), "JobSpec.placement.exclude_head"),
    ],
)
def test_rayjob_refuses_what_it_cannot_say(api: KubeApi, placement: PlacementSpec, needle: str):
    backend = KubeRayBackend(api, RayJobConfig(ray_cluster_name="shared"))
    with pytest.raises(InvalidJobSpec) as info:
        backend.validate(JobSpec(entrypoint="x", placement=placement))
    assert needle in str(info.value)


# ---------------------------------------------------------------------------------------------
# Kubeflow Trainer


def test_trainjob_pods_get_the_placement_through_runtime_patches(
    server: Any, api: KubeApi, tmp_path: Path
):
    config = TrainerConfig(
        image="python:3.11-slim", num_nodes=2, gpus_per_node=4, runtime_prefix=f"p-{uid()}"
    )
    placement = PlacementSpec(nodes=2, gpus_per_node=4, strategy="spread", node_labels=ZONES)
    (tmp_path / "train.py").write_text("print('hi')\n")
    spec = JobSpec(entrypoint="python train.py", working_dir=tmp_path, placement=placement)
    backend = KubeflowTrainerBackend(api, config)
    backend.validate(spec)
    job_id = f"placed-{uid()}"
    backend.submit(spec, job_id, {})  # the strict server checks the patch against the CRD
    tj = server.get("trainjobs", "default", job_id, group="trainer.kubeflow.org")
    code, patch = tj["spec"]["runtimePatches"]  # the code's entry, then the placement's
    assert (code["manager"], patch["manager"]) == (PATCH_MANAGER, PLACEMENT_MANAGER)
    pod = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]["template"][
        "spec"]["template"]["spec"]  # fmt: skip
    assert pod["nodeSelector"] == {"pool": "a100"}
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"][0]["matchExpressions"] == [
        {"key": "zone", "operator": "In", "values": ["a", "b"]},
        {"key": "role", "operator": "NotIn", "values": ["spot"]},
    ]
    # a patched affinity replaces the runtime's, so the spread comes with it: one pod per host
    (term,) = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    pod_labels = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0][
        "template"]["spec"]["template"]["metadata"]["labels"]  # fmt: skip
    assert term["labelSelector"]["matchLabels"] == pod_labels == {PLACEMENT_GROUP_LABEL: job_id}
    # per job: the runtime (and its name) does not change with the placement
    assert tj["spec"]["runtimeRef"]["name"] == runtime_name(config)


def test_trainjob_one_node_without_node_labels_has_no_patch():
    config = TrainerConfig(image="python:3.11-slim")
    spec = JobSpec(entrypoint="python train.py", placement=PlacementSpec(exclude_head=True))
    manifest = trainjob_manifest(spec, "j", {}, config, namespace="default")
    assert "runtimePatches" not in manifest["spec"], "no head on a TrainJob: nothing to say"


@pytest.mark.parametrize(
    "config, placement, needle",
    [
        (
            TrainerConfig(image="i", num_nodes=2),
            PlacementSpec(),
            "JobSpec.placement.nodes: 1, but the KubeflowTrainerCluster's num_nodes is 2",
        ),
        (
            TrainerConfig(image="i", gpus_per_node=8),
            PlacementSpec(),
            "JobSpec.placement.gpus_per_node: 0, but the KubeflowTrainerCluster's gpus_per_node",
        ),
        (
            TrainerConfig(image="i", cpus_per_node="500m"),
            PlacementSpec(cpus_per_node=2),
            "JobSpec.placement.cpus_per_node: 2, but the KubeflowTrainerCluster's cpus_per_node",
        ),
    ],
)
def test_trainjob_placement_must_agree_with_the_block(
    api: KubeApi, config: TrainerConfig, placement: PlacementSpec, needle: str
):
    backend = KubeflowTrainerBackend(api, config)
    with pytest.raises(InvalidJobSpec) as info:
        backend.validate(JobSpec(entrypoint="x", placement=placement))
    assert needle in str(info.value) and "make them equal" in str(info.value)


def test_trainjob_placement_that_agrees_is_accepted_and_applied(server: Any, api: KubeApi):
    """A placement that agrees with the block (2 nodes, 1 GPU and 0.5 CPU each: "500m") passes
    validation and reaches the pods through the TrainJob's `runtimePatches` (the Trainer v2.3
    field the real CRD accepts), on the block's own runtime (same name: the shape is the
    block's), with its node label as a nodeSelector and one pod per host."""
    config = TrainerConfig(image="i", num_nodes=2, gpus_per_node=1, cpus_per_node="500m")
    agreeing = PlacementSpec(
        nodes=2, strategy="spread", gpus_per_node=1, cpus_per_node=0.5, node_labels={"pool": "a"}
    )
    backend = KubeflowTrainerBackend(api, config)
    spec = JobSpec(entrypoint="x", placement=agreeing)
    backend.validate(spec)
    *_, trainjob = backend.render(spec, f"agree-{uid()}", {})
    assert trainjob["spec"]["runtimeRef"]["name"] == runtime_name(config)
    (patch,) = trainjob["spec"]["runtimePatches"]
    assert patch["manager"] == PLACEMENT_MANAGER
    pod = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]["template"][
        "spec"]["template"]["spec"]  # fmt: skip
    assert pod["nodeSelector"] == {"pool": "a"}
    (term,) = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    limits = trainjob["spec"]["trainer"]["resourcesPerNode"]["limits"]
    assert limits == {"nvidia.com/gpu": 1, "cpu": "500m"}
    api._resource(TRAIN_JOB).create(body=trainjob, namespace="default", dry_run="All")


# ---------------------------------------------------------------------------------------------
# A real Ray job


@pytest.mark.slow
def test_a_ray_job_gets_its_placement(ray_head: Any, prefect_api: str):
    from prefect import flow

    from prefect_nemo import run_job

    block = ray_head.block()
    backend = block.backend()
    head = backend.head_node_id()
    placement = PlacementSpec(cpus_per_node=1, node_labels={"ray.io/node-id": head})

    @flow
    def placed() -> Any:
        spec = JobSpec(entrypoint="echo placed", name=f"placed-{uid()}", placement=placement)
        return run_job(spec, cluster=block)

    result = placed()
    assert result.succeeded
    # Ray's JobDetails does not echo entrypoint resources; the job's supervisor actor (which
    # runs the entrypoint) carries them, as the dashboard's state API shows
    actors = backend.client._do_request("GET", "/api/v0/actors?detail=1&limit=10000").json()
    name = f"_ray_internal_job_actor_{result.handle.job_id}"
    (actor,) = [a for a in actors["data"]["result"]["result"] if a.get("name") == name]
    assert actor["required_resources"] == {"CPU": 1.0}
    assert actor["label_selector"] == {"ray.io/node-id": head}
    assert backend.client.get_job_info(result.handle.job_id).driver_node_id == head
