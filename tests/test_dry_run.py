"""Dry runs (issue 14 item 4): "Give run_job/submit_job ... a dry_run option on every backend that
returns what would be submitted (Ray request body, RayJob/RayCluster/DGD/TrainJob/ConfigMap/Secret
manifests, sbatch script, Lepton/run:ai payloads) with secrets redacted, and submits nothing"."""

from __future__ import annotations

import socket
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import SecretStr

from prefect_nemo import DryRun, InvalidJobSpec, JobSpec, PlacementSpec, lifecycle
from prefect_nemo.blocks import KubeflowTrainerCluster, KubeRayCluster, RayJobsCluster
from prefect_nemo.blocks.kubernetes import KubernetesCluster
from prefect_nemo.kube import kind_for
from prefect_nemo.lifecycle import with_attempt
from prefect_nemo.redaction import MASK
from prefect_nemo.tasks.jobs import run_job, submit_job

SECRET = f"s3cret-{uuid.uuid4().hex}"
TOKEN = f"tok-{uuid.uuid4().hex}"
CLUSTER_SECRET = f"wandb-{uuid.uuid4().hex}"
#: Plain env and a secret reference of a Lepton workspace: what its jobs get.
LEPTON_ENV = {"env_vars": {"PLAIN": "one"}, "secret_vars": {"HF_TOKEN": "hf-token-secret"}}


def _closed_port() -> int:
    """A port nothing listens on: a dry run that sent a request would fail."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_ray_jobs_dry_run_renders_the_submission_and_sends_nothing(tmp_path) -> None:
    """Besides the job's own fields, the rendering shows what the block adds, as NeMo-Skills'
    Ray backend does: the cluster-wide env in runtime_env.env_vars (its secret values masked)
    and the labels of the job's image joined to its selector ("Image-derived selectors only
    fill gaps; explicit entrypoint_label_selector keys win")."""
    (tmp_path / "train.py").write_text("print('hi')\n")
    cluster = RayJobsCluster(
        dashboard_url=f"http://127.0.0.1:{_closed_port()}",
        auth_token=TOKEN,
        env={"HF_HOME": "/models/hf"},
        secret_env={"WANDB_API_KEY": CLUSTER_SECRET},
        image_label_selectors={"nvcr.io/nvidia/nemo-rl:*": {"pool": "b", "nemo/workload": "rl"}},
    )
    spec = JobSpec(
        name="sft",
        entrypoint="python train.py",
        working_dir=tmp_path,
        env={"PLAIN": "1", "HF_TOKEN": SecretStr(SECRET)},
        placement=PlacementSpec(gpus_per_node=1, exclude_head=True, node_labels={"pool": "a"}),
        runtime_env={"image_uri": "nvcr.io/nvidia/nemo-rl:v0.6.0"},
    )
    dry = run_job.fn(spec, cluster, dry_run=True)
    assert isinstance(dry, DryRun) and dry.backend == "ray-jobs"
    [doc] = dry.documents
    request = doc["request"]
    assert request["submission_id"] == dry.job_id and request["entrypoint"] == "python train.py"
    env_vars = request["runtime_env"]["env_vars"]
    assert env_vars["PLAIN"] == "1" and env_vars["HF_HOME"] == "/models/hf"
    assert env_vars["HF_TOKEN"] == MASK and env_vars["WANDB_API_KEY"] == MASK
    assert request["entrypoint_num_gpus"] == 1
    selector = request["entrypoint_label_selector"]
    assert selector["pool"] == "a", "the job's own key wins over its image's"
    assert selector["nemo/workload"] == "rl", "the image's labels fill the gaps"
    assert "image_uri" not in request["runtime_env"], "the image picked nodes, not a container"
    assert "working_dir" in request["runtime_env"]
    for secret in (SECRET, TOKEN, CLUSTER_SECRET):
        assert secret not in dry.yaml and secret not in repr(dry)
    again = submit_job.fn(spec, cluster, dry_run=True)
    assert again.job_id == dry.job_id, "the same job renders the same id (what a run would use)"


# -- NeMo-Run backends --------------------------------------------------------------------------
# Each renders through the code path its submit uses (NeMo-Run's own dry run for the torchx
# backends; NeMo-Run's submission code with its HTTP calls answered locally for the services),
# and each test proves that nothing reached the cluster, then submits for real and compares.


@pytest.mark.nemo_run
def test_nemo_run_local_dry_run_is_the_process_it_would_start(tmp_path) -> None:
    """NeMo-Run's own dry run (`launch(..., dryrun=True)`: torchx's `submit_dryrun`) gives the
    Popen request the local scheduler would start; nothing runs and the job's dir (where a live
    job keeps its logs) is not touched. Issue 14: "returns what would be submitted ... with
    secrets redacted, and submits nothing"."""
    from prefect_nemo.backends.nemo_run.local import NemoRunLocalBackend
    from tests.test_nemo_run_local import NemoRunLocal

    (tmp_path / "train.py").write_text("print('hi')\n")
    spec = JobSpec(
        name=f"local-dry-{uuid.uuid4().hex[:6]}",
        entrypoint="python train.py",
        working_dir=tmp_path,
        env={"PLAIN": "1", "HF_TOKEN": SecretStr(SECRET)},
    )
    dry = run_job.fn(spec, NemoRunLocal(), dry_run=True)
    assert isinstance(dry, DryRun) and dry.backend == "nemo-run-local"
    [doc] = dry.documents
    backend = NemoRunLocalBackend()
    job_dir = backend.local_experiment_dir(dry.job_id)
    assert not job_dir.exists(), "a dry run wrote into the job's own dir"
    assert doc["kind"] == "LocalProcess" and doc["command"][0] == "bash"
    assert doc["command"][1].startswith(str(job_dir))  # shown where the real run puts it
    assert doc["script"].endswith("python train.py") and "cd " in doc["script"]
    assert doc["env"]["PLAIN"] == "1" and doc["env"]["HF_TOKEN"] == MASK
    assert SECRET not in dry.yaml
    # The real submit runs the script the dry run showed.
    backend.submit(with_attempt(spec, 0, None), dry.job_id, {})  # as submit_or_attach
    try:
        script = Path(doc["command"][1]).read_text()
        assert script == doc["script"]
    finally:
        lifecycle.stop_and_confirm(backend, dry.job_id, timeout_s=30)


@pytest.mark.nemo_run
@pytest.mark.slow
def test_slurm_dry_run_is_nemo_runs_sbatch_script_and_submits_nothing(slurm, tmp_path) -> None:
    """NeMo-Run's own dry run renders the sbatch script: `SlurmTunnelScheduler._submit_dryrun`
    "Write[s] ... sbatch script" (`<job>_sbatch.sh`, `req.materialize()`) without running
    sbatch. Issue 14: the dry run returns the "sbatch script ... with secrets redacted, and
    submits nothing". The secret env file is shown by its variable names only."""
    from tests.test_nemo_run_slurm import slurm_block

    job_root = tmp_path / "jobs"
    job_root.mkdir()
    block = slurm_block(slurm, job_root)
    spec = JobSpec(
        name=f"slurm-dry-{uuid.uuid4().hex[:6]}",
        entrypoint="echo $PLAIN",
        env={"PLAIN": "one", "HF_TOKEN": SecretStr(SECRET)},
    )
    dry = run_job.fn(spec, block, dry_run=True)
    assert dry.backend == "slurm"
    script_doc, job_script, secret_doc = dry.documents
    backend = block.backend()
    remote = backend.remote_dir(dry.job_id)
    assert not Path(remote).exists(), "the dry run claimed the job's dir on the cluster"
    assert not backend.statuses([dry.job_id]), "the dry run reached sbatch"
    named = backend.run(f"squeue -h --name={dry.job_id} -o %i; sacct -n -X --name={dry.job_id}")
    assert not named.stdout.strip()
    assert script_doc["kind"] == "SbatchScript" and script_doc["path"].startswith(remote)
    script = script_doc["script"]
    assert script.startswith("#!/bin/bash") and f"#SBATCH --job-name={dry.job_id}" in script
    assert f"#SBATCH --account={slurm.account}" in script and "export PLAIN=one" in script
    assert f"{remote}/.secret-env" in script  # sourced from the file, never inline
    assert job_script["kind"] == "JobScript" and job_script["path"] in script
    assert job_script["script"].rstrip().endswith("echo $PLAIN")
    assert secret_doc == {
        "kind": "SecretEnvFile",
        "host": backend.address,
        "path": f"{remote}/.secret-env",
        "mode": "0600",
        "variables": ["HF_TOKEN"],
    }
    assert SECRET not in dry.yaml
    # The real submit puts exactly that script on the cluster.
    backend.submit(with_attempt(spec, 0, None), dry.job_id, {})  # as submit_or_attach
    try:
        assert Path(script_doc["path"]).read_text() == script
        assert Path(job_script["path"]).read_text() == job_script["script"]
    finally:
        lifecycle.stop_and_confirm(backend, dry.job_id, timeout_s=60)


def _as_rendered(body, replacements):
    """A request as it was sent, with the service-side ids swapped for the dry run's
    placeholders and the code chunks summarized the way the dry run shows them."""
    import json

    from prefect_nemo.backends.nemo_run.dry_run import code_chunks_summarized

    text = json.dumps(body)
    for real, placeholder in replacements.items():
        text = text.replace(json.dumps(real), json.dumps(placeholder))
    return code_chunks_summarized(json.loads(text))


@pytest.mark.nemo_run
def test_lepton_dry_run_is_the_job_create_nemo_run_would_send(tmp_path) -> None:
    """The Lepton job is created by NeMo-Run's `LeptonExecutor.create_lepton_job`, which builds
    leptonai's `LeptonJob` and posts it in one call: the dry run runs that very code with its
    requests answered locally, so it shows the job-create request as leptonai serializes it.
    Issue 14: "returns what would be submitted (... Lepton/run:ai payloads) with secrets
    redacted, and submits nothing"."""
    from leptonai.api.v1.types.job import LeptonJob

    from prefect_nemo.testing.lepton import LeptonServer, unknown_fields
    from tests.test_nemo_run_lepton import workspace_block

    src = tmp_path / "src"
    src.mkdir()
    (src / "train.py").write_text("print('hi')\n")
    spec = JobSpec(
        name=f"lep-dry-{uuid.uuid4().hex[:4]}",
        entrypoint="python3 train.py",
        working_dir=src,
        placement=PlacementSpec(nodes=2, gpus_per_node=1, strategy="spread"),
    )
    with LeptonServer(token=TOKEN, start_s=0.1, running_s=0.2) as lepton:
        block = workspace_block(lepton, tmp_path, **LEPTON_ENV)
        dry = run_job.fn(spec, block, dry_run=True)
        assert not lepton.requests.entries, "the dry run reached the workspace"
        script, job = dry.documents
        request = job["request"]
        assert job["kind"] == "LeptonJob" and job["path"].endswith("/jobs")
        assert not unknown_fields(LeptonJob, request)
        LeptonJob.model_validate(request)
        assert request["metadata"]["id"] == dry.job_id
        assert request["spec"]["parallelism"] == 2 and request["spec"]["resource_shape"]
        envs = {e["name"]: e for e in request["spec"]["envs"]}
        assert envs["PLAIN"]["value"] == "one"
        assert envs["HF_TOKEN"]["value_from"] == {"secret_name_ref": "hf-token-secret"}
        assert envs["PREFECT_NEMO_CODE_0"]["value"].startswith("<")  # shown by size
        assert script["kind"] == "LeptonLaunchScript" and "python3 train.py" in script["script"]
        assert TOKEN not in dry.yaml

        # The real submit sends exactly that request, and runs that launch script.
        backend = block.backend()
        backend.submit(with_attempt(spec, 0, None), dry.job_id, {})
        (post,) = [
            r
            for r in lepton.requests.find("POST", "/jobs")
            if r.body["metadata"]["id"] == dry.job_id
        ]
        group_id, _ = lepton.node_groups["nemo-nodes"]
        sent = _as_rendered(post.body, {group_id: "<id of node group nemo-nodes>"})
        sent["spec"]["affinity"]["allowed_nodes_in_node_group"] = [
            "<each node of node group nemo-nodes>"
        ]
        assert sent == request
        local_script = backend.local_experiment_dir(dry.job_id) / dry.job_id / "launch_script.sh"
        assert local_script.read_text() == script["script"]
        assert script["path"] == post.body["spec"]["container"]["command"][-1].split()[-1]


def _dgx_block(runai, tmp_path, **extra):
    from tests.test_nemo_run_dgx_cloud import cluster_block

    secrets = {"env_vars": {"PLAIN": "one"}, "secret_env": {"HF_TOKEN": "hf/token"}}
    return cluster_block(runai, tmp_path / "pvc", **secrets, **extra)


def _runai_ids(runai) -> dict[str, str]:
    return {
        runai.projects["nemo-project"]: "<id of project nemo-project>",
        runai.cluster_id: "<cluster id of project nemo-project>",
    }


@pytest.mark.nemo_run
def test_dgx_cloud_dry_run_is_the_workload_request_nemo_run_would_send(tmp_path) -> None:
    """The run:ai workload is built and posted in one call, NeMo-Run's
    `DGXCloudExecutor.create_training_job` (`POST {base_url}/workloads/trainings`, or
    `/workloads/distributed` for several nodes): the dry run runs it with its requests answered
    locally, so it shows that path and body. Issue 14: "returns what would be submitted (...
    Lepton/run:ai payloads) with secrets redacted, and submits nothing"."""
    from prefect_nemo.testing.runai import RunaiServer

    src = tmp_path / "src"
    src.mkdir()
    (src / "train.py").write_text("print('hi')\n")
    spec = JobSpec(
        name=f"dgx-dry-{uuid.uuid4().hex[:4]}", entrypoint="python3 train.py", working_dir=src
    )
    with RunaiServer(client_secret=SECRET, running_s=0.2) as runai:
        block = _dgx_block(runai, tmp_path)
        dry = run_job.fn(spec, block, dry_run=True)
        assert not runai.requests.entries, "the dry run reached run:ai"
        [doc] = dry.documents
        assert doc["kind"] == "RunaiWorkload" and doc["path"] == "/api/v1/workloads/trainings"
        request = doc["request"]
        assert request["name"] == dry.job_id and request["useGivenNameAsPrefix"] is True
        envs = {e["name"]: e for e in request["spec"]["environmentVariables"]}
        assert envs["PLAIN"]["value"] == "one"
        assert envs["HF_TOKEN"] == {"name": "HF_TOKEN", "secret": {"name": "hf", "key": "token"}}
        assert envs["PREFECT_NEMO_CODE_0"]["value"].startswith("<")  # shown by size
        assert "python3 train.py" in request["spec"]["args"]
        assert SECRET not in dry.yaml

        # The real submit posts exactly that request.
        backend = block.backend()
        backend.submit(with_attempt(spec, 0, None), dry.job_id, {})
        (post,) = runai.requests.find("POST", "/workloads/trainings")
        assert post.path == doc["path"]
        assert _as_rendered(post.body, _runai_ids(runai)) == request
        for token in runai.issued_tokens:
            assert token not in dry.yaml


@pytest.mark.nemo_run
def test_ray_on_dgx_cloud_dry_run_is_the_bootstrap_deploy_and_the_workload(tmp_path) -> None:
    """NeMo-Run's `DGXCloudRayJob.start` deploys the Ray bootstrap script to the PVC with a
    short-lived workspace ("Write a script to the PVC via a short-lived busybox workspace"),
    then creates the distributed workload that runs it: on DGX Cloud that workload is the Ray
    cluster and the job at once. The dry run shows both requests (the script decoded, not as
    base64 a secret mask could not see into) and sends neither."""
    from prefect_nemo.blocks.dgx_cloud import DGXCloudRayCluster
    from prefect_nemo.testing.runai import RunaiServer

    spec = JobSpec(name=f"grpo-{uuid.uuid4().hex[:4]}", entrypoint="python3 grpo.py")
    with RunaiServer(client_secret=SECRET, running_s=0.2) as runai:
        ray_block = DGXCloudRayCluster(cluster=_dgx_block(runai, tmp_path, nodes=2))
        dry = run_job.fn(spec, ray_block, dry_run=True)
        assert not runai.requests.entries, "the dry run reached run:ai"
        deploy, script, workload = dry.documents
        assert deploy["path"] == "/api/v1/workloads/workspaces"
        assert deploy["request"]["name"] == "script-deploy"
        assert script["kind"] == "RayBootstrapScript" and "ray start --head" in script["script"]
        assert (
            "python3 grpo.py" in script["script"]
            and script["path"] in deploy["request"]["spec"]["args"]
        )
        assert workload["path"] == "/api/v1/workloads/distributed"
        assert workload["request"]["spec"]["command"] == f"/bin/bash {script['path']}"
        assert workload["request"]["spec"]["numWorkers"] == 2
        assert SECRET not in dry.yaml

        backend = ray_block.backend()
        backend.submit(with_attempt(spec, 0, None), dry.job_id, {})
        (sent_deploy,) = runai.requests.find("POST", "/workloads/workspaces")
        (sent_workload,) = runai.requests.find("POST", "/workloads/distributed")
        assert _as_rendered(sent_workload.body, _runai_ids(runai)) == workload["request"]
        sent = _as_rendered(sent_deploy.body, _runai_ids(runai))
        packed = sent["spec"]["args"].split("echo ", 1)[1].split(" ", 1)[0]
        assert (
            sent["spec"]["args"].replace(packed, "<the Ray bootstrap script below, gzip + base64>")
            == deploy["request"]["spec"]["args"]
        )
        sent["spec"]["args"] = deploy["request"]["spec"]["args"]
        assert sent == deploy["request"]


@pytest.mark.nemo_run
def test_ray_on_lepton_dry_run_is_the_cluster_request_and_the_ray_submission(tmp_path) -> None:
    """NeMo-Run's `LeptonRayCluster.create` builds the RayCluster request (leptonai's
    `LeptonRayCluster`) and posts it in one call: the dry run runs it with its requests
    answered locally; the Ray job submission is `JobSubmissionClient.submit_job`'s arguments
    (the request builder `submit` uses). Issue 14: "returns what would be submitted ... and
    submits nothing"."""
    from leptonai.api.v1.types.raycluster import LeptonRayCluster as Request

    from prefect_nemo.blocks.lepton import LeptonRayCluster
    from prefect_nemo.testing.lepton import LeptonServer, unknown_fields
    from tests.test_nemo_run_lepton import workspace_block

    spec = JobSpec(name="grpo", entrypoint="python grpo.py", env={"PLAIN": "1"})
    with LeptonServer(token=TOKEN, ray_ready_s=0.05) as lepton:
        ray_block = LeptonRayCluster(
            workspace=workspace_block(lepton, tmp_path, **LEPTON_ENV),
            ray_cluster_name="rl-dry",
            worker_nodes=2,
        )
        dry = run_job.fn(spec, ray_block, dry_run=True)
        assert not lepton.requests.entries, "the dry run reached the workspace"
        cluster, submission = dry.documents
        assert cluster["kind"] == "LeptonRayCluster" and cluster["path"].endswith("/rayclusters")
        request = cluster["request"]
        assert not unknown_fields(Request, request)
        Request.model_validate(request)
        assert request["metadata"]["id"] == "rl-dry"
        assert request["spec"]["worker_group_specs"][0]["min_replicas"] == 2
        assert submission["kind"] == "RayJobSubmission"
        assert submission["address"].endswith("/rayclusters/rl-dry/dashboard")
        assert submission["request"]["submission_id"] == dry.job_id
        assert submission["request"]["runtime_env"]["env_vars"]["PLAIN"] == "1"
        assert TOKEN not in dry.yaml

        # Creating the cluster for real sends exactly that request.
        ray_block.backend().ensure_cluster(poll_s=0.05)
        (post,) = lepton.requests.find("POST", "/rayclusters")
        group_id, _ = lepton.node_groups["nemo-nodes"]
        assert _as_rendered(post.body, {group_id: "<id of node group nemo-nodes>"}) == request


def test_the_cli_renders_a_job_from_a_block_document_offline(tmp_path, capsys) -> None:
    """`prefect-nemo render job`: the issue's "expose it in the CLI (prefect-nemo render ...)";
    a block document file needs no Prefect server, and nothing is sent to the cluster."""
    from prefect_nemo.cli import main

    document = tmp_path / "blocks.yaml"
    document.write_text(
        "blocks:\n  - type: ray-jobs-cluster\n    name: remote\n    data:\n"
        f"      dashboard_url: http://127.0.0.1:{_closed_port()}\n"
        f"      auth_token: {TOKEN}\n"
    )
    code = main(
        ["render", "job", "--document", str(document), "--cluster", "remote",
         "--experiment", "sft-v3", "--name", "train", "--env", "A=1", "--", "python", "t.py"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0 and "kind: RayJobSubmission" in out and "entrypoint: python t.py" in out
    assert "submission_id: sft-v3-train-" in out, "the id a run of experiment sft-v3 would use"
    assert TOKEN not in out


def test_the_cli_renders_the_code_configmaps_of_an_inline_kuberay_job(tmp_path, capsys) -> None:
    """`prefect-nemo render job --working-dir` against a KubeRay block with an inline cluster
    prints the ConfigMaps the job would bring its code in, before the RayJob (offline)."""
    from prefect_nemo.cli import main

    code = tmp_path / "code"
    code.mkdir()
    (code / "t.py").write_text("print(1)\n")
    kubeconfig = {
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": f"https://127.0.0.1:{_closed_port()}"}}],
        "users": [{"name": "u", "user": {"token": TOKEN}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
    }  # fmt: skip
    document = tmp_path / "blocks.yaml"
    document.write_text(yaml.safe_dump({"blocks": [{
        "type": "kube-ray-cluster", "name": "own",
        "data": {"kubernetes": {"kubeconfig": kubeconfig, "namespace": "ml"},
                 "ray_cluster_spec": _ray_cluster_spec()},
    }]}))  # fmt: skip
    status = main(["render", "job", "--document", str(document), "--cluster", "own", "--name",
                   "train", "--working-dir", str(code), "--", "python", "t.py"])  # fmt: skip
    out = capsys.readouterr().out
    assert status == 0, out
    kinds = [doc["kind"] for doc in yaml.safe_load_all(out) if isinstance(doc, dict)]
    assert kinds == ["ConfigMap", "RayJob"], out[:2000]
    assert "submitterPodTemplate" in out and TOKEN not in out


# ---------------------------------------------------------------------------------------------
# Kubernetes backends: every rendered manifest is accepted by the loopback API server with
# fieldValidation=Strict (the kit's real CRD schemas), and rendering sends no request at all


RAY_IMAGE = "rayproject/ray:2.60.0"


def _ray_cluster_spec() -> dict[str, Any]:
    def group() -> dict[str, Any]:
        container = {"name": "ray", "image": RAY_IMAGE}
        return {"rayStartParams": {}, "template": {"spec": {"containers": [container]}}}

    return {"headGroupSpec": group(), "workerGroupSpecs": [{"groupName": "w", **group()}]}


def _accepted(kube_server: Any, doc: dict[str, Any]) -> dict[str, Any]:
    """`doc` as the server would store it (validated and defaulted by a create with
    dryRun=All: nothing is stored); Strict: a field the schema lacks is refused, not dropped."""
    api = KubernetesCluster(kubeconfig=kube_server.kubeconfig()).api()
    kind = kind_for(doc)
    ns = api._ns(kind, None, doc)
    strict = [("fieldValidation", "Strict")]
    return (
        api._resource(kind)
        .create(body=doc, namespace=ns, dry_run="All", query_params=strict)
        .to_dict()
    )


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


def test_kuberay_dry_run_shows_the_code_configmaps_of_an_inline_cluster(
    kube_server: Any, tmp_path: Any
) -> None:
    """Issue 27: with an inline cluster working_dir travels in ConfigMaps the RayJob owns and
    its submitter pod unpacks; the dry run shows them (Secret, ConfigMap, RayJob, in the order
    submit creates them), each accepted by the server, no request sent, and submit then
    creates exactly what was rendered."""
    (tmp_path / "t.py").write_text("print(1)\n")
    kube = KubernetesCluster(kubeconfig=kube_server.kubeconfig())
    cluster = KubeRayCluster(kubernetes=kube, ray_cluster_spec=_ray_cluster_spec(),
                             namespace="default")  # fmt: skip
    spec = JobSpec(name="train", entrypoint="python t.py", working_dir=tmp_path,
                   env={"HF_TOKEN": SecretStr(SECRET)})  # fmt: skip
    kube_server.requests.clear()
    dry = run_job.fn(spec, cluster, dry_run=True)
    _no_request(kube_server)
    assert [d["kind"] for d in dry.documents] == ["Secret", "ConfigMap", "RayJob"]
    configmap, rayjob = dry.documents[1:]
    volume = rayjob["spec"]["submitterPodTemplate"]["spec"]["volumes"][0]
    assert volume["projected"]["sources"][0]["configMap"]["name"] == configmap["metadata"]["name"]
    assert yaml.safe_load(rayjob["spec"]["runtimeEnvYAML"])["working_dir"] == "/prefect-nemo/code"
    assert SECRET not in dry.yaml
    for doc in dry.documents:
        _accepted(kube_server, doc)
    backend = cluster.backend()
    rendered = [_accepted(kube_server, d) for d in backend.render(spec, "code-dry-vs-real", {})]
    backend.submit(spec, "code-dry-vs-real", {})
    for doc in rendered[1:]:  # the ConfigMap and the RayJob as the server holds them
        stored = backend.api.get(kind_for(doc), doc["metadata"]["name"], "default")
        key = "spec" if doc["kind"] == "RayJob" else "binaryData"
        assert stored[key] == doc[key]
    backend.api.delete(kind_for(rendered[-1]), "code-dry-vs-real", "default")


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
