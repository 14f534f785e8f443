"""KubeRay backend: manifests, status mapping and validation (fast), and run_job end to end
against the loopback API server (strict CRD validation), the KubeRay simulator and a real Ray."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prefect import flow  # at import time: Prefect configures logging when `flow` is first imported
from pydantic import SecretStr

from prefect_nemo import InvalidJobSpec, JobSpec, JobState, Resources
from prefect_nemo.backends.kuberay import (
    MAX_RAYJOB_NAME,
    KubeRayBackend,
    RayJobConfig,
    ensure_ray_cluster,
    label_value,
    ray_cluster_manifest,
    rayjob_manifest,
    resolve_ray_cluster_name,
    secret_manifest,
    status_from_rayjob,
    wait_ray_cluster_ready,
)
from prefect_nemo.backends.kuberay.manifests import runtime_env_yaml
from prefect_nemo.kube import CONFIGMAP, POD, RAY_CLUSTER, RAY_JOB, SECRET
from prefect_nemo.lifecycle import META_FLOW_RUN, META_KEY, META_SPEC

RAY_IMAGE = "rayproject/ray:2.60.0"


def cluster_spec(workers: int = 1) -> dict[str, Any]:
    """A small but complete rayClusterSpec (head + one worker group)."""
    return {
        "rayVersion": "2.60.0",
        "headGroupSpec": {
            "rayStartParams": {"dashboard-host": "0.0.0.0"},
            "template": {"spec": {"containers": [{"name": "ray-head", "image": RAY_IMAGE}]}},
        },
        "workerGroupSpecs": [
            {
                "groupName": "workers",
                "replicas": workers,
                "minReplicas": workers,
                "maxReplicas": workers,
                "rayStartParams": {},
                "template": {"spec": {"containers": [{"name": "ray-worker", "image": RAY_IMAGE}]}},
            }
        ],
    }


INLINE = RayJobConfig(ray_cluster_spec=cluster_spec(), ttl_seconds_after_finished=0)
SELECTOR = RayJobConfig(ray_cluster_name="shared")
META = {META_KEY: "experiment:x/step", META_SPEC: "abc123", META_FLOW_RUN: "run-1"}


# ---------------------------------------------------------------------------------------------
# Pure: manifests, status mapping, validation


def test_inline_manifest_carries_everything_but_secrets():
    spec = JobSpec(
        entrypoint="python train.py",
        env={"PLAIN": "1", "TOKEN": SecretStr("hunter2-secret")},
        resources=Resources(cpus=1, gpus=0.5, custom={"slot": 1}),
        labels={"team": "rl team/ü"},
        metadata={"owner": "me"},
        runtime_env={"pip": ["numpy"]},
    )
    m = rayjob_manifest(spec, "job-abc", META, INLINE, namespace="ns")
    assert "hunter2-secret" not in json.dumps(m)
    assert m["metadata"]["name"] == "job-abc" and m["metadata"]["namespace"] == "ns"
    labels = m["metadata"]["labels"]
    assert labels["app.kubernetes.io/managed-by"] == "prefect-nemo"
    assert labels["prefect.io/flow-run-id"] == "run-1"
    assert labels["team"] == "rl-team"  # sanitised label value
    assert m["metadata"]["annotations"]["prefect-nemo.io/spec"] == "abc123"
    body = m["spec"]
    assert body["jobId"] == "job-abc"
    assert body["metadata"] == {"owner": "me", **META}
    env = yaml.safe_load(body["runtimeEnvYAML"])
    assert env == {
        "pip": ["numpy"],
        "env_vars": {"PLAIN": "1", "RAY_OVERRIDE_JOB_RUNTIME_ENV": "1"},
    }
    assert (body["entrypointNumCpus"], body["entrypointNumGpus"]) == (1, 0.5)
    assert json.loads(body["entrypointResources"]) == {"slot": 1}
    assert body["shutdownAfterJobFinishes"] is True and body["ttlSecondsAfterFinished"] == 0
    assert body["submissionMode"] == "K8sJobMode"
    assert "clusterSelector" not in body and "activeDeadlineSeconds" not in body
    ref = {"secretRef": {"name": "job-abc-env"}}
    head = body["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    worker = body["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    assert head["envFrom"] == [ref] and worker["envFrom"] == [ref]
    assert "envFrom" not in INLINE.ray_cluster_spec["headGroupSpec"]["template"]["spec"][
        "containers"][0], "the block's spec is not mutated"  # fmt: skip

    secret = secret_manifest(spec, "job-abc", namespace="ns", flow_run_id="run-1")
    assert secret is not None and secret["stringData"] == {"TOKEN": "hunter2-secret"}
    assert secret["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "prefect-nemo"
    assert (
        secret_manifest(JobSpec(entrypoint="true"), "j", namespace="ns", flow_run_id=None) is None
    )


def test_runtime_env_yaml_is_the_text_pyyamls_own_dumper_writes():
    """runtimeEnvYAML comes from libyaml's emitter (speed); an upgrade must not change the
    text of the same env (a rerun compares what it would create with what exists)."""
    env = {
        "env_vars": {"A": "é█ ünï", "LONG": "x " * 100, "MULTI": "one\ntwo\n", "YES": "yes",
                     "ZERO": "012", "EMPTY": "", "COLON": "a: b # c", "TAB": "\t tab"},
        "pip": ["torch==2.5", "numpy"],
        "config": {"setup_timeout_seconds": 600, "eager": True, "ratio": 2.5, "none": None},
    }  # fmt: skip
    assert runtime_env_yaml(env) == yaml.safe_dump(env, sort_keys=True)


def test_selector_manifest_has_no_shutdown():
    m = rayjob_manifest(JobSpec(entrypoint="true"), "job-abc", META, SELECTOR, namespace="ns")
    body = m["spec"]
    assert body["clusterSelector"] == {"ray.io/cluster": "shared"}
    assert "rayClusterSpec" not in body and "shutdownAfterJobFinishes" not in body
    assert "ttlSecondsAfterFinished" not in body
    no_shutdown = RayJobConfig(ray_cluster_spec=cluster_spec(), shutdown_after_job_finishes=False)
    body = rayjob_manifest(JobSpec(entrypoint="true"), "j", {}, no_shutdown, namespace="n")["spec"]
    assert body["shutdownAfterJobFinishes"] is False and "ttlSecondsAfterFinished" not in body


def _rj(deployment: str = "", job: str = "", **status: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": "rj", "annotations": {"prefect-nemo.io/key": "k"}},
        # a suspended RayJob says so in its spec too (unsuspended, KubeRay resumes it: PENDING)
        "spec": {"metadata": {"owner": "me"}, "suspend": deployment.startswith("Suspend")},
        "status": {"jobDeploymentStatus": deployment, "jobStatus": job, **status},
    }


@pytest.mark.parametrize(
    ("deployment", "job", "state"),
    [
        ("", "", JobState.PENDING),
        ("Initializing", "", JobState.PENDING),
        ("Waiting", "", JobState.PENDING),
        ("Retrying", "FAILED", JobState.PENDING),
        ("Running", "", JobState.PENDING),
        ("Running", "PENDING", JobState.PENDING),
        ("Running", "RUNNING", JobState.RUNNING),
        ("Running", "SUCCEEDED", JobState.SUCCEEDED),
        ("Complete", "SUCCEEDED", JobState.SUCCEEDED),
        ("Complete", "STOPPED", JobState.STOPPED),
        ("Complete", "RUNNING", JobState.FAILED),
        ("Failed", "FAILED", JobState.FAILED),
        ("Failed", "STOPPED", JobState.STOPPED),
        ("Failed", "RUNNING", JobState.FAILED),
        ("Suspending", "RUNNING", JobState.STOPPED),
        ("Suspended", "", JobState.STOPPED),
        ("ValidationFailed", "", JobState.FAILED),
    ],
)
def test_state_mapping(deployment: str, job: str, state: JobState):
    assert status_from_rayjob(_rj(deployment, job)).state is state


def test_status_messages_times_and_metadata():
    rejected = status_from_rayjob(_rj("ValidationFailed", message="name too long"))
    assert rejected.message == "KubeRay rejected RayJob rj: name too long"
    deadline = status_from_rayjob(
        _rj("Failed", "RUNNING", reason="DeadlineExceeded", message="passed the deadline")
    )
    assert deadline.message == "DeadlineExceeded: passed the deadline"
    failed = status_from_rayjob(
        _rj("Failed", "FAILED", reason="AppFailed", message="failed with exit code 7, logs: x",
            startTime="2026-01-01T00:00:00Z", endTime="2026-01-01T00:00:05Z")
    )  # fmt: skip
    assert failed.exit_code == 7
    assert failed.end_time is not None and failed.start_time is not None
    assert (failed.end_time - failed.start_time).total_seconds() == 5
    assert failed.metadata == {"owner": "me", "prefect_nemo.key": "k"}


# what the jobs of issue 27 ship: a module the entrypoint imports, which reports what it saw
MYMOD = """import hashlib, os


def main():
    seen = hashlib.sha256(os.environ.get("API_KEY", "").encode()).hexdigest()
    print("mymod ran, secret sha256 " + seen, flush=True)
"""
MYMOD_ENTRYPOINT = "python -c 'import mymod; mymod.main()'"


def mymod_dir(root: Path) -> Path:
    """A working_dir with `mymod.py` (and a file left out by .gitignore-style exclude)."""
    code = root / "code"
    code.mkdir()
    (code / "mymod.py").write_text(MYMOD)
    return code


def secret_seen(secret: str) -> str:
    """The line mymod prints when the job saw `secret` (its hash: the value is never printed)."""
    return "mymod ran, secret sha256 " + hashlib.sha256(secret.encode()).hexdigest()


def test_inline_working_dir_rides_on_the_submitter_pod(tmp_path):
    """Issue 27: local code and a secret env value go together to an inline cluster. KubeRay's
    K8sJobMode submitter runs `ray job submit --runtime-env-json <runtimeEnvYAML as JSON>`
    (common/job.go BuildJobSubmitCommand) from `spec.submitterPodTemplate` when given
    (GetSubmitterTemplate), filling in the command of its first container when it has none
    (configureSubmitterContainer); Ray's CLI uploads a local working_dir itself. So: an init
    container unpacks our ConfigMaps into an emptyDir the submitter mounts at working_dir."""
    from prefect_nemo.backends.kuberay.manifests import CODE_DIR, SUBMITTER, SUBMITTER_RESOURCES

    spec_ = cluster_spec()
    spec_["headGroupSpec"]["template"]["spec"]["imagePullSecrets"] = [{"name": "registry"}]
    config = RayJobConfig(ray_cluster_spec=spec_)
    job = JobSpec(entrypoint=MYMOD_ENTRYPOINT, working_dir=mymod_dir(tmp_path),
                  env={"API_KEY": SecretStr("hunter2-secret")})  # fmt: skip
    backend = KubeRayBackend(_NoApi(), config)  # type: ignore[arg-type]
    backend.validate(job)
    *owned, rayjob = backend.render(job, "job-abc", META)
    assert [d["kind"] for d in owned] == ["Secret", "ConfigMap"]
    cm = owned[1]
    assert cm["immutable"] is True and cm["metadata"]["namespace"] == "default"
    assert cm["metadata"]["labels"]["prefect.io/flow-run-id"] == "run-1"
    assert json.loads(rayjob["metadata"]["annotations"]["prefect-nemo.io/owned-objects"]) == {
        "secrets": ["job-abc-env"], "configmaps": [cm["metadata"]["name"]]}  # fmt: skip
    body = rayjob["spec"]
    assert yaml.safe_load(body["runtimeEnvYAML"])["working_dir"] == CODE_DIR
    pod = body["submitterPodTemplate"]["spec"]
    assert pod["restartPolicy"] == "Never" and pod["imagePullSecrets"] == [{"name": "registry"}]
    (init,), (submitter,) = pod["initContainers"], pod["containers"]
    assert submitter["name"] == SUBMITTER and "command" not in submitter, "KubeRay fills it in"
    assert submitter["image"] == init["image"] == RAY_IMAGE, "the head's image"
    assert submitter["resources"] == SUBMITTER_RESOURCES
    assert {m["mountPath"] for m in submitter["volumeMounts"]} == {CODE_DIR}
    assert f"tar -xzf - -C {CODE_DIR}" in init["command"][-1]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounted = {m["name"] for m in init["volumeMounts"]}
    assert mounted == set(volumes), "the init container sees the parts and the emptyDir"
    sources = next(v for v in volumes.values() if "projected" in v)["projected"]["sources"]
    assert [s["configMap"]["name"] for s in sources] == [cm["metadata"]["name"]]
    head = body["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert head["envFrom"] == [{"secretRef": {"name": "job-abc-env"}}], "the secret: the Secret"
    assert "hunter2-secret" not in json.dumps([rayjob, cm])


def test_inline_code_too_large_for_configmaps_is_refused_before_any_request(tmp_path):
    """The ConfigMaps' ceiling (packaging's 8 MiB of archive) is checked by validate."""
    from prefect_nemo.packaging import TransportTooLarge

    package = tmp_path / "code" / "pkg"  # a package ships whole (packaging.build_archive)
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "weights.bin").write_bytes(os.urandom(9 * 1024 * 1024))  # does not compress
    backend = KubeRayBackend(_NoApi(), INLINE)  # type: ignore[arg-type]
    with pytest.raises(TransportTooLarge, match=r"weights\.bin.*exclude="):
        backend.validate(JobSpec(entrypoint="python x.py", working_dir=package.parent))


@pytest.mark.parametrize("mode", ["HTTPMode", "SidecarMode"])
def test_inline_working_dir_needs_the_k8sjobmode_submitter(mode: str, tmp_path):
    """HTTPMode has no submitter pod (the operator posts the job), and KubeRay refuses a
    submitterPodTemplate in SidecarMode (utils/validation.go): the error names the field and
    the fix before anything is sent."""
    config = RayJobConfig(ray_cluster_spec=cluster_spec(), submission_mode=mode)
    backend = KubeRayBackend(_NoApi(), config)  # type: ignore[arg-type]
    with pytest.raises(InvalidJobSpec) as info:
        backend.validate(JobSpec(entrypoint="x", working_dir=mymod_dir(tmp_path)))
    text = str(info.value)
    assert text.startswith("JobSpec.working_dir:") and f"submission_mode='{mode}'" in text
    assert "use submission_mode='K8sJobMode'" in text and "ray_cluster_name" in text
    imageless = cluster_spec()
    del imageless["headGroupSpec"]["template"]["spec"]["containers"][0]["image"]
    backend = KubeRayBackend(_NoApi(), RayJobConfig(ray_cluster_spec=imageless))  # type: ignore[arg-type]
    with pytest.raises(InvalidJobSpec, match=r"containers\[0\]\.image: needed with working_dir"):
        backend.validate(JobSpec(entrypoint="x", working_dir=tmp_path / "code"))


def test_bad_specs_name_the_field_and_the_fix():
    cases = [
        (JobSpec(entrypoint="x", resources=Resources(memory_bytes=1)), INLINE, "memory_bytes"),
        (JobSpec(entrypoint="x", label_selector={"a": "b"}), INLINE, "label_selector"),
        (JobSpec(entrypoint="x", env={"K": SecretStr("v")}), SELECTOR, "Kubernetes Secret"),
        (JobSpec(entrypoint="x", working_dir=Path(".")),
         RayJobConfig(ray_cluster_spec=cluster_spec(), submission_mode="HTTPMode"),
         "submission_mode='K8sJobMode'"),
        (JobSpec(entrypoint="x", labels={"bad key!": "v"}), INLINE, "JobSpec.labels"),
        (JobSpec(entrypoint="x", labels={"prefect.io/flow-run-id": "v"}), INLINE, "set by"),
        (JobSpec(entrypoint="x", runtime_env={"x": object()}), INLINE, "runtime_env"),
        (JobSpec(entrypoint="x" * 90_000, env={f"E{i}": "y" * 9_000 for i in range(200)}),
         INLINE, "under ~1 MB"),
    ]  # fmt: skip
    for spec, config, needle in cases:
        backend = KubeRayBackend(_NoApi(), config)  # type: ignore[arg-type]
        with pytest.raises(InvalidJobSpec) as info:
            backend.validate(spec)
        assert needle in str(info.value), (needle, str(info.value))


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({}, "exactly one of ray_cluster_name"),
        ({"ray_cluster_name": "a", "ray_cluster_spec": cluster_spec()}, "exactly one"),
        ({"ray_cluster_name": "Bad_Name"}, "ray_cluster_name"),
        ({"ray_cluster_name": "a", "submission_mode": "SidecarMode"}, "SidecarMode"),
        ({"ray_cluster_spec": {"workerGroupSpecs": []}}, "headGroupSpec"),
        ({"ray_cluster_spec": {"kind": "RayCluster", "spec": {}}}, "`spec` only"),
        ({"ray_cluster_spec": {"headGroupSpec": {"template": {}}}}, "containers"),
    ],
)
def test_bad_configs_name_the_field(kwargs: dict[str, Any], needle: str):
    with pytest.raises(InvalidJobSpec, match="KubeRayCluster") as info:
        RayJobConfig(**kwargs)
    assert needle in str(info.value)


def test_block_validator_and_job_ids():
    from prefect_nemo import names
    from prefect_nemo.blocks import KubeRayCluster
    from prefect_nemo.blocks.kubernetes import KubernetesCluster

    kube = KubernetesCluster(kubeconfig={"apiVersion": "v1"})
    with pytest.raises(ValueError, match="exactly one of ray_cluster_name"):
        KubeRayCluster(kubernetes=kube)
    block = KubeRayCluster(kubernetes=kube, ray_cluster_name="shared")
    assert all(f.description for f in type(block).model_fields.values())
    assert KubeRayBackend.max_job_id_len == MAX_RAYJOB_NAME
    long = names.job_id("s", "k" * 80, readable="e" * 80, attempt=42, max_len=MAX_RAYJOB_NAME)
    assert len(long) <= MAX_RAYJOB_NAME and long[0].isalpha()
    assert label_value("-Hello World_") == "Hello-World"


class _NoApi:
    """A KubeApi stand-in that fails on any use: validation must not touch the API."""

    namespace = "default"
    host = "http://nowhere"
    secrets: list[str] = []

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"validation called the API ({name})")


# ---------------------------------------------------------------------------------------------
# End to end: loopback API server + KubeRay simulator + real Ray + real Prefect API


@pytest.fixture(scope="module")
def shared_cluster(kube_block: Any, kuberay: Any) -> str:
    """An existing RayCluster 'shared' (created and waited for with our lifecycle helpers)."""
    api = kube_block.api()
    applied = ensure_ray_cluster(api, cluster_spec(), "shared")
    assert applied.outcome == "created"
    assert ensure_ray_cluster(api, cluster_spec(), "shared").outcome == "attached"
    wait_ray_cluster_ready(api, "shared", timeout_s=30)
    return "shared"


def inline_block(kube_block: Any, ray_head: Any, **kw: Any) -> Any:
    from prefect_nemo.blocks import KubeRayCluster

    kw.setdefault("ray_cluster_spec", cluster_spec())
    # a few seconds of TTL: the job's log stays readable through its head until we have read it
    kw.setdefault("ttl_seconds_after_finished", 2)
    return KubeRayCluster(kubernetes=kube_block, ray_token=ray_head.token, **kw)


def rayjobs(server: Any) -> dict[str, dict[str, Any]]:
    api = server.api_client()
    from prefect_nemo.kube import KubeApi

    items, _ = KubeApi(api).list(RAY_JOB)
    return {o["metadata"]["name"]: o for o in items}


def rayclusters_of(kube_block: Any, job_id: str) -> list[str]:
    items, _ = kube_block.api().list(RAY_CLUSTER)
    return [o["metadata"]["name"] for o in items if o["metadata"]["name"].startswith(job_id)]


@pytest.fixture
def run_logs() -> Iterator[list[str]]:
    """Messages of Prefect's run loggers during the test (independent of pytest's capture,
    which Prefect's console handler outlives between tests)."""
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


def wait_until(predicate: Any, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def test_missing_kuberay_crds_and_cluster_are_named():
    """check_access says what to install, or which RayCluster is missing, before any submit."""
    from prefect_nemo import BackendUnavailable
    from prefect_nemo.blocks import KubeRayCluster
    from prefect_nemo.blocks.kubernetes import KubernetesCluster
    from prefect_nemo.testing.kube_api import LoopbackKubeServer, crd_dir

    with LoopbackKubeServer() as bare:
        kube = KubernetesCluster(kubeconfig=bare.kubeconfig())
        backend = KubeRayCluster(kubernetes=kube, ray_cluster_spec=cluster_spec()).backend()
        with pytest.raises(BackendUnavailable, match="install the KubeRay operator"):
            backend.check_access()
    with LoopbackKubeServer(crds=[crd_dir()]) as server:
        kube = KubernetesCluster(kubeconfig=server.kubeconfig())
        backend = KubeRayCluster(kubernetes=kube, ray_cluster_name="nope").backend()
        with pytest.raises(InvalidJobSpec, match="no RayCluster 'nope' in namespace 'default'"):
            backend.check_access()
        assert server.requests.count("POST") == 0


@pytest.mark.slow
def test_run_job_inline_cluster_success(kube_server, kuberay, kube_block, ray_head, prefect_api,
                                        run_logs):  # fmt: skip
    """Logs come back through the proxy; the secret stays out of the RayJob, Ray and the logs;
    the job's cluster is gone afterwards."""
    from prefect_nemo import run_job

    secret = f"s3cret-{uuid.uuid4().hex}"
    block = inline_block(kube_block, ray_head)

    @flow
    def ok_flow():
        spec = JobSpec(entrypoint="echo hello-kuberay", name="hello",
                       env={"API_KEY": SecretStr(secret), "MODE": "plain"})  # fmt: skip
        return run_job(spec, cluster=block)

    result = ok_flow()
    job_id = result.handle.job_id
    assert result.state is JobState.SUCCEEDED
    assert len(job_id) <= MAX_RAYJOB_NAME
    logged = "\n".join(run_logs)
    assert "hello-kuberay" in logged  # the log came back through the service proxy
    assert result.handle.links["rayjob"].endswith(f"/rayjobs/{job_id}")

    rj = kube_server.get("rayjobs", "default", job_id, group="ray.io")
    assert secret not in json.dumps(rj) and secret not in logged
    assert "API_KEY" not in rj["spec"]["runtimeEnvYAML"] and "MODE" in rj["spec"]["runtimeEnvYAML"]
    stored = kube_server.get("secrets", "default", f"{job_id}-env")
    assert stored["metadata"]["ownerReferences"][0]["uid"] == rj["metadata"]["uid"]
    assert secret not in json.dumps(
        ray_head.block().backend().client.get_job_info(job_id).runtime_env
    )
    assert rj["status"]["rayClusterName"].startswith(f"{job_id}-")
    assert resolve_ray_cluster_name(kube_block.api(), job_id, timeout_s=5) == rj["status"][
        "rayClusterName"]  # fmt: skip
    assert wait_until(lambda: not rayclusters_of(kube_block, job_id)), "the job's cluster remains"


# As a user writes it in YAML: quantities as plain integers (int-or-string in the CRD).
GPU_CLUSTER_YAML = f"""
rayVersion: "2.60.0"
headGroupSpec:
  rayStartParams: {{}}
  template:
    spec:
      containers:
      - name: ray-head
        image: {RAY_IMAGE}
        resources:
          limits: {{cpu: 4, memory: 16Gi}}
workerGroupSpecs:
- groupName: gpus
  replicas: 1
  minReplicas: 1
  maxReplicas: 1
  rayStartParams: {{}}
  template:
    spec:
      containers:
      - name: ray-worker
        image: {RAY_IMAGE}
        resources:
          limits: {{cpu: 8, nvidia.com/gpu: 8}}
          requests: {{cpu: 8, nvidia.com/gpu: 8}}
"""


@pytest.mark.slow
def test_integer_quantities_from_yaml_run_to_succeeded(kube_server, kuberay, kube_block,
                                                       ray_head, prefect_api):  # fmt: skip
    """`nvidia.com/gpu: 8` and `cpu: 8` as YAML writes them, integers: the API server keeps
    them in the RayJob's cluster spec (int-or-string), the operator makes pods of them (a
    typed Pod says "8"), and the job runs to SUCCEEDED (the simulator's pod creation used to
    fail on them, the job PENDING until its timeout)."""
    from prefect_nemo import run_job

    spec = yaml.safe_load(GPU_CLUSTER_YAML)
    block = inline_block(kube_block, ray_head, ray_cluster_spec=spec)

    @flow
    def gpu_flow():
        return run_job(JobSpec(entrypoint="echo on-gpus", name="gpus", timeout_s=120),
                       cluster=block)  # fmt: skip

    result = gpu_flow()
    assert result.state is JobState.SUCCEEDED
    rj = kube_server.get("rayjobs", "default", result.handle.job_id, group="ray.io")
    worker = rj["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]
    assert worker["containers"][0]["resources"]["limits"] == {"cpu": 8, "nvidia.com/gpu": 8}


@pytest.mark.slow
def test_run_job_failure_has_log_tail(kuberay, kube_block, ray_head, prefect_api):
    from prefect_nemo import JobFailed, run_job

    block = inline_block(kube_block, ray_head)

    @flow
    def failing_flow():
        run_job(JobSpec(entrypoint="echo about-to-fail; exit 7", name="boom"), cluster=block)

    with pytest.raises(JobFailed) as info:
        failing_flow()
    assert "about-to-fail" in str(info.value)
    assert info.value.result.exit_code == 7


@pytest.mark.slow
def test_validation_failed_is_surfaced(kube_server, kuberay, kube_block, ray_head, prefect_api):
    """A RayJob KubeRay refuses (here: suspend without shutdown, created by hand) fails the wait
    with KubeRay's reason."""
    from prefect_nemo import JobFailed, wait_for_job

    block = inline_block(kube_block, ray_head)
    backend = block.backend()
    name = f"hand-{uuid.uuid4().hex[:8]}"
    manifest = rayjob_manifest(JobSpec(entrypoint="true"), name, {}, INLINE, namespace="default")
    manifest["spec"].update(shutdownAfterJobFinishes=False, suspend=True)
    del manifest["spec"]["ttlSecondsAfterFinished"]
    kube_block.api().create(RAY_JOB, manifest)

    @flow
    def wait_flow():
        return wait_for_job(backend.handle(name), cluster=block, stream_logs=False)

    with pytest.raises(JobFailed, match=f"KubeRay rejected RayJob {name}: .*suspended"):
        wait_flow()


@pytest.mark.slow
def test_rerun_attaches_to_the_same_rayjob(kube_server, kuberay, kube_block, ray_head,
                                           prefect_api):  # fmt: skip
    from prefect_nemo import run_job, start_experiment

    experiment = f"kr-{uuid.uuid4().hex[:6]}"
    block = inline_block(kube_block, ray_head, ttl_seconds_after_finished=30)

    @flow
    def exp_flow():
        start_experiment(experiment)
        return run_job(JobSpec(entrypoint="echo once", name="step"), cluster=block)

    first, second = exp_flow(), exp_flow()
    assert second.attached and second.handle.job_id == first.handle.job_id
    assert [n for n in rayjobs(kube_server) if n.startswith(experiment)] == [first.handle.job_id]


@pytest.mark.slow
def test_timeout_stops_the_ray_job_and_leaves_no_cluster(kuberay, kube_block, ray_head,
                                                         prefect_api):  # fmt: skip
    from prefect_nemo import JobTimedOut, run_job

    block = inline_block(kube_block, ray_head)

    @flow
    def slow_flow():
        run_job(JobSpec(entrypoint="sleep 60", name="sleepy", timeout_s=3), cluster=block)

    with pytest.raises(JobTimedOut) as info:
        slow_flow()
    job_id = info.value.result.handle.job_id
    assert info.value.result.state is JobState.STOPPED
    assert ray_head.block().backend().client.get_job_status(job_id).value == "STOPPED"
    assert wait_until(lambda: not rayclusters_of(kube_block, job_id)), "the job's cluster remains"


@pytest.mark.slow
def test_cancelling_the_run_stops_the_job_and_its_cluster(
    kube_server, kuberay, kube_block, ray_head, prefect_api
):
    """A run cancelled through the API (no runner to signal it): the Ray job is stopped through
    the proxy, and KubeRay then tears the job's cluster down."""
    import contextvars
    import threading

    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    from prefect_nemo import run_job

    block = inline_block(kube_block, ray_head)
    name = f"cancel-{uuid.uuid4().hex[:6]}"

    @flow
    def long_flow():
        run_job(JobSpec(entrypoint="sleep 120", name=name), block)

    thread = threading.Thread(
        target=contextvars.copy_context().run, args=(lambda: long_flow(return_state=True),),
        daemon=True,
    )  # fmt: skip
    thread.start()

    def running() -> dict[str, Any] | None:
        return next((rj for rj in rayjobs(kube_server).values()
                     if (rj["spec"].get("metadata") or {}).get(META_KEY, "").endswith(f"/{name}")
                     and (rj.get("status") or {}).get("jobStatus") == "RUNNING"), None)  # fmt: skip

    assert wait_until(running, 60), "the job never ran"
    rj = running()
    assert rj is not None
    job_id, run_id = rj["metadata"]["name"], rj["spec"]["metadata"][META_FLOW_RUN]
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(uuid.UUID(run_id), Cancelling(), force=True)
    ray = ray_head.block().backend().client
    assert wait_until(lambda: ray.get_job_status(job_id).value == "STOPPED", 30)
    thread.join(60)
    assert not thread.is_alive(), "the flow must end once its job is stopped"
    assert wait_until(lambda: not rayclusters_of(kube_block, job_id)), "the job's cluster remains"


@pytest.mark.slow
def test_stop_before_submission_deletes_the_rayjob(kube_server, kuberay, kube_block, ray_head):
    """A RayJob waiting for a cluster that never comes is deleted, and reported STOPPED."""
    from prefect_nemo.lifecycle import stop_and_confirm

    backend = KubeRayBackend(kube_block.api(), RayJobConfig(ray_cluster_name="not-there"))
    job_id = f"orphan-{uuid.uuid4().hex[:8]}"
    backend.submit(JobSpec(entrypoint="true"), job_id, META)
    assert backend.find(job_id).state is JobState.PENDING
    status = stop_and_confirm(backend, job_id, timeout_s=15)
    assert status is not None and status.state is JobState.STOPPED
    assert kube_server.get("rayjobs", "default", job_id, group="ray.io") is None


def test_rejected_rayjob_leaves_no_secret():
    """The strict API server refuses an unknown field in ray_cluster_spec: the error names it,
    and the Secret made for the job's secret env is removed again."""
    from prefect_nemo.blocks import KubeRayCluster
    from prefect_nemo.blocks.kubernetes import KubernetesCluster
    from prefect_nemo.testing.kube_api import LoopbackKubeServer, crd_dir

    bad = cluster_spec()
    bad["headGroupSpec"]["bogusField"] = 1
    with LoopbackKubeServer(crds=[crd_dir()]) as server:
        kube = KubernetesCluster(kubeconfig=server.kubeconfig())
        backend = KubeRayCluster(kubernetes=kube, ray_cluster_spec=bad).backend()
        spec = JobSpec(entrypoint="true", env={"TOKEN": SecretStr("s3cret-value")})
        backend.validate(spec)  # nothing we can see locally
        with pytest.raises(InvalidJobSpec, match="bogusField") as info:
            backend.submit(spec, "rejected-job", META)
        assert "ray_cluster_spec" in str(info.value)
        assert server.get("secrets", "default", "rejected-job-env") is None


@pytest.mark.slow
def test_ray_cluster_lifecycle(kube_server, kuberay, kube_block):
    """Create (or attach to) a RayCluster, wait until ready, delete it and wait until gone."""
    from prefect_nemo import PrefectNemoError
    from prefect_nemo.backends.kuberay import delete_ray_cluster, ray_cluster_manifest

    api = kube_block.api()
    name = f"rc-{uuid.uuid4().hex[:6]}"
    assert ensure_ray_cluster(api, cluster_spec(), name, flow_run_id="run-9").created
    ready = wait_ray_cluster_ready(api, name, timeout_s=30)
    assert ready["status"]["state"] == "ready"
    assert ready["metadata"]["labels"]["prefect.io/flow-run-id"] == "run-9"
    manifest = ray_cluster_manifest(cluster_spec(workers=2), name, "default")
    assert ensure_ray_cluster(api, manifest).outcome == "drifted"
    assert delete_ray_cluster(api, name, wait_s=15)
    assert kube_server.get("rayclusters", "default", name, group="ray.io") is None
    assert not delete_ray_cluster(api, name)
    with pytest.raises(PrefectNemoError, match="does not exist"):
        wait_ray_cluster_ready(api, name, timeout_s=5)
    with pytest.raises(InvalidJobSpec, match="name is required"):
        ensure_ray_cluster(api, cluster_spec())


def test_ensure_never_attaches_to_a_raycluster_being_deleted(kube_server, kube_block):
    """A RayCluster with metadata.deletionTimestamp is going away (KubeRay's finalizer tears
    its pods down first): ensure_ray_cluster waits until it is gone and creates a new one
    (nrl-k8s: delete, `wait_for_raycluster_gone`, then create), never attaches to it."""
    import threading

    api = kube_block.api()
    name = f"rc-{uuid.uuid4().hex[:6]}"
    manifest = ray_cluster_manifest(cluster_spec(), name, "default")
    manifest["metadata"]["finalizers"] = ["test.prefect-nemo.io/hold"]
    old = ensure_ray_cluster(api, manifest).obj
    api.delete(RAY_CLUSTER, name, "default")
    assert api.get(RAY_CLUSTER, name, "default")["metadata"]["deletionTimestamp"]
    release = {"metadata": {"finalizers": None}}
    timer = threading.Timer(0.5, lambda: api.patch(RAY_CLUSTER, name, release, "default"))
    timer.start()
    again = ensure_ray_cluster(api, cluster_spec(), name)
    timer.join()
    assert again.outcome == "created" and again.obj["metadata"]["uid"] != old["metadata"]["uid"]
    api.delete(RAY_CLUSTER, name, "default")


@pytest.mark.slow
def test_stop_of_a_job_pending_in_ray_escalates_to_delete(
    kube_server, kuberay, kube_block, ray_head, monkeypatch
):
    """Ray holds a stop of a job that waits for resources; the backend then deletes the RayJob,
    which takes the job's cluster with it."""
    from prefect_nemo.backends.kuberay import rayjob as kuberay_backend
    from prefect_nemo.lifecycle import stop_and_confirm

    monkeypatch.setattr(kuberay_backend, "STOP_ESCALATE_S", 1.0)
    backend = inline_block(kube_block, ray_head).backend()
    job_id = f"starved-{uuid.uuid4().hex[:8]}"
    spec = JobSpec(entrypoint="true", resources=Resources(custom={"no-such-resource": 1}))
    backend.submit(spec, job_id, META)

    def pending_in_ray() -> bool:
        rj = kube_server.get("rayjobs", "default", job_id, group="ray.io") or {}
        return (rj.get("status") or {}).get("jobStatus") == "PENDING"

    assert wait_until(pending_in_ray, 30)
    assert backend.find(job_id).state is JobState.PENDING
    status = stop_and_confirm(backend, job_id, timeout_s=30)
    assert status is not None and status.state is JobState.STOPPED
    assert kube_server.get("rayjobs", "default", job_id, group="ray.io") is None
    assert not rayclusters_of(kube_block, job_id)
    # (the simulator's clusters share one real Ray, where the starved job stays PENDING until
    # Ray's start timeout; a real deleted RayCluster takes its jobs with it)


@pytest.mark.slow
def test_bad_input_sends_no_request(kube_server, kube_block, ray_head, prefect_api):
    from prefect_nemo import run_job

    block = inline_block(kube_block, ray_head)

    def ours() -> int:
        """Writes of a RayJob or a Secret, what a submit sends (the simulator, maybe still
        tidying earlier tests up, writes pods, clusters and statuses, never these)."""
        return sum(1 for e in list(kube_server.requests.entries)
                   if e.method in ("POST", "PUT", "PATCH") and not e.path.endswith("/status")
                   and ("/rayjobs" in e.path or "/secrets" in e.path))  # fmt: skip

    before = ours()

    @flow
    def bad_flow():
        run_job(JobSpec(entrypoint="true", resources=Resources(memory_bytes=1)), cluster=block)

    with pytest.raises(InvalidJobSpec, match="memory_bytes"):
        bad_flow()
    assert ours() == before


@pytest.mark.slow
def test_watcher_makes_no_per_job_requests(kube_server, kuberay, kube_block, ray_head, monkeypatch):
    """Three jobs waited on at once: the informer's one watch feeds the watcher; the backend
    sends no request per job while waiting (the simulator's own reads share the server's
    request log, so we count ours at the client)."""
    import concurrent.futures

    from prefect_nemo import lifecycle
    from prefect_nemo.watcher import ClusterWatcher

    backend = inline_block(kube_block, ray_head).backend()
    watcher = ClusterWatcher(backend)
    tag = uuid.uuid4().hex[:6]
    handles = [backend.submit(JobSpec(entrypoint="sleep 2"), f"w{tag}-{i}", META)
               for i in range(3)]  # fmt: skip
    unsubscribe = backend.subscribe(lambda: None)  # the informers start with a subscriber
    informer = backend.informers[0]
    assert wait_until(lambda: all(informer.get(h.job_id) for h in handles), 5)
    calls: list[str] = []

    def counted(verb: str) -> Any:
        real = getattr(backend.api, verb)
        return lambda *args, **kwargs: calls.append(verb) or real(*args, **kwargs)

    for verb in ("get", "list"):
        monkeypatch.setattr(backend.api, verb, counted(verb))

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        waits = [pool.submit(lifecycle.wait_until_terminal, watcher, h, timeout_s=60)
                 for h in handles]  # fmt: skip
        time.sleep(0.5)
        kube_server.drop_watches()  # a network blip: the informer resumes its watch
        finals = [w.result() for w in waits]
    assert [f.state for f in finals] == [JobState.SUCCEEDED] * 3
    assert calls == [], "the watcher read the informer's cache only"
    assert informer.error is None
    unsubscribe()


@pytest.mark.slow
def test_forbidden_watch_fails_fast(kube_server, kuberay, kube_block, ray_head):
    """RBAC that forbids listing RayJobs is not an outage to wait out: statuses() raises
    AuthenticationFailed naming the verb."""
    from prefect_nemo import AuthenticationFailed

    backend = inline_block(kube_block, ray_head).backend()
    kube_server.forbid("list", "rayjobs", "ray.io")
    try:
        unsubscribe = backend.subscribe(lambda: None)
        informer = backend.informers[0]
        assert wait_until(lambda: informer.error is not None, 5)
        with pytest.raises(AuthenticationFailed, match="list"):
            backend.statuses(["any"])
        unsubscribe()
    finally:
        kube_server.allow("list", "rayjobs", "ray.io")


@pytest.mark.slow
def test_existing_cluster_with_working_dir(
    kube_server, kuberay, kube_block, shared_cluster, ray_head, prefect_api, run_logs, tmp_path
):
    """clusterSelector mode ships working_dir through the head service proxy to Ray's GCS."""
    from prefect_nemo import run_job
    from prefect_nemo.blocks import KubeRayCluster

    (tmp_path / "main.py").write_text("print('from-working-dir')\n")
    block = KubeRayCluster(kubernetes=kube_block, ray_cluster_name=shared_cluster,
                           ray_token=ray_head.token)  # fmt: skip

    @flow
    def code_flow():
        spec = JobSpec(entrypoint="python main.py", name="code", working_dir=tmp_path)
        return run_job(spec, cluster=block)

    result = code_flow()
    assert result.state is JobState.SUCCEEDED
    assert "from-working-dir" in "\n".join(run_logs)
    assert "dashboard" in result.handle.links
    rj = rayjobs(kube_server)[result.handle.job_id]
    assert "gcs://" in rj["spec"]["runtimeEnvYAML"]


def test_a_failed_submission_on_an_existing_cluster_stops_the_ray_job_left_running(
    kube_server, kuberay, kube_block, shared_cluster, ray_head
):
    """KubeRay v1.6.1 rayjob_controller.go: a K8sJobMode submitter Job that failed while Ray's
    job had not makes the RayJob Failed with `rayJob.Status.Reason = rayv1.SubmissionFailed`
    ("Job submission has failed. Reason: %s. Message: %s"), its jobStatus as it was; and for a
    RayJob that is Complete or Failed: "If the RayJob uses an existing RayCluster, we must not
    delete it" ("skipping resource deletion"). So on an existing RayCluster its Ray job runs on
    with nobody to stop it. We report the job FAILED (an application error: not resubmitted, as
    it may still run) and stop that Ray job through Ray."""
    from prefect_nemo.blocks import KubeRayCluster
    from prefect_nemo.jobs import FailureClass

    block = KubeRayCluster(kubernetes=kube_block, ray_cluster_name=shared_cluster,
                           ray_token=ray_head.token)  # fmt: skip
    backend = block.backend()
    job_id = f"left-{uuid.uuid4().hex[:8]}"
    backend.submit(JobSpec(entrypoint="sleep 300"), job_id, META)
    try:

        def ray_job_running() -> str | None:
            status = (kube_server.get("rayjobs", "default", job_id, group="ray.io") or {}).get(
                "status") or {}  # fmt: skip
            return status.get("jobId") if status.get("jobStatus") == "RUNNING" else None

        assert wait_until(ray_job_running, 60), "the Ray job never ran"
        ray_job_id = ray_job_running()
        # KubeRay's verdict once the submitter reached its backoff limit (the simulator submits
        # from its own process, so it has no submitter pod to fail)
        verdict = {
            "jobDeploymentStatus": "Failed",
            "reason": "SubmissionFailed",
            "message": "Job submission has failed. Reason: BackoffLimitExceeded. Message: Job has "
            "reached the specified backoff limit",
        }
        backend.api.patch(RAY_JOB, job_id, {"status": verdict}, "default", subresource="status")
        status = backend.find(job_id)
        assert status is not None and status.state is JobState.FAILED, status
        assert status.failure is not None and status.failure.kind is FailureClass.APPLICATION
        client = ray_head.block().backend().client
        assert wait_until(lambda: client.get_job_status(ray_job_id).value == "STOPPED", 30), (
            f"the Ray job is {client.get_job_status(ray_job_id).value}"
        )
    finally:  # the Ray job is stopped when the RayJob goes (the simulator, as KubeRay's finalizer)
        backend.api.delete(RAY_JOB, job_id, "default")


def owned_by_rayjob(api: Any, job_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The RayJob and the Secret and ConfigMaps it owns (by its owned-objects annotation), each
    checked to name it as owner (so the garbage collector takes them with it)."""
    from prefect_nemo.backends._kube_objects import OWNED_ANNOTATION

    rj = api.get(RAY_JOB, job_id)
    owned = json.loads(rj["metadata"]["annotations"][OWNED_ANNOTATION])
    assert set(owned) == {"secrets", "configmaps"} and owned["configmaps"], owned
    objects = [api.get(SECRET, n) for n in owned["secrets"]]
    objects += [api.get(CONFIGMAP, n) for n in owned["configmaps"]]
    for obj in objects:
        assert obj is not None, owned
        assert [r["uid"] for r in obj["metadata"]["ownerReferences"]] == [rj["metadata"]["uid"]]
    return rj, objects


def gone_with_the_rayjob(api: Any, owned: list[dict[str, Any]], timeout_s: float = 30) -> bool:
    """Whether the Secret and ConfigMaps went by garbage collection (the RayJob was deleted)."""
    kinds = {"Secret": SECRET, "ConfigMap": CONFIGMAP}
    return wait_until(lambda: all(api.get(kinds[o["kind"]], o["metadata"]["name"]) is None
                                  for o in owned), timeout_s)  # fmt: skip


@pytest.mark.slow
def test_inline_cluster_gets_local_code_and_a_secret_together(
    kube_server, kuberay, kube_block, ray_head, prefect_api, run_logs, tmp_path
):
    """Issue 27: an inline RayCluster spec, a working_dir with a module the entrypoint imports
    and a SecretStr env value the job reads. The simulator runs the RayJob's submitter pod as
    the real operator and a kubelet would (its ConfigMap volume, its init container unpacking
    the code, the submit uploading it); the driver reads the value from the head's env (the
    Secret, envFrom). The job ran the module and saw the value; the ConfigMaps and the Secret
    are owned by the RayJob and go with it; no stored object, Ray job field or log holds it."""
    from prefect.client.orchestration import get_client

    from prefect_nemo import run_job
    from tests.test_secrets import _logs_of_flow_run

    secret = f"s3cret-{uuid.uuid4().hex}"
    block = inline_block(kube_block, ray_head, ttl_seconds_after_finished=30)  # pods to look at
    spec = JobSpec(entrypoint=MYMOD_ENTRYPOINT, name="mymod", working_dir=mymod_dir(tmp_path),
                   env={"API_KEY": SecretStr(secret)})  # fmt: skip

    @flow
    def code_and_secret_flow():
        return run_job(spec, cluster=block)

    state = code_and_secret_flow(return_state=True)
    result = state.result()
    job_id = result.handle.job_id
    assert result.state is JobState.SUCCEEDED, result.message
    logged = "\n".join(run_logs)
    assert secret_seen(secret) in logged, "the module ran and read the value"

    api = kube_block.api()
    rj, owned = owned_by_rayjob(api, job_id)
    cluster = rj["status"]["rayClusterName"]
    pods = api.list(POD, label_selector=f"ray.io/cluster={cluster}")[0]
    assert pods, "the job's cluster is still up (TTL 30 s)"
    info = ray_head.block().backend().client.get_job_info(job_id)
    with get_client(sync_client=True) as client:
        prefect_logs = _logs_of_flow_run(client, state.state_details.flow_run_id, until=job_id)
    haystacks = {
        "objects": json.dumps([rj, [o for o in owned if o["kind"] != "Secret"], pods,
                               api.get(RAY_CLUSTER, cluster)]),
        "ray job": json.dumps([info.entrypoint, info.runtime_env, info.metadata]),
        "run logs": logged,
        "prefect logs": prefect_logs,
    }  # fmt: skip
    for where, text in haystacks.items():
        assert secret not in text, f"the secret leaked into {where}"
    api.delete(RAY_JOB, job_id)
    assert gone_with_the_rayjob(api, owned), "a ConfigMap or the Secret outlived its RayJob"


@pytest.mark.slow
def test_inline_working_dir_in_httpmode_sends_nothing(kube_server, kube_block, ray_head,
                                                      prefect_api, tmp_path):  # fmt: skip
    """HTTPMode has no submitter pod to carry the code: run_job fails naming the field and the
    fix, and no RayJob, Secret or ConfigMap was written."""
    from prefect_nemo import run_job

    block = inline_block(kube_block, ray_head, submission_mode="HTTPMode")
    spec = JobSpec(entrypoint=MYMOD_ENTRYPOINT, working_dir=mymod_dir(tmp_path),
                   env={"API_KEY": SecretStr("s3cret")})  # fmt: skip

    ours = ("/rayjobs", "/secrets", "/configmaps")

    def writes() -> int:
        return sum(1 for e in list(kube_server.requests.entries)
                   if e.method in ("POST", "PUT", "PATCH") and not e.path.endswith("/status")
                   and any(k in e.path for k in ours))  # fmt: skip

    before = writes()

    @flow
    def http_flow():
        run_job(spec, cluster=block)

    with pytest.raises(InvalidJobSpec, match=r"JobSpec\.working_dir: .*HTTPMode.*K8sJobMode"):
        http_flow()
    assert writes() == before


@pytest.mark.slow
def test_ray_jobs_block_through_the_proxy(kuberay, kube_block, shared_cluster, ray_head,
                                          prefect_api, run_logs):  # fmt: skip
    from prefect_nemo import run_job
    from prefect_nemo.blocks.kuberay import ray_jobs_block

    block = ray_jobs_block(kube_block, shared_cluster, ray_head.token)
    assert "/services/shared-head-svc:8265/proxy" in block.dashboard_url

    @flow
    def plain_flow():
        return run_job(JobSpec(entrypoint="echo via-proxy", name="plain"), cluster=block)

    assert plain_flow().state is JobState.SUCCEEDED
    assert "via-proxy" in "\n".join(run_logs)


@pytest.mark.parametrize("entrypoint", [
    "echo aaa; echo bbb",
    """python -c "print('aaa')" && echo `echo bbb` | cat""",
])  # fmt: skip
def test_the_k8sjobmode_submitter_shell_leaves_the_whole_entrypoint_to_ray(
    entrypoint: str, ray_head: Any, ray_client: Any
) -> None:
    """KubeRay issue #3802 (open): "`ray job submit -- echo aaa; echo bbb` and `echo aaa` will
    be executed in the cluster but `echo bbb` will be executed in the submitter" (K8sJobMode's
    submitter pastes `entrypoint` unquoted into its bash line, backticks and redirects too:
    #3764, #3929). The real bash and Ray's real CLI run that line with our RayJob's entrypoint:
    the Ray job prints both words, the submitter neither."""
    import os
    import subprocess
    import sys

    from prefect_nemo.backends.kuberay.manifests import submitted_entrypoint

    for plain in ("python train.py --lr=0.1", """python -c "import time; time.sleep(1)" """):
        assert submitted_entrypoint(plain, "K8sJobMode") == plain, "words (quoted) go as they are"
    assert submitted_entrypoint(entrypoint, "HTTPMode") == entrypoint, "no shell in between"
    job_id = f"submitter-{uuid.uuid4().hex[:6]}"
    ray = Path(sys.executable).parent / "ray"
    submitted = submitted_entrypoint(entrypoint, "K8sJobMode")
    line = (f"{ray} job submit --address {ray_head.dashboard_url} --no-wait "
            f"--submission-id {job_id} -- {submitted}")  # fmt: skip
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": ray_head.token}
    submitter = subprocess.run(["bash", "-c", line], env=env, capture_output=True, text=True,
                               timeout=120, check=True)  # fmt: skip
    deadline = time.monotonic() + 60
    while ray_client.get_job_status(job_id).value not in ("SUCCEEDED", "FAILED"):
        assert time.monotonic() < deadline, "the Ray job did not end"
        time.sleep(0.2)
    assert ray_client.get_job_status(job_id).value == "SUCCEEDED"
    logs = ray_client.get_job_logs(job_id)
    # Ray's supervisor writes its own "Running entrypoint ..." line into the same log, racing
    # the job's output (seen after it in CI): the job's own lines are the ones left.
    own = [line for line in logs.splitlines()
           if line.strip() and not line.startswith("Running entrypoint for job")
           and " INFO " not in line and "\tINFO " not in line]  # fmt: skip
    assert own == ["aaa", "bbb"], (ray_client.get_job_info(job_id).entrypoint, logs)
    assert not {"aaa", "bbb"} & set(submitter.stdout.split()), submitter.stdout
