"""Kubeflow Trainer backend (fast): manifests validated by the loopback API server against the
real v2.3 CRDs, runtime naming by config hash, torchrun/GPU/anti-affinity rendering, secrets
only by reference, validation before any request, status mapping, and the backend driving the
TrainJob simulator's real local processes (no Prefect)."""

from __future__ import annotations

import base64
import json
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr

from prefect_nemo import InvalidJobSpec, JobAlreadyExists, JobSpec, JobState, Resources
from prefect_nemo.backends.kubeflow import (
    MAX_TRAINJOB_NAME,
    RUNTIME_PREFIX_LABEL,
    KubeflowTrainerBackend,
    PvcMount,
    TrainerConfig,
    check_job_id,
    runtime_manifest,
    runtime_name,
    secret_manifest,
    status_from_trainjob,
    trainer_command,
    trainjob_manifest,
)
from prefect_nemo.kube import (
    CLUSTER_TRAINING_RUNTIME,
    CONFIGMAP,
    LAST_USED,
    PVC,
    SECRET,
    TRAIN_JOB,
    KubeApi,
    wait_for,
)
from prefect_nemo.lifecycle import META_FLOW_RUN, META_KEY, META_SPEC, stop_and_confirm

CPU = TrainerConfig(image="python:3.11-slim")
META = {META_KEY: "experiment:x/step", META_SPEC: "abc123", META_FLOW_RUN: "run-1"}
SECRET_VALUE = f"s3cret-{uuid.uuid4().hex}"
# the version the Trainer CRDs serve (a real API server has no trainer.kubeflow.org/v1)
TRAINER_API = {"group": "trainer.kubeflow.org", "version": "v1alpha1"}


@pytest.fixture(scope="module")
def server() -> Iterator[Any]:
    from prefect_nemo.testing.kube_api import LoopbackKubeServer, crd_dir

    with LoopbackKubeServer(crds=[crd_dir()]) as srv:
        yield srv


@pytest.fixture(scope="module")
def sim(server: Any) -> Iterator[Any]:
    from prefect_nemo.testing.operators import TrainJobSimulator

    with TrainJobSimulator(server) as simulator:
        yield simulator


@pytest.fixture(scope="module")
def api(server: Any) -> KubeApi:
    from prefect_nemo.blocks.kubernetes import KubernetesCluster

    return KubernetesCluster(kubeconfig=server.kubeconfig()).api()


@pytest.fixture
def code_dir(tmp_path: Path) -> Path:
    """A tiny package + program: prints its ranks and what it imported, exits with $EXIT."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "util.py").write_text("GREETING = 'hello-from-pkg'\n")
    (tmp_path / "train.py").write_text(
        "import os, sys\nfrom pkg.util import GREETING\n"
        # one write per line: two ranks share the pod's log, and print() writes each argument
        "line = f\"node {os.environ['PET_NODE_RANK']} rank {os.environ['RANK']} {GREETING}\\n\"\n"
        "os.write(1, line.encode())\nsys.exit(int(os.environ.get('EXIT', '0')))\n"
    )
    return tmp_path


def pod_log(server: Any, pod: str) -> str:
    """A pod's `node` container log, read through the API like kubectl logs."""
    from kubernetes import client

    core = client.CoreV1Api(server.api_client())
    return core.read_namespaced_pod_log(pod, "default", container="node")


def uid() -> str:
    return uuid.uuid4().hex[:8]


def wait_terminal(backend: KubeflowTrainerBackend, job_id: str, timeout_s: float = 30) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = backend.find(job_id)
        if status is not None and status.state.is_terminal():
            return status
        time.sleep(0.1)
    raise AssertionError(f"{job_id} not terminal: {backend.find(job_id)}")


def node_pod(manifest: dict[str, Any]) -> dict[str, Any]:
    return manifest["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"][
        "template"]["spec"]  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Manifests


def test_manifests_validate_against_the_crds(server, api, code_dir):
    """Runtime, TrainJob (with code ConfigMaps via runtimePatches), Secret and PVC: every
    object we send is accepted by the strict loopback server (real CRD schemas)."""
    config = TrainerConfig(
        image="nvcr.io/nvidia/pytorch:25.01-py3", num_nodes=2, gpus_per_node=8,
        cpus_per_node="32", memory_per_node="256Gi", extra_packages=("numpy==2.1.0",),
        pvc_mounts=(PvcMount(name=f"data-{uid()}", mount_path="/data", storage_class="nfs"),),
        runtime_prefix=f"t-{uid()}",
    )  # fmt: skip
    backend = KubeflowTrainerBackend(api, config)
    spec = JobSpec(
        entrypoint="python train.py --epochs 1",
        working_dir=code_dir,
        env={"TOKEN": SecretStr(SECRET_VALUE), "MODE": "sft"},
        labels={"team": "llm"},
        metadata={"owner": "me"},
    )
    backend.validate(spec)
    job_id = f"manifest-{uid()}"
    backend.submit(spec, job_id, META)  # no simulator in this test: objects only
    tj = server.get("trainjobs", "default", job_id, **TRAINER_API)
    assert tj is not None and tj["spec"]["runtimeRef"]["name"] == runtime_name(config)
    assert tj["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "prefect-nemo"
    assert tj["metadata"]["labels"]["prefect.io/flow-run-id"] == "run-1"
    trainer = tj["spec"]["trainer"]
    assert trainer["numNodes"] == 2 and trainer["numProcPerNode"] == 8
    assert trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == 8
    script = trainer["command"][2]
    assert "python -m pip install" in script and "numpy==2.1.0" in script
    patch = tj["spec"]["runtimePatches"][0]
    pod = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]["template"][
        "spec"]["template"]["spec"]  # fmt: skip
    cms = [s["configMap"]["name"] for s in pod["volumes"][0]["projected"]["sources"]]
    for name in cms:
        cm = server.get("configmaps", "default", name)
        assert cm["metadata"]["ownerReferences"][0]["uid"] == tj["metadata"]["uid"]
    stored = server.get("secrets", "default", f"{job_id}-env")
    assert stored["metadata"]["ownerReferences"][0]["uid"] == tj["metadata"]["uid"]
    assert server.get("persistentvolumeclaims", "default", config.pvc_mounts[0].name)
    runtime = server.get("clustertrainingruntimes", None, runtime_name(config), **TRAINER_API)
    assert runtime["spec"]["mlPolicy"] == {"numNodes": 2, "torch": {}}
    assert SECRET_VALUE not in json.dumps([tj, runtime, *[server.get("configmaps", "default", n)
                                                           for n in cms]])  # fmt: skip
    assert backend.find(job_id).metadata == {"owner": "me", **{
        k: v for k, v in META.items()}}  # fmt: skip


def test_runtime_named_by_config_hash_reused_never_mutated(server, api):
    prefix = f"r-{uid()}"
    a = TrainerConfig(image="img:1", runtime_prefix=prefix)
    same = TrainerConfig(image="img:1", runtime_prefix=prefix, extra_packages=("numpy",))
    changed = TrainerConfig(image="img:2", runtime_prefix=prefix)
    assert runtime_name(a) == runtime_name(same), "trainer-side settings do not fork runtimes"
    assert runtime_name(a) != runtime_name(changed)
    assert runtime_name(a).startswith(f"{prefix}-torch-") and len(runtime_name(a)) <= 63
    spec = JobSpec(entrypoint="true")
    KubeflowTrainerBackend(api, a).submit(spec, f"rt-{uid()}", {})
    first = api.get(CLUSTER_TRAINING_RUNTIME, runtime_name(a))
    KubeflowTrainerBackend(api, same).submit(spec, f"rt-{uid()}", {})
    KubeflowTrainerBackend(api, changed).submit(spec, f"rt-{uid()}", {})
    again = api.get(CLUSTER_TRAINING_RUNTIME, runtime_name(a))
    # reused, its spec never changed in place (only the last-used stamp the cleanup reads)
    assert again["spec"] == first["spec"]
    assert again["metadata"]["generation"] == first["metadata"]["generation"]
    assert again["metadata"]["uid"] == first["metadata"]["uid"]
    assert api.get(CLUSTER_TRAINING_RUNTIME, runtime_name(changed))["spec"]["template"]["spec"][
        "replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0][
        "image"] == "img:2"  # fmt: skip


def test_cpu_only_has_no_gpu_anywhere():
    m = runtime_manifest(CPU)
    tj = trainjob_manifest(JobSpec(entrypoint="python train.py"), "j", {}, CPU, namespace="n")
    assert "nvidia.com/gpu" not in json.dumps([m, tj])
    assert tj["spec"]["trainer"]["numProcPerNode"] == 1
    assert "resourcesPerNode" not in tj["spec"]["trainer"]
    assert "affinity" not in node_pod(m), "one node needs no anti-affinity"
    gpu = TrainerConfig(image="x", gpus_per_node=4, cpus_per_node="8")
    container = node_pod(runtime_manifest(gpu))["containers"][0]
    assert container["name"] == "node"
    assert container["resources"] == {
        "limits": {"nvidia.com/gpu": 4, "cpu": "8"}, "requests": {"cpu": "8"}}  # fmt: skip
    tj = trainjob_manifest(JobSpec(entrypoint="python t.py"), "j", {}, gpu, namespace="n")
    assert tj["spec"]["trainer"]["numProcPerNode"] == 4


def test_multi_node_torchrun_flags_and_anti_affinity():
    """PodAffinityTerm.matchLabelKeys (Kubernetes API): "The same key is forbidden to exist in
    both matchLabelKeys and labelSelector. Also, matchLabelKeys cannot be set when
    labelSelector isn't set." (the real API server refuses the pods otherwise)"""
    config = TrainerConfig(image="x", num_nodes=4, gpus_per_node=8)
    tj = trainjob_manifest(JobSpec(entrypoint="python train.py --lr 1e-4", launcher="torchrun"),
                           "j", {}, config, namespace="n")  # fmt: skip
    script = tj["spec"]["trainer"]["command"][2]
    run = script.splitlines()[-1]
    assert run.startswith("torchrun ") and run.endswith(" train.py --lr 1e-4")
    for flag, env in [("--nnodes", "PET_NNODES"), ("--nproc-per-node", "PET_NPROC_PER_NODE"),
                      ("--node-rank", "PET_NODE_RANK"), ("--master-addr", "PET_MASTER_ADDR"),
                      ("--master-port", "PET_MASTER_PORT")]:  # fmt: skip
        assert f'{flag}="${env}"' in run
    term = node_pod(runtime_manifest(config))["affinity"]["podAntiAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"][0]  # fmt: skip
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["matchLabelKeys"] == ["jobset.sigs.k8s.io/jobset-name"]
    assert term["labelSelector"] == {
        "matchLabels": {"jobset.sigs.k8s.io/replicatedjob-name": "node"}
    }
    module = trainer_command(JobSpec(entrypoint="python -m pkg.train", launcher="torchrun"),
                             config)[2]  # fmt: skip
    assert module.splitlines()[-1].startswith("torchrun ")
    assert module.splitlines()[-1].endswith(" -m pkg.train")
    for plain in ["echo hi", "python -c 'print(1)'", "bash run.sh"]:
        spec = JobSpec(entrypoint=plain, launcher="torchrun")
        assert trainer_command(spec, config)[2].splitlines()[-1] == plain


def test_no_launcher_runs_the_entrypoint_as_is_on_every_node():
    """Issue 15: "`None` for Ray flows"; Kubeflow with launcher=None must not wrap in torchrun.
    NeMo-Run packages a task whose executor has no launcher as the command itself:
    `if self.launcher is None: self.launcher = Launcher()` (executor.get_launcher), then in
    `packaging.package`: `if launcher and isinstance(launcher, Torchrun): app_def =
    torchrun.torchrun(...)` / `else: app_def = specs.AppDef(... entrypoint=entrypoint ...)`."""
    config = TrainerConfig(image="x", num_nodes=2, gpus_per_node=8)
    for entrypoint in ["python t.py --lr 1", "python -m pkg.train"]:
        script = trainer_command(JobSpec(entrypoint=entrypoint), config)[2]
        assert script.splitlines()[-1] == entrypoint and "torchrun" not in script


def test_secret_env_only_by_reference():
    spec = JobSpec(entrypoint="true", env={"TOKEN": SecretStr(SECRET_VALUE), "MODE": "x"})
    tj = trainjob_manifest(spec, "job-a", META, CPU, namespace="ns")
    assert SECRET_VALUE not in json.dumps(tj)
    env = {e["name"]: e for e in tj["spec"]["trainer"]["env"]}
    assert env["MODE"] == {"name": "MODE", "value": "x"}
    assert env["TOKEN"] == {"name": "TOKEN", "valueFrom": {
        "secretKeyRef": {"name": "job-a-env", "key": "TOKEN"}}}  # fmt: skip
    secret = secret_manifest(spec, "job-a", namespace="ns", flow_run_id="run-1")
    assert secret is not None and secret["stringData"] == {"TOKEN": SECRET_VALUE}
    assert secret_manifest(JobSpec(entrypoint="true"), "j", namespace="n", flow_run_id=None) is None


# ---------------------------------------------------------------------------------------------
# Validation: before any request


class _NoApi:
    """A KubeApi stand-in that fails on any use: validation must not touch the API."""

    namespace = "default"
    host = "http://nowhere"
    secrets: list[str] = []

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"validation called the API ({name})")


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        (JobSpec(entrypoint="x", resources=Resources(gpus=1)), "gpus_per_node"),
        (JobSpec(entrypoint="x", label_selector={"a": "b"}), "label_selector"),
        (JobSpec(entrypoint="x", runtime_env={"pip": ["x"]}), "extra_packages"),
        (JobSpec(entrypoint="x", env={"PET_NNODES": "2"}), "PET_NNODES"),
        (JobSpec(entrypoint="x", labels={"bad key!": "v"}), "JobSpec.labels"),
        (JobSpec(entrypoint="x", labels={"prefect.io/flow-run-id": "v"}), "set by"),
        (JobSpec(entrypoint="x", working_dir=Path("/no/such/dir")), "working_dir"),
        (JobSpec(entrypoint="x" * 90_000, env={f"E{i}": "y" * 9_000 for i in range(200)}),
         "under ~1 MB"),
    ],
)  # fmt: skip
def test_bad_specs_name_the_field(spec: JobSpec, needle: str):
    with pytest.raises(InvalidJobSpec) as info:
        KubeflowTrainerBackend(_NoApi(), CPU).validate(spec)  # type: ignore[arg-type]
    assert needle in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"image": ""}, "image"),
        ({"num_nodes": 0}, "num_nodes"),
        ({"gpus_per_node": -1}, "gpus_per_node"),
        ({"cpus_per_node": "4 cores"}, "cpus_per_node"),
        ({"memory_per_node": "lots"}, "memory_per_node"),
        ({"code_dir": "relative"}, "code_dir"),
        ({"pvc_mounts": (PvcMount(name="Bad_Name", mount_path="/d"),)}, "pvc_mounts[0].name"),
        ({"num_nodes": 2, "pvc_mounts": (PvcMount(name="d", mount_path="/d",
                                                   access_modes=("ReadWriteOnce",)),)},
         "ReadWriteMany"),
        ({"extra_packages": ("numpy; rm -rf /",)}, "extra_packages"),
    ],
)  # fmt: skip
def test_bad_configs_name_the_field(kwargs: dict[str, Any], needle: str):
    with pytest.raises(InvalidJobSpec, match="KubeflowTrainerCluster") as info:
        TrainerConfig(**{"image": "x", **kwargs})
    assert needle in str(info.value)


def test_bad_input_sends_no_request(server, api, tmp_path):
    """Invalid job ids, specs and oversize code fail before the backend sends anything."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "blob.bin").write_bytes(os.urandom(100_000))  # incompressible
    backend = KubeflowTrainerBackend(api, CPU, max_code_bytes=1000)
    before = server.requests.count()
    cases = [
        (JobSpec(entrypoint="x"), "Not_A_Name", "cannot name a TrainJob"),
        (JobSpec(entrypoint="x"), "j" * (MAX_TRAINJOB_NAME + 1), "at most 50"),
        (JobSpec(entrypoint="x", env={"PET_NODE_RANK": "0"}), "ok-name", "PET_NODE_RANK"),
        (JobSpec(entrypoint="x", working_dir=tmp_path), "ok-name", "max_bytes"),
    ]
    for spec, job_id, needle in cases:
        with pytest.raises(InvalidJobSpec, match=needle):
            backend.submit(spec, job_id, META)
    with pytest.raises(InvalidJobSpec, match="max_bytes"):
        backend.validate(JobSpec(entrypoint="x", working_dir=tmp_path))
    assert server.requests.count() == before
    check_job_id("a" * MAX_TRAINJOB_NAME)
    assert KubeflowTrainerBackend.max_job_id_len == MAX_TRAINJOB_NAME


def test_block_fields_and_backend(server):
    from prefect_nemo.blocks import KubeflowTrainerCluster
    from prefect_nemo.blocks.kubernetes import KubernetesCluster

    kube = KubernetesCluster(kubeconfig=server.kubeconfig())
    with pytest.raises(ValueError, match="cpus_per_node"):
        KubeflowTrainerCluster(kubernetes=kube, image="x", cpus_per_node="many")
    block = KubeflowTrainerCluster(
        kubernetes=kube, image="x", num_nodes=2, namespace="default",
        pvc_mounts=[{"name": "data", "mount_path": "/data"}],
    )  # fmt: skip
    assert all(f.description for f in type(block).model_fields.values())
    assert block.get_block_type_slug() == "kubeflow-trainer-cluster"
    assert block._description and block._code_example
    backend = block.backend()
    assert backend.kind == "kubeflow-trainer" and backend.namespace == "default"
    assert backend.config.pvc_mounts == (PvcMount(name="data", mount_path="/data"),)
    assert backend.config.code_dir == "/workspace/code"


# ---------------------------------------------------------------------------------------------
# Status mapping


def _tj(*conditions: tuple[str, str], **meta: Any) -> dict[str, Any]:
    conds = [{"type": t, "status": "True", "reason": r, "message": f"{t} message",
              "lastTransitionTime": "2026-01-01T00:00:05Z"} for t, r in conditions]  # fmt: skip
    suspended = any(t == "Suspended" for t, _ in conditions)  # the spec says so too
    return {"metadata": {"name": "tj", **meta}, "spec": {"suspend": suspended},
            "status": {"conditions": conds}}  # fmt: skip


def _pod(phase: str, index: int = 0, exit_code: int | None = None) -> dict[str, Any]:
    status: dict[str, Any] = {"phase": phase, "startTime": "2026-01-01T00:00:00Z"}
    if exit_code is not None:
        status["containerStatuses"] = [
            {"name": "node", "state": {"terminated": {"exitCode": exit_code}}}
        ]
    labels = {"batch.kubernetes.io/job-completion-index": str(index)}
    return {"metadata": {"name": f"p{index}", "labels": labels}, "status": status}


@pytest.mark.parametrize(
    ("conditions", "pods", "state"),
    [
        ((), [], JobState.PENDING),
        ((), [_pod("Pending")], JobState.PENDING),
        ((), [_pod("Pending"), _pod("Running", 1)], JobState.RUNNING),
        ((), [_pod("Succeeded"), _pod("Succeeded", 1)], JobState.RUNNING),
        ((("Complete", "AllJobsCompleted"),), [_pod("Succeeded")], JobState.SUCCEEDED),
        ((("Failed", "FailedJobs"),), [_pod("Failed", 0, 3)], JobState.FAILED),
        ((("Suspended", "Suspended"),), [], JobState.STOPPED),
    ],
)
def test_state_mapping(conditions: tuple, pods: list, state: JobState):
    assert status_from_trainjob(_tj(*conditions), pods).state is state


def test_status_details():
    failed = status_from_trainjob(
        _tj(("Failed", "FailedJobs")), [_pod("Succeeded", 0, 0), _pod("Failed", 1, 7)]
    )
    assert failed.message == "FailedJobs: Failed message (node 1 exited with code 7)"
    assert failed.exit_code == 7
    killed = status_from_trainjob(
        _tj(("Failed", "FailedJobs")), [_pod("Failed", 0, 137), _pod("Failed", 1, 2)]
    )
    assert killed.exit_code == 2, "the node killed because a sibling failed is not the cause"
    assert failed.start_time is not None and failed.end_time is not None
    assert (failed.end_time - failed.start_time).total_seconds() == 5
    deleting = status_from_trainjob(_tj(deletionTimestamp="2026-01-01T00:00:09Z"), [])
    assert deleting.state is JobState.PENDING and "being deleted" in deleting.message
    false = _tj()
    false["status"]["conditions"] = [{"type": "Complete", "status": "False"}]
    assert status_from_trainjob(false, []).state is JobState.PENDING


# ---------------------------------------------------------------------------------------------
# The backend against the simulator (real local processes; no Prefect)


def test_run_to_success_with_code_on_two_nodes(server, sim, api, code_dir):
    config = TrainerConfig(image="img", num_nodes=2, procs_per_node=2)
    backend = KubeflowTrainerBackend(api, config)
    job_id = f"two-{uid()}"
    spec = JobSpec(entrypoint="python train.py", working_dir=code_dir, launcher="torchrun")
    backend.submit(spec, job_id, META)
    status = wait_terminal(backend, job_id)
    assert status.state is JobState.SUCCEEDED, status
    log = backend.logs(job_id)  # node-0's log: its two torchrun ranks
    assert "node 0 rank 0 hello-from-pkg" in log and "node 0 rank 1 hello-from-pkg" in log
    pods, _ = api.list(
        __import__("prefect_nemo.kube", fromlist=["POD"]).POD,
        label_selector=f"jobset.sigs.k8s.io/jobset-name={job_id}",
    )
    names = sorted(p["metadata"]["name"] for p in pods)
    assert [n.rsplit("-", 1)[0] for n in names] == [f"{job_id}-node-0-0", f"{job_id}-node-0-1"]
    one = {p["metadata"]["labels"]["batch.kubernetes.io/job-completion-index"]: p for p in pods}
    assert "node 1 rank 3 hello-from-pkg" in pod_log(server, one["1"]["metadata"]["name"])
    tj = server.get("trainjobs", "default", job_id, **TRAINER_API)
    assert tj["status"]["jobsStatus"][0]["succeeded"] == 1


def test_failure_attach_and_stop(server, sim, api):
    backend = KubeflowTrainerBackend(api, CPU)
    failing = f"fail-{uid()}"
    spec = JobSpec(entrypoint="echo about-to-fail; exit 7", env={"TOKEN": SecretStr("x" * 12)})
    backend.submit(spec, failing, META)
    with pytest.raises(JobAlreadyExists):
        backend.submit(spec, failing, META)
    items, _ = api.list(TRAIN_JOB, label_selector="app.kubernetes.io/managed-by=prefect-nemo")
    assert [o["metadata"]["name"] for o in items].count(failing) == 1
    status = wait_terminal(backend, failing)
    assert status.state is JobState.FAILED and status.exit_code == 7
    assert "about-to-fail" in backend.logs(failing)

    sleeper = f"stop-{uid()}"
    backend.submit(JobSpec(entrypoint="sleep 60", env={"K": SecretStr("v" * 9)}), sleeper, META)
    deadline = time.monotonic() + 10
    while backend.find(sleeper).state is not JobState.RUNNING and time.monotonic() < deadline:
        time.sleep(0.1)
    assert backend.find(sleeper).state is JobState.RUNNING
    assert sim.local_pids(sleeper)
    status = stop_and_confirm(backend, sleeper, timeout_s=15)
    assert status is not None and status.state is JobState.STOPPED
    assert api.get(TRAIN_JOB, sleeper) is None
    assert api.get(SECRET, f"{sleeper}-env") is None, "the Secret goes with its TrainJob"
    assert not sim.local_pids(sleeper), "the local processes were killed"


def test_suspend_maps_to_stopped_and_pvc_is_kept(server, sim, api):
    claim = f"keep-{uid()}"
    config = TrainerConfig(image="img", pvc_mounts=(PvcMount(name=claim, mount_path="/data"),))
    backend = KubeflowTrainerBackend(api, config)
    job_id = f"susp-{uid()}"
    backend.submit(JobSpec(entrypoint="echo hi > /data/out; sleep 60"), job_id, META)
    deadline = time.monotonic() + 10
    while backend.find(job_id).state is not JobState.RUNNING and time.monotonic() < deadline:
        time.sleep(0.1)
    api.patch(TRAIN_JOB, job_id, {"spec": {"suspend": True}})
    assert wait_terminal(backend, job_id).state is JobState.STOPPED
    assert not sim.local_pids(job_id)
    stop_and_confirm(backend, job_id, timeout_s=15)
    assert api.get(PVC, claim) is not None, "PVCs are never deleted by us"
    assert not [c for c in api.list(CONFIGMAP)[0] if c["metadata"]["name"].startswith(job_id)]


def test_statuses_from_the_watch(server, sim, api):
    """statuses() is served by the informers: no GET per job once synced."""
    backend = KubeflowTrainerBackend(api, CPU)
    woken: list[int] = []
    unsubscribe = backend.subscribe(lambda: woken.append(1))
    try:
        ids = [f"w-{uid()}" for _ in range(3)]
        for job_id in ids:
            backend.submit(JobSpec(entrypoint="sleep 0.3"), job_id, META)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            seen = backend.statuses(ids)
            if len(seen) == 3 and all(s.state is JobState.SUCCEEDED for s in seen.values()):
                break
            time.sleep(0.1)
        assert all(s.state is JobState.SUCCEEDED for s in backend.statuses(ids).values())
        before = server.requests.count(method="GET", watch=False)
        backend.statuses(ids)
        assert server.requests.count(method="GET", watch=False) == before
        assert woken
    finally:
        unsubscribe()


def test_code_on_a_shared_volume_is_unpacked_once(server, sim, api, code_dir):
    """code_dir on a ReadWriteMany PVC: node 0 unpacks, node 1 waits for its marker."""
    claim = f"shared-{uid()}"
    config = TrainerConfig(
        image="img", num_nodes=2, code_dir="/shared/code",
        pvc_mounts=(PvcMount(name=claim, mount_path="/shared"),),
    )  # fmt: skip
    assert config.code_on_shared_volume
    backend = KubeflowTrainerBackend(api, config)
    job_id = f"shared-{uid()}"
    backend.submit(
        JobSpec(entrypoint="python train.py", working_dir=code_dir, launcher="torchrun"),
        job_id,
        META,
    )
    assert wait_terminal(backend, job_id).state is JobState.SUCCEEDED
    script = api.get(TRAIN_JOB, job_id)["spec"]["trainer"]["command"][2]
    assert "NODE_RANK" in script and ".done" in script, "rank 0 unpacks, the others wait"
    shared = sim.workdir / "pvcs" / "default" / claim / "code"
    assert (shared / "train.py").is_file() and list(shared.glob(".prefect-nemo-*.done"))


def test_namespaced_runtime(server, sim, api):
    """Without cluster-scoped RBAC: a TrainingRuntime in the job's namespace, same hash name."""
    from prefect_nemo.kube import TRAINING_RUNTIME

    config = TrainerConfig(image="img", namespaced_runtime=True, runtime_prefix=f"ns-{uid()}")
    backend = KubeflowTrainerBackend(api, config)
    job_id = f"nsrt-{uid()}"
    backend.submit(JobSpec(entrypoint="echo namespaced"), job_id, META)
    assert wait_terminal(backend, job_id).state is JobState.SUCCEEDED
    assert api.get(TRAINING_RUNTIME, runtime_name(config), "default") is not None
    assert api.get(CLUSTER_TRAINING_RUNTIME, runtime_name(config)) is None
    ref = api.get(TRAIN_JOB, job_id)["spec"]["runtimeRef"]
    assert ref == {"apiGroup": "trainer.kubeflow.org", "kind": "TrainingRuntime",
                   "name": runtime_name(config)}  # fmt: skip


def test_submit_that_died_half_way_is_repaired(server, api, code_dir):
    """A submit that died after its Secret/ConfigMaps (no TrainJob yet) leaves them to be reused
    or replaced; one that died after the TrainJob, before taking ownership, is adopted on
    attach, so deleting the TrainJob still takes them along."""
    backend = KubeflowTrainerBackend(api, CPU)
    spec = JobSpec(entrypoint="python train.py", working_dir=code_dir, launcher="torchrun",
                   env={"TOKEN": SecretStr("new-value")})  # fmt: skip
    job_id = f"crash-{uid()}"
    stale = secret_manifest(
        JobSpec(entrypoint="x", env={"TOKEN": SecretStr("old-value")}), job_id,
        namespace="default", flow_run_id=None,
    )  # fmt: skip
    api.create(SECRET, stale)  # left by the first, dead submit
    backend.submit(spec, job_id, META)
    secret = api.get(SECRET, f"{job_id}-env")
    assert base64.b64decode(secret["data"]["TOKEN"]) == b"new-value"
    tj = api.get(TRAIN_JOB, job_id)
    # simulate the crash between create and adopt: drop the owner references again
    owned = [(SECRET, f"{job_id}-env")] + [
        (CONFIGMAP, c["metadata"]["name"]) for c in api.list(CONFIGMAP)[0]
        if c["metadata"]["name"].startswith(job_id)
    ]  # fmt: skip
    for kind, name in owned:
        api.patch(kind, name, {"metadata": {"ownerReferences": None}})
    with pytest.raises(JobAlreadyExists):
        backend.submit(spec, job_id, META)
    for kind, name in owned:
        refs = api.get(kind, name)["metadata"]["ownerReferences"]
        assert [r["uid"] for r in refs] == [tj["metadata"]["uid"]], name


def test_a_refused_trainjob_leaves_no_secret_or_configmap(server, api, code_dir):
    from prefect_nemo import AuthenticationFailed

    backend = KubeflowTrainerBackend(api, CPU)
    job_id = f"refused-{uid()}"
    spec = JobSpec(entrypoint="python train.py", working_dir=code_dir, launcher="torchrun",
                   env={"TOKEN": SecretStr("v" * 10)})  # fmt: skip
    server.forbid("create", "trainjobs", "trainer.kubeflow.org")
    try:
        with pytest.raises(AuthenticationFailed, match="RBAC"):
            backend.submit(spec, job_id, META)
    finally:
        server.allow("create", "trainjobs", "trainer.kubeflow.org")
    assert api.get(SECRET, f"{job_id}-env") is None
    assert not [c for c in api.list(CONFIGMAP)[0] if c["metadata"]["name"].startswith(job_id)]


# ---------------------------------------------------------------------------------------------
# Shared runtimes: removed once no TrainJob uses them, never while one does (issue 14 item 6)


def _runtimes(api: KubeApi, prefix: str) -> set[str]:
    items, _ = api.list(CLUSTER_TRAINING_RUNTIME, label_selector=f"{RUNTIME_PREFIX_LABEL}={prefix}")
    return {o["metadata"]["name"] for o in items if not o["metadata"].get("deletionTimestamp")}


def test_unused_runtimes_go_never_while_a_trainjob_uses_them(server, api):
    """Kubeflow Trainer's `trainer.kubeflow.org/resource-in-use` finalizer kept a runtime while
    "TrainJobs ... with TrainJobRuntimeRefKey: runtime.Name" existed and let it go once none
    did. Our runtimes (labelled with the block's prefix) follow that rule: a runtime a TrainJob
    references stays; one no TrainJob references is removed at the next submit of its prefix
    or by cleanup(); runtimes of another prefix, or not ours, are never touched."""
    prefix = f"gc-{uid()}"
    old_cfg = TrainerConfig(image="python:3.11-slim", runtime_prefix=prefix)
    new_cfg = TrainerConfig(image="python:3.12-slim", runtime_prefix=prefix)
    other = TrainerConfig(image="python:3.11-slim", runtime_prefix=f"other-{uid()}")
    old_job, new_job = f"old-{uid()}", f"new-{uid()}"
    KubeflowTrainerBackend(api, old_cfg).submit(JobSpec(entrypoint="true"), old_job, META)
    KubeflowTrainerBackend(api, other).submit(JobSpec(entrypoint="true"), f"o-{uid()}", META)
    fresh = KubeflowTrainerBackend(api, new_cfg, runtime_idle_s=0)
    fresh.submit(JobSpec(entrypoint="true"), new_job, META)
    assert _runtimes(api, prefix) == {runtime_name(old_cfg), runtime_name(new_cfg)}, (
        "the old config's runtime is still used by its TrainJob: kept"
    )
    assert fresh.cleanup(idle_s=0) == []
    api.delete(TRAIN_JOB, old_job, "default")  # no TrainJob uses the old runtime any more
    wait_for(api, TRAIN_JOB, old_job, lambda o: o is None, timeout_s=10)
    assert fresh.cleanup(idle_s=0) == [f"ClusterTrainingRuntime/{runtime_name(old_cfg)}"]
    assert _runtimes(api, prefix) == {runtime_name(new_cfg)}, "in use by new_job: kept"
    assert _runtimes(api, other.runtime_prefix) == {runtime_name(other)}, "not this prefix"
    # the automatic path: the next submit of the prefix removes what no TrainJob uses
    api.delete(TRAIN_JOB, new_job, "default")
    wait_for(api, TRAIN_JOB, new_job, lambda o: o is None, timeout_s=10)
    KubeflowTrainerBackend(api, old_cfg, runtime_idle_s=0).submit(
        JobSpec(entrypoint="true"), f"again-{uid()}", META
    )
    assert _runtimes(api, prefix) == {runtime_name(old_cfg)}


def test_a_runtime_taken_recently_is_kept(server, api):
    """A submit takes the runtime before it creates its TrainJob: within `idle_s` of being
    taken (created, or stamped `prefect-nemo.io/last-used` when attached to) a runtime no
    TrainJob references yet is kept, so a concurrent submit never loses its runtime."""
    from prefect_nemo.blocks import KubeflowTrainerCluster
    from prefect_nemo.blocks.kubernetes import KubernetesCluster

    prefix = f"busy-{uid()}"
    block = KubeflowTrainerCluster(
        kubernetes=KubernetesCluster(kubeconfig=server.kubeconfig()), image="python:3.11-slim",
        runtime_prefix=prefix,
    )  # fmt: skip
    job = f"busy-{uid()}"
    block.backend().submit(JobSpec(entrypoint="true"), job, META)
    api.delete(TRAIN_JOB, job, "default")
    wait_for(api, TRAIN_JOB, job, lambda o: o is None, timeout_s=10)
    assert block.cleanup() == [], "taken moments ago: kept (prefect-nemo cleanup calls this)"
    assert _runtimes(api, prefix) == {runtime_name(block.backend().config)}
    block.backend().submit(JobSpec(entrypoint="true"), f"busy2-{uid()}", META)  # attaches
    taken = api.get(CLUSTER_TRAINING_RUNTIME, runtime_name(block.backend().config))
    assert taken["metadata"]["annotations"][LAST_USED]


def test_pip_index_options_reach_the_pods_and_nothing_we_write(server, sim, api, tmp_path):
    """pip reads its options from the environment "using the format PIP_<UPPER_LONG_NAME>"
    (dashes as underscores; repeated options as a whitespace-separated list): the block's
    index URL, extra index URLs and trusted hosts reach every node as PIP_INDEX_URL,
    PIP_EXTRA_INDEX_URL and PIP_TRUSTED_HOST; the URLs (they may hold a token) only through
    the job's Secret, never in the TrainJob, and masked in a dry run."""
    token = f"tok{uuid.uuid4().hex}"
    index = f"https://ci:{token}@pypi.internal.example/simple"
    extra = ["https://mirror-a.example/simple", f"https://u:{token}@mirror-b.example/simple"]
    hosts = ("pypi.internal.example", "mirror-a.example:8080")
    config = TrainerConfig(
        image="python:3.11-slim", pip_index_url=index, pip_extra_index_urls=tuple(extra),
        pip_trusted_hosts=hosts,
    )  # fmt: skip
    (tmp_path / "show.py").write_text(
        "import os\nfor k in ('PIP_INDEX_URL', 'PIP_EXTRA_INDEX_URL', 'PIP_TRUSTED_HOST'):\n"
        "    print(k, '=', os.environ[k], flush=True)\n"
    )
    backend = KubeflowTrainerBackend(api, config)
    spec = JobSpec(entrypoint="python show.py", working_dir=tmp_path)
    job_id = f"pip-{uid()}"
    backend.submit(spec, job_id, META)
    assert wait_terminal(backend, job_id).state is JobState.SUCCEEDED
    log = backend.logs(job_id)
    assert f"PIP_INDEX_URL = {index}" in log
    assert f"PIP_EXTRA_INDEX_URL = {' '.join(extra)}" in log
    assert "PIP_TRUSTED_HOST = pypi.internal.example mirror-a.example:8080" in log
    trainjob = server.get("trainjobs", "default", job_id, **TRAINER_API)
    assert token not in json.dumps(trainjob), "the URLs travel by secretKeyRef only"
    assert set(backend.secrets) >= {index, *extra}, "masked wherever we write"
    with pytest.raises(InvalidJobSpec, match="pip_index_url: not an http"):
        TrainerConfig(image="i", pip_index_url="pypi.internal.example/simple")
    with pytest.raises(InvalidJobSpec, match="pip_trusted_hosts"):
        TrainerConfig(image="i", pip_trusted_hosts=("https://x",))
