"""Dry runs (issue 14 item 4): "Give run_job/submit_job ... a dry_run option on every backend that
returns what would be submitted (Ray request body, RayJob/RayCluster/DGD/TrainJob/ConfigMap/Secret
manifests, sbatch script, Lepton/run:ai payloads) with secrets redacted, and submits nothing"."""

from __future__ import annotations

import socket
import uuid
from typing import Any

import pytest
import yaml
from pydantic import SecretStr

from prefect_nemo import DryRun, InvalidJobSpec, JobSpec, PlacementSpec
from prefect_nemo.blocks import KubeflowTrainerCluster, KubeRayCluster, RayJobsCluster
from prefect_nemo.blocks.kubernetes import KubernetesCluster
from prefect_nemo.kube import kind_for
from prefect_nemo.redaction import MASK
from prefect_nemo.tasks.jobs import run_job, submit_job

SECRET = f"s3cret-{uuid.uuid4().hex}"
TOKEN = f"tok-{uuid.uuid4().hex}"


def _closed_port() -> int:
    """A port nothing listens on: a dry run that sent a request would fail."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_ray_jobs_dry_run_renders_the_submission_and_sends_nothing(tmp_path) -> None:
    (tmp_path / "train.py").write_text("print('hi')\n")
    cluster = RayJobsCluster(dashboard_url=f"http://127.0.0.1:{_closed_port()}", auth_token=TOKEN)
    spec = JobSpec(
        name="sft",
        entrypoint="python train.py",
        working_dir=tmp_path,
        env={"PLAIN": "1", "HF_TOKEN": SecretStr(SECRET)},
        placement=PlacementSpec(gpus_per_node=1, exclude_head=True, node_labels={"pool": "a"}),
    )
    dry = run_job.fn(spec, cluster, dry_run=True)
    assert isinstance(dry, DryRun) and dry.backend == "ray-jobs"
    [doc] = dry.documents
    request = doc["request"]
    assert request["submission_id"] == dry.job_id and request["entrypoint"] == "python train.py"
    assert request["runtime_env"]["env_vars"]["PLAIN"] == "1"
    assert request["runtime_env"]["env_vars"]["HF_TOKEN"] == MASK
    assert request["entrypoint_num_gpus"] == 1
    assert request["entrypoint_label_selector"]["pool"] == "a"
    assert "working_dir" in request["runtime_env"]
    assert SECRET not in dry.yaml and TOKEN not in dry.yaml
    again = submit_job.fn(spec, cluster, dry_run=True)
    assert again.job_id == dry.job_id, "the same job renders the same id (what a run would use)"


# ---------------------------------------------------------------------------------------------
# Kubernetes backends: every rendered manifest is accepted by the strict loopback API server
# (the real CRD schemas from ../shared/crds), and rendering sends no request at all


RAY_IMAGE = "rayproject/ray:2.60.0"


def _ray_cluster_spec() -> dict[str, Any]:
    def group() -> dict[str, Any]:
        container = {"name": "ray", "image": RAY_IMAGE}
        return {"rayStartParams": {}, "template": {"spec": {"containers": [container]}}}

    return {"headGroupSpec": group(), "workerGroupSpecs": [{"groupName": "w", **group()}]}


def _accepted(kube_server: Any, doc: dict[str, Any]) -> dict[str, Any]:
    """`doc` as the server would store it (validated and defaulted by a create with
    dryRun=All: nothing is stored)."""
    api = KubernetesCluster(kubeconfig=kube_server.kubeconfig()).api()
    kind = kind_for(doc)
    ns = api._ns(kind, None, doc)
    return api._resource(kind).create(body=doc, namespace=ns, dry_run="All").to_dict()


def _no_request(kube_server: Any) -> None:
    assert kube_server.requests.entries == [], [
        f"{e.method} {e.path}" for e in kube_server.requests.entries
    ]


def test_kuberay_dry_run_renders_the_secret_and_rayjob_submit_would_send(
    kube_server: Any,
) -> None:
    """What `submit` sends, built by the same function: the Secret of the secret env values,
    then the RayJob (which reads it with envFrom), secrets masked, no request sent."""
    kube = KubernetesCluster(kubeconfig=kube_server.kubeconfig())
    cluster = KubeRayCluster(kubernetes=kube, ray_cluster_spec=_ray_cluster_spec(),
                             ray_token=TOKEN, namespace="default")  # fmt: skip
    spec = JobSpec(name="train", entrypoint="python t.py",
                   env={"PLAIN": "1", "HF_TOKEN": SecretStr(SECRET)})  # fmt: skip
    kube_server.requests.clear()
    dry = run_job.fn(spec, cluster, dry_run=True)
    _no_request(kube_server)
    assert dry.backend == "kuberay" and [d["kind"] for d in dry.documents] == ["Secret", "RayJob"]
    secret, rayjob = dry.documents
    assert secret["stringData"] == {"HF_TOKEN": MASK}
    assert rayjob["metadata"]["name"] == dry.job_id
    head = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert head["envFrom"] == [{"secretRef": {"name": secret["metadata"]["name"]}}]
    assert SECRET not in dry.yaml and TOKEN not in dry.yaml
    for doc in dry.documents:
        _accepted(kube_server, doc)
    # exactly what submit sends: submit the rendered job and read back what the server holds
    backend = cluster.backend()
    meta = {"prefect_nemo.flow_run_id": "run-1"}
    rendered = _accepted(kube_server, backend.render(spec, "dry-vs-real", meta)[-1])
    backend.submit(spec, "dry-vs-real", meta)
    stored = backend.api.get(kind_for(rendered), "dry-vs-real", "default")
    assert stored["spec"] == rendered["spec"]
    assert stored["metadata"]["labels"] == rendered["metadata"]["labels"]
    backend.api.delete(kind_for(rendered), "dry-vs-real", "default")


def test_kuberay_dry_run_names_the_code_package_ray_would_upload(
    kube_server: Any, tmp_path: Any
) -> None:
    """On an existing cluster, working_dir travels as the gcs:// package Ray's uploader names
    by content: the dry run computes that name without reaching the cluster."""
    (tmp_path / "t.py").write_text("print(1)\n")
    kube = KubernetesCluster(kubeconfig=kube_server.kubeconfig())
    cluster = KubeRayCluster(kubernetes=kube, ray_cluster_name="shared")
    kube_server.requests.clear()
    dry = run_job.fn(JobSpec(entrypoint="python t.py", working_dir=tmp_path), cluster,
                     dry_run=True)  # fmt: skip
    _no_request(kube_server)
    (rayjob,) = dry.documents
    runtime_env = yaml.safe_load(rayjob["spec"]["runtimeEnvYAML"])
    assert runtime_env["working_dir"].startswith("gcs://_ray_pkg_")
    assert rayjob["spec"]["clusterSelector"] == {"ray.io/cluster": "shared"}
    _accepted(kube_server, rayjob)


def test_kubeflow_dry_run_renders_everything_submit_would_create(
    kube_server: Any, tmp_path: Any
) -> None:
    """PVCs (created where missing), the runtime, the Secret, the code ConfigMaps and the
    TrainJob, in the order submit creates them; secrets masked, no request sent; each one
    accepted by the server; and the TrainJob is exactly what submit then creates."""
    (tmp_path / "sft.py").write_text("print('sft')\n")
    kube = KubernetesCluster(kubeconfig=kube_server.kubeconfig())
    cluster = KubeflowTrainerCluster(
        kubernetes=kube, image="nvcr.io/nvidia/pytorch:25.01-py3", num_nodes=2, gpus_per_node=1,
        pvc_mounts=[{"name": "data", "mount_path": "/data"}], runtime_prefix="dry",
    )  # fmt: skip
    spec = JobSpec(name="sft", entrypoint="python sft.py", working_dir=tmp_path,
                   env={"HF_TOKEN": SecretStr(SECRET)})  # fmt: skip
    kube_server.requests.clear()
    dry = run_job.fn(spec, cluster, dry_run=True)
    _no_request(kube_server)
    kinds = [d["kind"] for d in dry.documents]
    assert kinds == ["PersistentVolumeClaim", "ClusterTrainingRuntime", "Secret", "ConfigMap",
                     "TrainJob"]  # fmt: skip
    assert dry.documents[2]["stringData"] == {"HF_TOKEN": MASK} and SECRET not in dry.yaml
    trainjob = dry.documents[-1]
    assert trainjob["spec"]["runtimeRef"]["name"] == dry.documents[1]["metadata"]["name"]
    assert trainjob["spec"]["trainer"]["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == 1
    for doc in dry.documents:
        _accepted(kube_server, doc)
    backend = cluster.backend()
    rendered = _accepted(kube_server, backend.render(spec, "sft-dry-vs-real", {})[-1])
    backend.submit(spec, "sft-dry-vs-real", {})
    stored = backend.api.get(kind_for(rendered), "sft-dry-vs-real", "default")
    assert stored["spec"] == rendered["spec"]
    backend.api.delete(kind_for(rendered), "sft-dry-vs-real", "default")


def test_deploy_dgd_dry_run_returns_the_manifest_without_owner(kube_server: Any) -> None:
    """The documented CLI "renders every manifest without applying (--dry-run; the DGD without
    its owner reference)": deploy_dgd(dry_run=True) returns the DGD it would apply, valid
    against the CRD, and sends nothing."""
    from prefect_nemo.tasks.dgd import deploy_dgd

    kube = KubernetesCluster(kubeconfig=kube_server.kubeconfig())
    kube_server.requests.clear()
    doc = deploy_dgd.fn("flows/manifests/dgd-vllm-agg.yaml", kube, name="dry-rollout",
                        image="img:1", dry_run=True)  # fmt: skip
    _no_request(kube_server)
    assert doc["kind"] == "DynamoGraphDeployment" and doc["metadata"]["name"] == "dry-rollout"
    assert "ownerReferences" not in doc["metadata"]
    _accepted(kube_server, doc)
    kube_server.requests.clear()
    with pytest.raises(InvalidJobSpec, match="frontend_port 9000"):
        deploy_dgd.fn("flows/manifests/dgd-vllm-agg.yaml", kube, frontend_port=9000,
                      dry_run=True)  # fmt: skip
    _no_request(kube_server)
