"""Dynamo DGDs and Kubeflow TrainJobs on the REAL kube-apiserver + kube-controller-manager (the
`control_plane` fixture, built from Go modules), with our operator simulators on it.

The loopback tests of tests/test_dynamo.py and tests/test_kubeflow.py named in DYNAMO_REAL and
TRAINER_REAL run here again, unchanged, over the real API server: the real CRD validation,
finalizers, the real garbage collector, the frontend reached through the real service proxy
(routed by the real EndpointSlice controller to the simulator's frontend, listening on a pod
address of its own from `PodNetwork`), and pod logs read through the API server from the
simulator's kubelet endpoint. The others stay loopback-only: they drive loopback controls
(forbid, drop_watches, the request log). The real Kubeflow Trainer controller (v2.3.0) and the
real JobSet controller (v0.12.0), built from their Go modules and started by the control plane,
run one TrainJob to its end (pods run by the node agent) and check what the simulator runs.
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
from tests.conftest import IN_CI, real_kube_server_fixture, wait_until
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
JOB = Kind("batch", "v1", "Job", "jobs")


kube_server = real_kube_server_fixture()  # the real control plane


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
    """The TrainJob simulator in `default` only (the real controllers' are elsewhere)."""
    from prefect_nemo.testing.operators import TrainJobSimulator

    with TrainJobSimulator(server, namespace="default") as simulator:
        yield simulator


@pytest.fixture(scope="module")
def trainer_controllers(server: Any) -> Any:
    """The real Kubeflow Trainer + JobSet controllers the control plane started (`make
    control-plane` builds them; outside CI the test skips until then); they write only in
    controllers.TRAINER_NAMESPACE (the simulator's TrainJobs are in default)."""
    if reason := server.controllers_unavailable:
        (pytest.fail if IN_CI else pytest.skip)(reason)
    return server


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


def without_trainjob_status(pod: dict[str, Any], job_id: str) -> dict[str, Any]:
    """The pod template less what the Trainer's TrainJobStatus plugin adds, checked first: the
    real plane runs it with that (alpha) feature gate on (controllers.py), the simulator models
    v2.3.0 as shipped, the gate off (pkg/runtime/framework/plugins/trainjobstatus)."""
    spec = pod["spec"]
    (token,) = [v for v in spec["volumes"] if v["name"] == "kubeflow-trainer-token"]
    account, tls = token["projected"]["sources"]
    assert account["serviceAccountToken"]["audience"].endswith(f"/trainjobs/{job_id}/status")
    assert tls["configMap"]["name"] == f"{job_id}-tls-config"
    spec["volumes"] = [v for v in spec["volumes"] if v is not token]
    for container in spec["containers"]:
        names = {e["name"]: e.get("value") for e in container["env"]}
        assert names["KUBEFLOW_TRAINER_SERVER_URL"].endswith(f"/trainjobs/{job_id}/status")
        container["env"] = [e for e in container["env"]
                            if not e["name"].startswith("KUBEFLOW_TRAINER_SERVER_")]  # fmt: skip
        container["volumeMounts"] = [m for m in container["volumeMounts"]
                                     if m["name"] != "kubeflow-trainer-token"]  # fmt: skip
    return pod


def test_the_real_trainer_builds_the_pods_the_simulator_runs(
    server: Any, sim: Any, code_dir: Any, trainer_controllers: Any
) -> None:
    """Kubeflow Trainer (Job Template guide): "Kubeflow Trainer controller manager creates the
    appropriate JobSet based on the TrainJob specification, the Template, and additional
    runtime configurations such as PodGroupPolicy and MLPolicy"; RuntimePatches: each
    contributor's entry is merged "into the final JobSet before creation". The real v2.3.0
    controller's JobSet for our two-node TrainJob (torchrun, code by runtimePatches, a Secret
    env) holds the very pod template our simulator runs; the JobSet is owned by the TrainJob
    and goes with it (the real garbage collector)."""
    from pydantic import SecretStr

    from prefect_nemo import JobSpec
    from prefect_nemo.backends.kubeflow import KubeflowTrainerBackend
    from prefect_nemo.blocks.kubernetes import KubernetesCluster
    from prefect_nemo.kube import TRAIN_JOB
    from prefect_nemo.testing.control_plane.controllers import TRAINER_NAMESPACE

    api = KubernetesCluster(kubeconfig=server.kubeconfig(), namespace=TRAINER_NAMESPACE).api()
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
    simulated = sim.pod_template(api.get(TRAIN_JOB, job_id))
    real = without_trainjob_status(real, job_id)
    # JobSet's webhook: "Default pod restart policy to OnFailure" (our runtime sets none; the
    # simulator applies JobSet's default)
    assert real["spec"]["restartPolicy"] == "OnFailure"
    assert real == simulated
    owner = jobset["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"]) == ("TrainJob", job_id)
    api.delete(TRAIN_JOB, job_id)
    assert wait_until(lambda: api.get(JOBSET, job_id) is None, 30), "the JobSet outlived it"


def test_a_trainjob_runs_to_complete_on_the_real_trainer_jobset_and_job_controllers(
    trainer_controllers: Any,
) -> None:
    """Kubeflow Trainer v2.3.0 (trainjob_types.go): "TrainJobComplete means that the TrainJob
    has completed its execution", set by its JobSet plugin from the JobSet's "Completed"
    condition ("JobSetCompleted means the job has completed its execution", reason
    "AllJobsCompleted", message "jobset completed successfully": JobSet v0.12.0). Our
    one-node TrainJob goes TrainJob -> real Trainer -> JobSet -> real JobSet controller -> Job
    -> real Job controller -> pod, run by the node agent as a local process: it reaches
    Complete, its log comes back through the API server's `pods/log` (the node's kubelet
    endpoint), and a job we cancel (the TrainJob deleted in the background) loses its JobSet,
    pods and processes to the real garbage collector ("Kubernetes checks for and deletes
    objects that no longer have owner references"). One node: each pod here shares the
    machine's ports, and torch's rendezvous across pods would need the pods' DNS names, which
    the agent does not serve."""
    from prefect_nemo import JobSpec, JobState
    from prefect_nemo.backends.kubeflow import KubeflowTrainerBackend
    from prefect_nemo.blocks.kubernetes import KubernetesCluster
    from prefect_nemo.kube import CONFIGMAP, SECRET, TRAIN_JOB
    from prefect_nemo.testing.control_plane.controllers import TRAINER_NAMESPACE
    from prefect_nemo.testing.control_plane.node_agent import pod_processes

    plane = trainer_controllers
    if plane.agent_unavailable:
        (pytest.fail if IN_CI else pytest.skip)(plane.agent_unavailable)
    api = KubernetesCluster(kubeconfig=plane.kubeconfig(), namespace=TRAINER_NAMESPACE).api()
    backend = KubeflowTrainerBackend(api, TrainerConfig(image="python:3.11-slim"))
    done, cancelled = f"done-{uid()}", f"cancel-{uid()}"
    program = "import os; print('trained on node', os.environ['NODE_RANK'])"
    backend.submit(JobSpec(entrypoint=f'python -c "{program}"'), done, META)
    sleeper = "import time; print('started', flush=True); time.sleep(300)"
    backend.submit(JobSpec(entrypoint=f'python -c "{sleeper}"'), cancelled, META)

    status = loopback_kubeflow.wait_terminal(backend, done, 60)
    why = plane.log("jobset-controller")[-2000:] + plane.log("node_agent")[-2000:]
    assert status.state is JobState.SUCCEEDED, f"{status}: {why}"
    complete = next(c for c in api.get(TRAIN_JOB, done)["status"]["conditions"]
                    if c["type"] == "Complete")  # fmt: skip
    assert (complete["status"], complete["reason"]) == ("True", "AllJobsCompleted")
    assert "trained on node 0" in backend.logs(done)

    assert wait_until(lambda: "started" in (backend.read_log(cancelled) or ""), 30), why
    pod_uids = {p["metadata"]["uid"] for p in api.list(
        POD, label_selector=f"jobset.sigs.k8s.io/jobset-name={cancelled}")[0]}  # fmt: skip
    assert pod_uids and pod_processes(pod_uids)
    backend.request_stop(cancelled)
    gone = wait_until(lambda: api.get(JOBSET, cancelled) is None and not api.list(
        POD, label_selector=f"jobset.sigs.k8s.io/jobset-name={cancelled}")[0], 30)  # fmt: skip
    assert gone, "the JobSet or its pods outlived the cancelled TrainJob"
    assert wait_until(lambda: not pod_processes(pod_uids), 10), "its processes outlived it"
    # The stop deletes the TrainJob in the background: Trainer v2.3.0 re-applies the JobSet of
    # an unfinished TrainJob even while it is being deleted (its Reconcile does not look at the
    # deletionTimestamp), so one held in foreground deletion got a new JobSet and stayed for
    # minutes. The job reads STOPPED once the TrainJob and its pods are gone, and stays so.
    stopped = lambda: backend.find(cancelled).state is JobState.STOPPED  # noqa: E731
    if not wait_until(stopped, 30):
        left = api.get(TRAIN_JOB, cancelled) or {}
        owner_uid = (left.get("metadata") or {}).get("uid")
        owned = [f"{kind.kind}/{o['metadata']['name']} {o['metadata'].get('finalizers')}"
                 for kind in (JOBSET, POD, SERVICE, SECRET, CONFIGMAP, JOB)
                 for o in api.list(kind, TRAINER_NAMESPACE)[0]
                 if owner_uid in {r.get("uid") for r in o["metadata"].get("ownerReferences") or []}]
        gc = [ln for ln in plane.log("kube-controller-manager").splitlines() if cancelled in ln]
        pytest.fail(f"the cancelled TrainJob stayed: {left.get('metadata')}; what it still "
                    f"owns: {owned}; its GC lines: " + "\n".join(gc[-20:]))  # fmt: skip
    time.sleep(3)  # time for a controller to bring anything back
    assert stopped() and api.get(JOBSET, cancelled) is None, "something brought the job back"
    api.delete(TRAIN_JOB, done)


def test_a_two_node_trainjob_runs_each_node_on_the_real_controllers(
    trainer_controllers: Any,
) -> None:
    """Kubeflow Trainer v2.3.0 (trainjob_types.go): "NumNodes is the number of training nodes";
    its JobSet plugin makes one Job of `numNodes` pods (parallelism and completions), each pod
    with its own `PET_NODE_RANK` ("the rank of the current node" of torch.distributed.run,
    taken from the Job's completion index). Two nodes, the entrypoint as it is on each (no
    torchrun: a rendezvous across pods needs their DNS names, which the node agent does not
    serve): both pods run, each with its own rank, and the TrainJob reaches Complete."""
    from prefect_nemo import JobSpec, JobState
    from prefect_nemo.backends.kubeflow import KubeflowTrainerBackend
    from prefect_nemo.blocks.kubernetes import KubernetesCluster
    from prefect_nemo.kube import TRAIN_JOB
    from prefect_nemo.testing.control_plane.controllers import TRAINER_NAMESPACE

    plane = trainer_controllers
    if plane.agent_unavailable:
        (pytest.fail if IN_CI else pytest.skip)(plane.agent_unavailable)
    api = KubernetesCluster(kubeconfig=plane.kubeconfig(), namespace=TRAINER_NAMESPACE).api()
    config = TrainerConfig(image="python:3.11-slim", num_nodes=2)
    backend = KubeflowTrainerBackend(api, config)
    job_id = f"two-{uid()}"
    program = "import os; print('node', os.environ['NODE_RANK'], 'of', os.environ['PET_NNODES'])"
    backend.submit(JobSpec(entrypoint=f'python -c "{program}"'), job_id, META)
    status = loopback_kubeflow.wait_terminal(backend, job_id, 90)
    why = plane.log("jobset-controller")[-2000:] + plane.log("node_agent")[-2000:]
    assert status.state is JobState.SUCCEEDED, f"{status}: {why}"
    pods, _ = api.list(POD, label_selector=f"jobset.sigs.k8s.io/jobset-name={job_id}")
    assert len(pods) == 2, [p["metadata"]["name"] for p in pods]
    logs = sorted(api.pod_log(p["metadata"]["name"], TRAINER_NAMESPACE, container="node")
                  for p in pods)  # fmt: skip
    assert [line.strip() for line in logs] == ["node 0 of 2", "node 1 of 2"], logs
    api.delete(TRAIN_JOB, job_id)
