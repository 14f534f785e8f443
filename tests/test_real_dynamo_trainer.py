"""Dynamo DGDs and Kubeflow TrainJobs on the REAL kube-apiserver + kube-controller-manager (the
`control_plane` fixture, built from Go modules), with our operator simulators on it.

The loopback tests of tests/test_dynamo.py and tests/test_kubeflow.py named in DYNAMO_REAL and
TRAINER_REAL run here again, unchanged, over the real API server: the real CRD validation,
finalizers, the real garbage collector, the frontend reached through the real service proxy
(routed by the real EndpointSlice controller to the simulator's frontend, listening on a pod
address of its own from `PodNetwork`), and pod logs read through the API server from the
simulator's kubelet endpoint. The others stay loopback-only: they drive loopback controls
(forbid, drop_watches, the request log). The real Kubeflow Trainer controller (v2.3.0, built
from its Go module by `build.build_trainer()`) checks what the simulator runs: it needs no
webhook here, but without a JobSet controller and a kubelet for Job pods its JobSets never
start, so the TrainJob tests run on the simulator.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from prefect_nemo.backends import dynamo
from prefect_nemo.backends.dynamo import delete_dgd, wait_dgd_ready
from prefect_nemo.kube import POD, SERVICE, Kind
from tests import test_dynamo as loopback_dynamo
from tests import test_kubeflow as loopback_kubeflow
from tests.conftest import IN_CI, wait_until
from tests.test_kubeflow import META, TrainerConfig, uid

pytestmark = [pytest.mark.slow]

# tests/test_dynamo.py tests that mean the same on a real API server (they take the fixtures
# below: `api`, `dynamo_sim`, `kube_server` are the real control plane's here)
DYNAMO_REAL = (
    "test_example_manifests_are_valid_against_the_crd",
    "test_apply_twice_attaches_and_drift_warns",
    "test_delete_waits_until_the_dgd_is_gone",
    "test_apply_never_attaches_to_a_dgd_being_deleted",
    "test_ready_when_all_three_gates_pass",
    "test_readiness_probes_the_configured_frontend_port",
    "test_failed_state_raises_at_once_with_the_operator_message",
    "test_pods_not_ready_alone_keeps_it_not_ready",
    "test_frontend_down_alone_keeps_it_not_ready",
    "test_frontend_404_counts_as_up",
    "test_deleted_while_waiting_fails_fast",
    "test_owner_reference_cascade_deletes_the_dgd_with_the_raycluster",
    "test_an_owner_in_another_namespace_is_refused_before_any_patch",
)
# tests/test_kubeflow.py tests that mean the same there (`server`, `sim`, `api` are the real
# control plane's; the TrainJob simulator runs the pods' commands as local processes)
TRAINER_REAL = (
    "test_manifests_validate_against_the_crds",
    "test_runtime_named_by_config_hash_reused_never_mutated",
    "test_run_to_success_with_code_on_two_nodes",
    "test_failure_attach_and_stop",
    "test_suspend_maps_to_stopped_and_pvc_is_kept",
    "test_namespaced_runtime",
    "test_submit_that_died_half_way_is_repaired",
    "test_unused_runtimes_go_never_while_a_trainjob_uses_them",
    "test_a_runtime_taken_recently_is_kept",
)
for _name in DYNAMO_REAL:
    globals()[_name] = getattr(loopback_dynamo, _name)
for _name in TRAINER_REAL:
    globals()[_name] = getattr(loopback_kubeflow, _name)
code_dir = loopback_kubeflow.code_dir  # a fixture those tests take
# conftest's `dynamo_sim` takes `kube_server`, the real control plane here (below)

ENDPOINT_SLICE = Kind("discovery.k8s.io", "v1", "EndpointSlice", "endpointslices")
JOBSET = Kind("jobset.x-k8s.io", "v1alpha2", "JobSet", "jobsets")
REAL_TRAINER_NS = "trainer-real"  # the real Trainer's TrainJobs: the simulator's are in default


@pytest.fixture(scope="module")
def kube_server(control_plane: Any) -> Any:
    """The real control plane, where the loopback tests ask for `kube_server`."""
    from prefect_nemo.testing.control_plane import pod_network

    if reason := pod_network.unavailable_reason():
        (pytest.fail if IN_CI else pytest.skip)(reason)
    return control_plane


@pytest.fixture(scope="module")
def api(kube_server: Any) -> Any:
    """Our client on the real API server, with no DGD left in `default` by an earlier run."""
    from prefect_nemo.blocks.kubernetes import KubernetesCluster

    api = KubernetesCluster(kubeconfig=kube_server.kubeconfig()).api()
    for dgd in api.list(dynamo.dgd_kind(), namespace="default")[0]:
        name = dgd["metadata"]["name"]
        api.patch(dynamo.dgd_kind(), name, {"metadata": {"finalizers": None}}, "default")
        delete_dgd(api, name, "default")
    return api


@pytest.fixture(scope="module")
def server(kube_server: Any) -> Any:
    """The real control plane, where the loopback tests ask for `server`."""
    return kube_server


@pytest.fixture(scope="module")
def sim(server: Any) -> Iterator[Any]:
    """The TrainJob simulator in `default` only (REAL_TRAINER_NS is the real controller's)."""
    from prefect_nemo.testing.operators import TrainJobSimulator

    with TrainJobSimulator(server, namespace="default") as simulator:
        yield simulator


@pytest.fixture
def trainer_controller(server: Any) -> Iterator[None]:
    """The real Kubeflow Trainer controller while the test runs (`make control-plane` builds it;
    outside CI the test skips until then)."""
    from prefect_nemo.testing.control_plane import build, run

    if not (build.trainer_binary().is_file() and build.jobset_crd().is_file()):
        reason = f"the real Kubeflow Trainer controller is not built: {build.TRAINER_HINT}"
        (pytest.fail if IN_CI else pytest.skip)(reason)
    from kubernetes import client

    try:
        client.CoreV1Api(server.api_client()).create_namespace(
            {"metadata": {"name": REAL_TRAINER_NS}}
        )
    except client.ApiException as exc:
        if exc.status != 409:  # 409: there from an earlier run
            raise
    with run.trainer_controller(server):
        yield


def test_real_gc_takes_the_pods_service_and_endpoints_of_a_deleted_dgd(
    api: Any, dynamo_sim: Any
) -> None:
    """Kubernetes (Garbage Collection): "Kubernetes checks for and deletes objects that no
    longer have owner references" — the DGD's pods and frontend Service (owned by it, as the
    Dynamo operator owns them) and the Service's EndpointSlices go with the DGD, by the real
    garbage collector; the frontend was reached through the real service proxy before."""
    loopback_dynamo.deploy(api, "gc-graph")
    assert wait_dgd_ready(api, "gc-graph", "default", 30).frontend_status == 200
    status, body = api.proxy("default", "gc-graph-frontend", 8000, "/v1/models")
    assert status == 200 and b'"gc-graph"' in body
    selector = f"{dynamo.GRAPH_LABEL}=gc-graph"
    assert api.list(POD, label_selector=selector)[0]
    slices = "kubernetes.io/service-name=gc-graph-frontend"
    assert wait_until(lambda: api.list(ENDPOINT_SLICE, label_selector=slices)[0], 10)
    started = time.monotonic()
    assert delete_dgd(api, "gc-graph", "default") is True
    gone = wait_until(
        lambda: (
            not api.list(POD, label_selector=selector)[0]
            and api.get(SERVICE, "gc-graph-frontend", "default") is None
            and not api.list(ENDPOINT_SLICE, label_selector=slices)[0]
        ),
        30,
    )
    assert gone, f"owned objects outlived the DGD ({time.monotonic() - started:.0f}s)"


def test_the_real_trainer_builds_the_pods_the_simulator_runs(
    server: Any, sim: Any, code_dir: Any, trainer_controller: None
) -> None:
    """Kubeflow Trainer (Job Template guide): "Kubeflow Trainer controller manager creates the
    appropriate JobSet based on the TrainJob specification, the Template, and additional
    runtime configurations such as PodGroupPolicy and MLPolicy"; RuntimePatches: each
    contributor's entry is merged "into the final JobSet before creation". The real v2.3.0
    controller's JobSet for our two-node TrainJob (torchrun, code by runtimePatches, a Secret
    env) holds the very pod template our simulator runs; the JobSet is owned by the TrainJob
    and goes with it (the real garbage collector); with no JobSet status yet, it is PENDING."""
    from pydantic import SecretStr

    from prefect_nemo import JobSpec, JobState
    from prefect_nemo.backends.kubeflow import KubeflowTrainerBackend
    from prefect_nemo.blocks.kubernetes import KubernetesCluster
    from prefect_nemo.kube import TRAIN_JOB

    api = KubernetesCluster(kubeconfig=server.kubeconfig(), namespace=REAL_TRAINER_NS).api()
    backend = KubeflowTrainerBackend(api, TrainerConfig(image="python:3.11-slim", num_nodes=2))
    job_id = f"real-{uid()}"
    spec = JobSpec(entrypoint="python train.py", working_dir=code_dir, launcher="torchrun",
                   env={"TOKEN": SecretStr("t" * 12)})  # fmt: skip
    backend.submit(spec, job_id, META)
    jobset = wait_until(lambda: api.get(JOBSET, job_id), 60)
    assert jobset, f"the Trainer made no JobSet for {job_id}"
    node = jobset["spec"]["replicatedJobs"][0]
    assert node["name"] == "node" and node["template"]["spec"]["parallelism"] == 2
    real = node["template"]["spec"]["template"]
    for container in real["spec"]["containers"]:
        if container.get("resources") == {}:
            del container["resources"]  # Go's empty struct: the same as none
    assert real == sim.pod_template(api.get(TRAIN_JOB, job_id))
    assert backend.find(job_id).state is JobState.PENDING
    owner = jobset["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"]) == ("TrainJob", job_id)
    api.delete(TRAIN_JOB, job_id)
    assert wait_until(lambda: api.get(JOBSET, job_id) is None, 30), "the JobSet outlived it"
