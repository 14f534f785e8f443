"""The KubeRay and Dynamo operator simulators against the loopback API server (real CRDs)."""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException
from ray.job_submission import JobSubmissionClient

from prefect_nemo.local_ray import LocalRayCluster, start_local_ray
from prefect_nemo.testing.kube_api import LoopbackKubeServer, crd_dir
from prefect_nemo.testing.operators import DynamoSimulator, KubeRaySimulator
from prefect_nemo.testing.operators.dynamo import components

T = TypeVar("T")
NS = "default"
RAY_IMAGE = "rayproject/ray:2.60.0"


def wait_for(fn: Callable[[], T], timeout_s: float = 30.0, what: str = "condition") -> T:
    """fn()'s first truthy value, polled every 50 ms; fails after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.05)


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


# -- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kube() -> Iterator[LoopbackKubeServer]:
    server = LoopbackKubeServer(crds=[crd_dir()]).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def api(kube: LoopbackKubeServer) -> client.ApiClient:
    return kube.api_client()


@pytest.fixture(scope="module")
def custom(api: client.ApiClient) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(api)


@pytest.fixture(scope="module")
def core(api: client.ApiClient) -> client.CoreV1Api:
    return client.CoreV1Api(api)


@pytest.fixture(scope="module")
def ray() -> Iterator[LocalRayCluster]:
    with start_local_ray(num_cpus=4) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def ray_jobs(ray: LocalRayCluster) -> JobSubmissionClient:
    """Ray's own client, to look at the Ray jobs behind the simulator's back."""
    return JobSubmissionClient(ray.dashboard_url, headers={"Authorization": f"Bearer {ray.token}"})


@pytest.fixture(scope="module")
def kuberay(kube: LoopbackKubeServer, ray: LocalRayCluster) -> Iterator[KubeRaySimulator]:
    with KubeRaySimulator(kube, ray.dashboard_url, ray.token, head_ready_delay_s=0.2) as sim:
        yield sim


@pytest.fixture(scope="module")
def dynamo(kube: LoopbackKubeServer) -> Iterator[DynamoSimulator]:
    with DynamoSimulator(kube, start_delay_s=0.3) as sim:
        yield sim


# -- manifests (valid against the real CRDs) ----------------------------------------------------


def cluster_spec(workers: int = 1) -> dict[str, Any]:
    return {
        "rayVersion": "2.60.0",
        "headGroupSpec": {
            "rayStartParams": {"num-cpus": "0"},
            "template": {
                "spec": {
                    "containers": [
                        {
                            "name": "ray-head",
                            "image": RAY_IMAGE,
                            "ports": [
                                {"containerPort": 6379, "name": "gcs-server"},
                                {"containerPort": 8265, "name": "dashboard"},
                                {"containerPort": 10001, "name": "client"},
                            ],
                        }
                    ]
                }
            },
        },
        "workerGroupSpecs": [
            {
                "groupName": "small",
                "replicas": workers,
                "minReplicas": 0,
                "maxReplicas": 4,
                "rayStartParams": {},
                "template": {"spec": {"containers": [{"name": "ray-worker", "image": RAY_IMAGE}]}},
            }
        ],
    }


def raycluster(name: str, workers: int = 1) -> dict[str, Any]:
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {"name": name, "namespace": NS},
        "spec": cluster_spec(workers),
    }


def rayjob(name: str, entrypoint: str, **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"entrypoint": entrypoint, **spec}
    if "clusterSelector" not in spec and body.get("rayClusterSpec", True) is not None:
        body.setdefault("rayClusterSpec", cluster_spec(workers=0))
    body = {k: v for k, v in body.items() if v is not None}
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": {"name": name, "namespace": NS},
        "spec": body,
    }


def dgd(name: str, worker_replicas: int = 2) -> dict[str, Any]:
    return {
        "apiVersion": "nvidia.com/v1alpha1",
        "kind": "DynamoGraphDeployment",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "backendFramework": "vllm",
            "services": {
                "Frontend": {
                    "componentType": "frontend",
                    "replicas": 1,
                    "extraPodSpec": {"mainContainer": {"image": "nvcr.io/dynamo:0.6"}},
                },
                "VllmDecodeWorker": {
                    "componentType": "worker",
                    "replicas": worker_replicas,
                    "resources": {"limits": {"gpu": "1"}},
                    "envs": [{"name": "MODEL", "value": "Qwen/Qwen3-0.6B"}],
                    "extraPodSpec": {
                        "mainContainer": {
                            "image": "nvcr.io/dynamo:0.6",
                            "command": ["python3", "-m", "dynamo.vllm"],
                        }
                    },
                },
            },
        },
    }


# -- helpers ------------------------------------------------------------------------------------


def get(custom: client.CustomObjectsApi, plural: str, name: str, version: str = "v1") -> Any:
    group = "nvidia.com" if plural == "dynamographdeployments" else "ray.io"
    try:
        return custom.get_namespaced_custom_object(group, version, NS, plural, name)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def job_status(custom: client.CustomObjectsApi, name: str) -> dict[str, Any]:
    return (get(custom, "rayjobs", name) or {}).get("status") or {}


def wait_job(
    custom: client.CustomObjectsApi, name: str, phases: set[str], timeout_s: float = 60.0
) -> dict[str, Any]:
    """The RayJob's status once jobDeploymentStatus is one of phases."""
    return wait_for(
        lambda: (s := job_status(custom, name)).get("jobDeploymentStatus") in phases and s,
        timeout_s,
        f"RayJob {name} to reach {phases}",
    )


def proxy_get(core: client.CoreV1Api, service: str, path: str, **kw: Any) -> str:
    """GET through the API server's service proxy; the raw body (the client would turn a JSON
    body into a Python repr)."""
    resp = core.connect_get_namespaced_service_proxy_with_path(
        service, NS, path, _preload_content=False, **kw
    )
    return resp.data.decode()


def ray_state(ray_jobs: JobSubmissionClient, job_id: str) -> str:
    return str(ray_jobs.get_job_status(job_id).value)


# -- KubeRay ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_raycluster_becomes_ready_and_proxies_the_dashboard(
    kuberay: KubeRaySimulator,
    custom: client.CustomObjectsApi,
    core: client.CoreV1Api,
    ray: LocalRayCluster,
) -> None:
    name = unique("rc")
    custom.create_namespaced_custom_object("ray.io", "v1", NS, "rayclusters", raycluster(name, 2))
    status = wait_for(
        lambda: (
            ((get(custom, "rayclusters", name) or {}).get("status") or {}).get("state") == "ready"
            and get(custom, "rayclusters", name)["status"]
        ),
        20,
        "RayCluster ready",
    )
    conditions = {c["type"]: c["status"] for c in status["conditions"]}
    assert conditions["HeadPodReady"] == "True"
    assert conditions["RayClusterProvisioned"] == "True"
    assert status["readyWorkerReplicas"] == 2
    assert status["head"]["podIP"] and status["head"]["serviceIP"] == status["head"]["podIP"]
    assert status["endpoints"]["dashboard"] == "8265"

    pods = core.list_namespaced_pod(NS, label_selector=f"ray.io/cluster={name}").items
    heads = [p for p in pods if p.metadata.labels["ray.io/node-type"] == "head"]
    workers = [p for p in pods if p.metadata.labels["ray.io/node-type"] == "worker"]
    assert len(heads) == 1 and len(workers) == 2
    assert re.fullmatch(rf"{name}-head-[a-z0-9]{{5}}", heads[0].metadata.name)
    assert heads[0].metadata.labels["ray.io/is-ray-node"] == "yes"
    assert heads[0].metadata.labels["app.kubernetes.io/created-by"] == "kuberay-operator"
    assert {w.metadata.labels["ray.io/group"] for w in workers} == {"small"}
    for pod in pods:
        ref = pod.metadata.owner_references[0]
        assert (ref.kind, ref.name, ref.controller) == ("RayCluster", name, True)
        assert pod.status.phase == "Running"

    svc = core.read_namespaced_service(f"{name}-head-svc", NS)
    assert {p.name: p.port for p in svc.spec.ports}["dashboard"] == 8265
    headers = {"X-Ray-Authorization": f"Bearer {ray.token}"}
    for port in ("8265", "dashboard"):
        body = proxy_get(core, f"{name}-head-svc:{port}", "api/version", _headers=headers)
        assert "ray_version" in json.loads(body)
    custom.delete_namespaced_custom_object("ray.io", "v1", NS, "rayclusters", name)


@pytest.mark.slow
def test_rayjob_with_inline_cluster_succeeds_and_cluster_goes_after_ttl(
    kuberay: KubeRaySimulator,
    custom: client.CustomObjectsApi,
    ray_jobs: JobSubmissionClient,
) -> None:
    name = unique("ok")
    manifest = rayjob(
        name,
        "python -c \"import os; print('hello', os.environ['GREETING'])\"",
        runtimeEnvYAML="env_vars:\n  GREETING: simulated\n",
        metadata={"owner": "tests"},
        shutdownAfterJobFinishes=True,
        ttlSecondsAfterFinished=2,
    )
    custom.create_namespaced_custom_object("ray.io", "v1", NS, "rayjobs", manifest)
    status = wait_job(custom, name, {"Complete", "Failed"})
    assert status["jobDeploymentStatus"] == "Complete"
    assert status["jobStatus"] == "SUCCEEDED"
    assert re.fullmatch(rf"{name}-[a-z0-9]{{5}}", status["rayClusterName"])
    assert re.fullmatch(rf"{name}-[a-z0-9]{{5}}", status["jobId"])
    assert status["dashboardURL"] == (
        f"{status['rayClusterName']}-head-svc.{NS}.svc.cluster.local:8265"
    )
    assert status["startTime"] and status["endTime"]
    rc = get(custom, "rayclusters", status["rayClusterName"])
    assert rc is not None, "the cluster must outlive the job by the TTL"
    assert rc["metadata"]["ownerReferences"][0]["name"] == name

    info = ray_jobs.get_job_info(status["jobId"])
    assert info.metadata == {"owner": "tests"}
    assert info.runtime_env["env_vars"] == {"GREETING": "simulated"}
    assert "hello simulated" in ray_jobs.get_job_logs(status["jobId"])

    wait_for(
        lambda: get(custom, "rayclusters", status["rayClusterName"]) is None,
        15,
        "the cluster deleted after ttlSecondsAfterFinished",
    )
    custom.delete_namespaced_custom_object("ray.io", "v1", NS, "rayjobs", name)


@pytest.mark.slow
def test_failing_entrypoint_fails_the_rayjob_and_the_head_pod_has_its_log(
    kuberay: KubeRaySimulator,
    custom: client.CustomObjectsApi,
    core: client.CoreV1Api,
) -> None:
    name = unique("bad")
    entry = "python -c \"import sys; print('boom-output'); sys.exit(3)\""
    custom.create_namespaced_custom_object("ray.io", "v1", NS, "rayjobs", rayjob(name, entry))
    status = wait_job(custom, name, {"Complete", "Failed"})
    assert (status["jobStatus"], status["jobDeploymentStatus"]) == ("FAILED", "Failed")
    assert status["reason"] == "AppFailed"
    assert status["message"]
    head = core.list_namespaced_pod(
        NS, label_selector=f"ray.io/cluster={status['rayClusterName']},ray.io/node-type=head"
    ).items[0]
    assert "boom-output" in core.read_namespaced_pod_log(head.metadata.name, NS)
    custom.delete_namespaced_custom_object("ray.io", "v1", NS, "rayjobs", name)


@pytest.mark.slow
def test_cluster_selector_runs_on_the_existing_cluster_and_leaves_it(
    kuberay: KubeRaySimulator,
    custom: client.CustomObjectsApi,
) -> None:
    cluster, name = unique("shared"), unique("sel")
    custom.create_namespaced_custom_object(
        "ray.io", "v1", NS, "rayclusters", raycluster(cluster, 0)
    )
    manifest = rayjob(
        name, "echo selected", clusterSelector={"ray.io/cluster": cluster}, jobId=f"{name}-fixed"
    )
    custom.create_namespaced_custom_object("ray.io", "v1", NS, "rayjobs", manifest)
    status = wait_job(custom, name, {"Complete", "Failed"})
    assert (status["jobStatus"], status["rayClusterName"]) == ("SUCCEEDED", cluster)
    assert status["jobId"] == f"{name}-fixed"
    assert get(custom, "rayclusters", cluster) is not None
    owned = [
        rc
        for rc in custom.list_namespaced_custom_object("ray.io", "v1", NS, "rayclusters")["items"]
        if any(r["name"] == name for r in rc["metadata"].get("ownerReferences") or [])
    ]
    assert owned == []
    custom.delete_namespaced_custom_object("ray.io", "v1", NS, "rayjobs", name)
    custom.delete_namespaced_custom_object("ray.io", "v1", NS, "rayclusters", cluster)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"rayClusterSpec": None}, "one of RayClusterSpec or ClusterSelector must be set"),
        ({"ttlSecondsAfterFinished": 10}, "cannot have TTLSecondsAfterFinished"),
        ({"suspend": True}, "not allowed to be suspended"),
        ({"clusterSelector": {"ray.io/cluster": ""}}, "should not be empty"),
    ],
)
def test_invalid_rayjobs_fail_validation(
    kuberay: KubeRaySimulator,
    custom: client.CustomObjectsApi,
    spec: dict[str, Any],
    message: str,
) -> None:
    name = unique("inv")
    custom.create_namespaced_custom_object(
        "ray.io", "v1", NS, "rayjobs", rayjob(name, "echo never", **spec)
    )
    status = wait_job(custom, name, {"ValidationFailed"}, 10)
    assert status["reason"] == "ValidationFailed"
    assert message in status["message"]
    assert "rayClusterName" not in status
    custom.delete_namespaced_custom_object("ray.io", "v1", NS, "rayjobs", name)


@pytest.mark.slow
def test_deleting_a_running_rayjob_stops_its_ray_job(
    kuberay: KubeRaySimulator,
    custom: client.CustomObjectsApi,
    ray_jobs: JobSubmissionClient,
) -> None:
    name = unique("del")
    custom.create_namespaced_custom_object(
        "ray.io", "v1", NS, "rayjobs", rayjob(name, "python -c 'import time; time.sleep(120)'")
    )
    status = wait_for(
        lambda: (s := job_status(custom, name)).get("jobStatus") == "RUNNING" and s,
        60,
        "the Ray job RUNNING",
    )
    custom.delete_namespaced_custom_object("ray.io", "v1", NS, "rayjobs", name)
    wait_for(lambda: ray_state(ray_jobs, status["jobId"]) == "STOPPED", 20, "Ray job STOPPED")
    wait_for(lambda: get(custom, "rayjobs", name) is None, 10, "the RayJob gone")
    wait_for(
        lambda: get(custom, "rayclusters", status["rayClusterName"]) is None,
        10,
        "the owned RayCluster collected",
    )


@pytest.mark.slow
def test_suspend_stops_the_job_and_deletes_the_cluster(
    kuberay: KubeRaySimulator,
    custom: client.CustomObjectsApi,
    ray_jobs: JobSubmissionClient,
) -> None:
    name = unique("sus")
    manifest = rayjob(
        name, "python -c 'import time; time.sleep(120)'", shutdownAfterJobFinishes=True
    )
    custom.create_namespaced_custom_object("ray.io", "v1", NS, "rayjobs", manifest)
    running = wait_for(
        lambda: (s := job_status(custom, name)).get("jobStatus") == "RUNNING" and s,
        60,
        "the Ray job RUNNING",
    )
    custom.patch_namespaced_custom_object(
        "ray.io", "v1", NS, "rayjobs", name, {"spec": {"suspend": True}}
    )
    status = wait_job(custom, name, {"Suspended"}, 30)
    assert "rayClusterName" not in status and "jobId" not in status
    assert ray_state(ray_jobs, running["jobId"]) == "STOPPED" or wait_for(
        lambda: ray_state(ray_jobs, running["jobId"]) == "STOPPED", 10, "Ray job STOPPED"
    )
    assert get(custom, "rayclusters", running["rayClusterName"]) is None
    custom.delete_namespaced_custom_object("ray.io", "v1", NS, "rayjobs", name)


@pytest.mark.slow
def test_active_deadline_fails_the_rayjob_and_stops_the_ray_job(
    kuberay: KubeRaySimulator,
    custom: client.CustomObjectsApi,
    ray_jobs: JobSubmissionClient,
) -> None:
    name = unique("ddl")
    manifest = rayjob(name, "python -c 'import time; time.sleep(120)'", activeDeadlineSeconds=4)
    custom.create_namespaced_custom_object("ray.io", "v1", NS, "rayjobs", manifest)
    status = wait_job(custom, name, {"Complete", "Failed"}, 30)
    assert (status["jobDeploymentStatus"], status["reason"]) == ("Failed", "DeadlineExceeded")
    if status.get("jobId"):
        wait_for(
            lambda: ray_state(ray_jobs, status["jobId"]) in {"STOPPED", "FAILED"},
            15,
            "the Ray job stopped",
        )
    custom.delete_namespaced_custom_object("ray.io", "v1", NS, "rayjobs", name)


# -- Dynamo -------------------------------------------------------------------------------------


def dgd_status(custom: client.CustomObjectsApi, name: str) -> dict[str, Any]:
    return (get(custom, "dynamographdeployments", name, "v1alpha1") or {}).get("status") or {}


def create_dgd(custom: client.CustomObjectsApi, body: dict[str, Any]) -> None:
    custom.create_namespaced_custom_object(
        "nvidia.com", "v1alpha1", NS, "dynamographdeployments", body
    )


def delete_dgd(custom: client.CustomObjectsApi, name: str) -> None:
    custom.delete_namespaced_custom_object(
        "nvidia.com", "v1alpha1", NS, "dynamographdeployments", name
    )


def test_dgd_comes_up_with_labelled_ready_pods_and_a_frontend(
    dynamo: DynamoSimulator,
    custom: client.CustomObjectsApi,
    core: client.CoreV1Api,
) -> None:
    name = unique("dgd")
    dynamo.configure(name, models=["Qwen/Qwen3-0.6B"])
    create_dgd(custom, dgd(name))
    first = wait_for(lambda: dgd_status(custom, name), 5, "a first status")
    assert first["state"] in {"pending", "successful"}
    status = wait_for(
        lambda: (s := dgd_status(custom, name)).get("state") == "successful" and s,
        10,
        "DGD successful",
    )
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "True"

    pods = core.list_namespaced_pod(
        NS, label_selector=f"nvidia.com/dynamo-graph-deployment-name={name}"
    ).items
    assert len(pods) == 3
    by_type = {}
    for pod in pods:
        labels = pod.metadata.labels
        by_type.setdefault(labels["nvidia.com/dynamo-component-type"], []).append(pod)
        comp = labels["nvidia.com/dynamo-component"]
        assert re.fullmatch(rf"{name}-{comp.lower()}-[a-z0-9]{{5}}", pod.metadata.name)
        assert pod.metadata.owner_references[0].kind == "DynamoGraphDeployment"
        assert any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions)
    assert len(by_type["frontend"]) == 1 and len(by_type["worker"]) == 2

    svc = core.read_namespaced_service(f"{name}-frontend", NS)
    assert svc.spec.ports[0].port == 8000
    models = json.loads(proxy_get(core, f"{name}-frontend:8000", "v1/models"))
    assert [m["id"] for m in models["data"]] == ["Qwen/Qwen3-0.6B"]
    assert json.loads(proxy_get(core, f"{name}-frontend:8000", "health"))["status"] == "healthy"
    with pytest.raises(ApiException) as err:
        proxy_get(core, f"{name}-frontend:8000", "no/such/path")
    assert err.value.status == 404
    delete_dgd(custom, name)


def test_dgd_fail_knob_sets_failed_state(
    dynamo: DynamoSimulator,
    custom: client.CustomObjectsApi,
) -> None:
    name = unique("dgdf")
    dynamo.configure(name, fail=True, fail_message="GPU quota exceeded")
    create_dgd(custom, dgd(name, 1))
    status = wait_for(
        lambda: (s := dgd_status(custom, name)).get("state") == "failed" and s, 10, "DGD failed"
    )
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["message"]) == ("False", "GPU quota exceeded")
    delete_dgd(custom, name)


def test_dgd_pods_not_ready_knob_keeps_it_pending(
    dynamo: DynamoSimulator,
    custom: client.CustomObjectsApi,
    core: client.CoreV1Api,
) -> None:
    name = unique("dgdp")
    dynamo.configure(name, pods_ready=False)
    create_dgd(custom, dgd(name, 1))
    selector = f"nvidia.com/dynamo-graph-deployment-name={name}"
    pods = wait_for(
        lambda: (
            (ps := core.list_namespaced_pod(NS, label_selector=selector).items)
            and all(p.status.phase == "Running" for p in ps)
            and ps
        ),
        10,
        "pods Running",
    )
    assert all(
        not any(c.type == "Ready" and c.status == "True" for c in p.status.conditions) for p in pods
    )
    status = dgd_status(custom, name)
    assert status["state"] == "pending"
    assert next(c for c in status["conditions"] if c["type"] == "Ready")["status"] == "False"
    delete_dgd(custom, name)


@pytest.mark.parametrize(
    ("knob", "statuses"), [("404", {404}), ("503", {503}), ("502", {502}), ("refused", {502, 503})]
)
def test_dgd_frontend_knobs(
    dynamo: DynamoSimulator,
    custom: client.CustomObjectsApi,
    core: client.CoreV1Api,
    knob: Any,
    statuses: set[int],
) -> None:
    name = unique("dgdk")
    dynamo.configure(name, frontend=knob)
    create_dgd(custom, dgd(name, 1))
    wait_for(lambda: dgd_status(custom, name).get("state") == "successful", 10, "DGD successful")
    with pytest.raises(ApiException) as err:
        proxy_get(core, f"{name}-frontend:8000", "v1/models")
    assert err.value.status in statuses
    delete_dgd(custom, name)


def test_deleting_a_dgd_collects_its_pods_and_service(
    dynamo: DynamoSimulator,
    custom: client.CustomObjectsApi,
    core: client.CoreV1Api,
) -> None:
    name = unique("dgdd")
    create_dgd(custom, dgd(name, 1))
    wait_for(lambda: dgd_status(custom, name).get("state") == "successful", 10, "DGD successful")
    assert proxy_get(core, f"{name}-frontend:8000", "health")
    delete_dgd(custom, name)
    selector = f"nvidia.com/dynamo-graph-deployment-name={name}"
    wait_for(
        lambda: not core.list_namespaced_pod(NS, label_selector=selector).items,
        10,
        "pods collected",
    )

    def service_gone() -> bool:
        try:
            core.read_namespaced_service(f"{name}-frontend", NS)
        except ApiException as exc:
            return exc.status == 404
        return False

    wait_for(service_gone, 10, "frontend service collected")
    with pytest.raises(ApiException):
        proxy_get(core, f"{name}-frontend:8000", "health")


def test_components_reads_both_dgd_shapes() -> None:
    v1alpha1 = {
        "spec": {
            "services": {
                "Frontend": {"componentType": "frontend"},
                "W": {"componentType": "worker", "replicas": 3},
            }
        }
    }
    v1beta1 = {
        "spec": {
            "components": [
                {"name": "Frontend", "componentType": "frontend"},
                {"name": "W", "componentType": "worker", "replicas": 3},
            ]
        }
    }
    expected = [("Frontend", "frontend", 1), ("W", "worker", 3)]
    assert components(v1alpha1) == components(v1beta1) == expected


def test_dynamo_keeps_reconciling_after_dropped_watches_and_410(
    kube: LoopbackKubeServer,
    dynamo: DynamoSimulator,
    custom: client.CustomObjectsApi,
) -> None:
    kube.drop_watches()  # the informers resume from their last resourceVersion
    first = unique("dgdw")
    create_dgd(custom, dgd(first, 1))
    wait_for(lambda: dgd_status(custom, first).get("state") == "successful", 10, "after a drop")
    kube.compact()  # resuming now answers 410 Gone: the informers must relist
    kube.drop_watches()
    second = unique("dgdw")
    create_dgd(custom, dgd(second, 1))
    wait_for(lambda: dgd_status(custom, second).get("state") == "successful", 10, "after a 410")
    delete_dgd(custom, first)
    delete_dgd(custom, second)
