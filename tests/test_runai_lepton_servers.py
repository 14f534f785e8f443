"""The loopback run:ai and Lepton servers, driven by NeMo-Run's executors and leptonai unchanged.

These pin down how the servers behave (the backends' tests build on them): auth and token
expiry, workload/job phases, the services' size limits, NeMo-Run's own calls (and its wrong
DGX Cloud cancel), and code delivered in env-var chunks really reassembled from the env the
server received, by the pod-side command, under the NODE_RANK gate.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from prefect_nemo.backends.nemo_run.isolation import nemo_run
from prefect_nemo.packaging import build_archive, plan_for
from prefect_nemo.testing.lepton import LeptonServer
from prefect_nemo.testing.runai import ARGS_LIMIT, ENV_VALUE_LIMIT, RunaiServer

pytestmark = pytest.mark.nemo_run

# NeMo-Run and leptonai, imported by `_sdk` (after NEMORUN_HOME is isolated), so that this
# module is collected, then deselected, in the core environment that has neither.
ClientError: Any = None
LeptonJobState: Any = None
APIClient: Any = None
DGXCloudExecutor: Any = None
DGXCloudState: Any = None
LeptonExecutor: Any = None


@pytest.fixture(scope="module", autouse=True)
def _sdk() -> None:
    global ClientError, LeptonJobState, APIClient, DGXCloudExecutor, DGXCloudState, LeptonExecutor
    nemo_run()
    from leptonai.api.v1 import api_resource
    from leptonai.api.v1.types import job
    from leptonai.api.v2 import client
    from nemo_run.core.execution import dgxcloud, lepton

    ClientError, LeptonJobState, APIClient = (
        api_resource.ClientError,
        job.LeptonJobState,
        client.APIClient,
    )
    DGXCloudExecutor, DGXCloudState = dgxcloud.DGXCloudExecutor, dgxcloud.DGXCloudState
    LeptonExecutor = lepton.LeptonExecutor


SHELL = "/bin/sh"


def wait_for(check, timeout_s: float = 10.0) -> Any:
    """Poll `check()` until it returns something truthy."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


def sample_source(root: Path, blob_bytes: int = 60_000) -> Path:
    """A small project: a package, a script and an incompressible blob."""
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("VALUE = 42\n")
    (root / "train.py").write_text("import pkg\nprint('value', pkg.VALUE)\n")
    (root / "pkg" / "blob.bin").write_bytes(os.urandom(blob_bytes))
    return root


def run_pods(command: str, envs: list[dict[str, str]]) -> list[subprocess.CompletedProcess]:
    """Run `command` in one shell per pod env at once, as the pods of one job would."""
    procs = [
        subprocess.Popen(
            [SHELL, "-c", command],
            env={"PATH": os.environ["PATH"], **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for env in envs
    ]
    out = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=60)
        out.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    return out


# ----------------------------------------------------------------------------- run:ai


@pytest.fixture
def runai() -> Iterator[RunaiServer]:
    with RunaiServer(creating_s=0.1, initializing_s=0.1, running_s=0.4) as server:
        yield server


def dgx_executor(server: RunaiServer, **kw: Any) -> DGXCloudExecutor:
    return DGXCloudExecutor(
        base_url=server.base_url,
        kube_apiserver_url="https://k8s.invalid",
        client_id=server.client_id,
        client_secret=server.client_secret,
        project_name="nemo-project",
        container_image="nvcr.io/nvidia/nemo:25.07",
        pvc_nemo_run_dir="/pvc/nemo-run",
        pvcs=[{"path": "/pvc", "claimName": "nemo-pvc", "existingPvc": True}],
        **kw,
    )


def ids(executor: DGXCloudExecutor) -> tuple[str, str, str]:
    token = executor.get_auth_token()
    assert token
    project, cluster = executor.get_project_and_cluster_id(token)
    assert project and cluster
    return token, project, cluster


def list_workloads(server: RunaiServer, token: str, filter_by: str) -> list[dict[str, Any]]:
    """``GET /workloads?filterBy=...``: the listed items."""
    response = requests.get(
        f"{server.base_url}/workloads",
        params={"filterBy": filter_by},
        headers={"Authorization": f"Bearer {token}"},
        timeout=5,
    )
    return response.json()["workloads"]


def test_runai_token_and_credentials(runai: RunaiServer) -> None:
    executor = dgx_executor(runai)
    token, project, cluster = ids(executor)
    assert (project, cluster) == ("4501", runai.cluster_id)
    assert runai.requests.find("POST", "/api/v1/token")[0].body == {
        "grantType": "client_credentials",
        "clientId": runai.client_id,
        "clientSecret": runai.client_secret,
    }
    # A wrong secret is a 401, like the real service (NeMo-Run would retry it 3 x 10 s).
    bad = requests.post(
        f"{runai.base_url}/token",
        json={"grantType": "client_credentials", "clientId": runai.client_id, "clientSecret": "x"},
        timeout=5,
    )
    assert bad.status_code == 401 and "invalid client credentials" in bad.text
    # No token, a made-up one, an expired one: 401 on every other endpoint.
    assert requests.get(f"{runai.base_url}/org-unit/projects", timeout=5).status_code == 401
    runai.expire_tokens()
    headers = {"Authorization": f"Bearer {token}"}
    old = requests.get(f"{runai.base_url}/org-unit/projects", headers=headers, timeout=5)
    assert old.status_code == 401 and "expired" in old.text
    assert ids(executor)  # a new token works again


def test_runai_token_ttl(runai: RunaiServer) -> None:
    runai.token_ttl_s = 0.3
    token, _, _ = ids(dgx_executor(runai))
    headers = {"Authorization": f"Bearer {token}"}
    url = f"{runai.base_url}/org-unit/projects"
    assert requests.get(url, headers=headers, timeout=5).status_code == 200
    time.sleep(0.4)
    assert requests.get(url, headers=headers, timeout=5).status_code == 401


def test_runai_phases_and_the_correct_suspend(runai: RunaiServer) -> None:
    executor = dgx_executor(runai)
    token, project, cluster = ids(executor)
    runai.hold("held")
    response = executor.create_training_job(token, project, cluster, "held-train")
    assert response.status_code == 202
    body = response.json()
    assert body["actualPhase"] == "Creating" and body["name"].startswith("held-train-")
    wid = body["workloadId"]
    seen = []
    wait_for(lambda: seen.append(executor.status(wid)) or seen[-1] is DGXCloudState.RUNNING)
    assert seen[0] is DGXCloudState.CREATING and DGXCloudState.RUNNING in seen

    # NeMo-Run 0.11.1's cancel: GET .../distributed/<id>/suspend, wrong verb and kind.
    executor.cancel(wid)
    wrong = runai.requests.find(None, "/suspend")[-1]
    assert (wrong.method, wrong.path, wrong.status) == (
        "GET",
        f"/api/v1/workloads/distributed/{wid}/suspend",
        405,
    )
    time.sleep(0.3)
    assert executor.status(wid) is DGXCloudState.RUNNING, "the wrong request stopped nothing"

    # What run:ai documents: POST .../trainings/<id>/suspend.
    headers = executor._default_headers(token=executor.get_auth_token())
    right = requests.post(
        f"{runai.base_url}/workloads/trainings/{wid}/suspend", headers=headers, timeout=5
    )
    assert right.status_code == 202
    assert executor.status(wid) is DGXCloudState.STOPPING
    wait_for(lambda: executor.status(wid) is DGXCloudState.STOPPED)
    # Delete removes it: 404 afterwards.
    gone = requests.delete(
        f"{runai.base_url}/workloads/trainings/{wid}", headers=headers, timeout=5
    )
    assert gone.status_code == 202
    assert (
        requests.get(f"{runai.base_url}/workloads/trainings/{wid}", headers=headers).status_code
        == 404
    )


def test_runai_outcomes_distributed_and_list_by_name(runai: RunaiServer) -> None:
    executor = dgx_executor(runai, nodes=2, gpus_per_node=0)
    token, project, cluster = ids(executor)
    runai.set_outcome("bad", "Failed")
    good = executor.create_training_job(token, project, cluster, "good-run").json()
    bad = executor.create_training_job(token, project, cluster, "bad-run").json()
    assert runai.requests.find("POST", "/workloads/distributed")
    payload = runai.requests.find("POST", "/workloads/distributed")[0].body
    assert (
        payload["spec"]["numWorkers"] == 2 and payload["spec"]["compute"]["gpuDevicesRequest"] == 0
    )
    wait_for(lambda: executor.status(good["workloadId"]) is DGXCloudState.COMPLETED)
    wait_for(lambda: executor.status(bad["workloadId"]) is DGXCloudState.FAILED)

    listed = list_workloads(runai, token, "name=^good-run")
    assert [w["id"] for w in listed] == [good["workloadId"]]
    assert listed[0]["type"] == "Distributed" and listed[0]["phase"] == "Completed"
    exact = list_workloads(runai, token, f"name=={bad['name']}")
    assert [w["phase"] for w in exact] == ["Failed"]


def test_runai_list_items_carry_project_and_env_not_labels(runai: RunaiServer) -> None:
    """run:ai's ``Workload`` schema (the items of ``GET /workloads``, API 2.19 on) has
    ``projectName`` and ``environmentVariables`` (an object of name to value) and no labels;
    ``filterBy`` takes ``projectName``. Labels on a workload are ``{name, value, exclude}``
    items whose name has 1-63 characters."""
    executor = dgx_executor(runai)
    token, project, cluster = ids(executor)
    executor.env_vars = {"OWNER": "run-1"}
    executor.custom_spec = {"labels": [{"name": "team", "value": "rl", "exclude": False}]}
    created = executor.create_training_job(token, project, cluster, "labelled").json()
    executor.custom_spec = {"labels": [{"name": "x" * 64, "value": "v"}]}
    refused = executor.create_training_job(token, project, cluster, "bad-label")
    assert refused.status_code == 400 and "spec.labels[0].name" in refused.json()["message"]
    (item,) = list_workloads(runai, token, "projectName==nemo-project")
    assert item["id"] == created["workloadId"] and item["projectName"] == "nemo-project"
    assert item["environmentVariables"] == {"OWNER": "run-1"} and "labels" not in item
    assert list_workloads(runai, token, "projectName==elsewhere") == []


def test_runai_limits_are_enforced(runai: RunaiServer) -> None:
    executor = dgx_executor(runai)
    token, project, cluster = ids(executor)
    executor.env_vars = {"BIG": "x" * (ENV_VALUE_LIMIT + 1)}
    refused = executor.create_training_job(token, project, cluster, "too-big")
    assert refused.status_code == 400
    assert "spec.environmentVariables[0].value" in refused.json()["message"]
    executor.env_vars = {"FITS": "x" * ENV_VALUE_LIMIT}
    assert executor.create_training_job(token, project, cluster, "fits").status_code == 202
    executor.env_vars = {}
    executor.custom_spec = {"args": "y" * (ARGS_LIMIT + 1)}
    long_args = executor.create_training_job(token, project, cluster, "long-args")
    assert long_args.status_code == 400 and "spec.args" in long_args.json()["message"]
    assert not runai.by_name("too-big") and not runai.by_name("long-args")


def test_runai_data_mover_through_nemo_run(runai: RunaiServer, tmp_path: Path) -> None:
    executor = dgx_executor(runai)
    token, project, cluster = ids(executor)
    executor.job_dir = str(tmp_path / "job")
    executor.pvc_job_dir = "/pvc/nemo-run/exp/job"
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "launch_script.sh").write_text("echo hi\n")
    executor.move_data(token, project, cluster, sleep=0.1)
    created = runai.requests.find("POST", "/workloads/workspaces")
    assert len(created) == 1 and len(created[0].body["spec"]["args"]) <= ARGS_LIMIT
    assert runai.requests.find("DELETE", "/workloads/workspaces/")  # cleaned up when done


def test_runai_chunked_code_reassembles_in_pods(runai: RunaiServer, tmp_path: Path) -> None:
    archive = build_archive(sample_source(tmp_path / "src"))
    plan = plan_for("dgx_cloud", archive, name="chunked")
    assert plan.chunks > 5
    executor = dgx_executor(runai, nodes=2)
    token, project, cluster = ids(executor)
    executor.env_vars = dict(plan.env)
    response = executor.create_training_job(token, project, cluster, "chunked")
    assert response.status_code == 202, response.text
    (workload,) = runai.by_name("chunked")
    sent = runai.requests.find("POST", "/workloads/distributed")[0].body
    assert max(len(e["value"]) for e in sent["spec"]["environmentVariables"]) <= 9 * 1024

    # Both pods run the setup command on one shared directory: rank 0 unpacks, rank 1 waits
    # (run:ai's PyTorch pods get RANK from the training operator).
    dest = tmp_path / "pvc" / "code"
    command = plan.setup_command(str(dest), shared=True, wait_timeout_s=30, rank_env="RANK")
    results = run_pods(command, [runai.pod_env(workload, 1), runai.pod_env(workload, 0)])
    assert [r.returncode for r in results] == [0, 0], [r.stderr for r in results]
    assert (dest / "pkg" / "blob.bin").read_bytes() == (
        tmp_path / "src" / "pkg" / "blob.bin"
    ).read_bytes()
    assert (dest / plan.marker_name).exists()


# ----------------------------------------------------------------------------- Lepton


@pytest.fixture
def lepton(monkeypatch: pytest.MonkeyPatch) -> Iterator[LeptonServer]:
    with LeptonServer(start_s=0.1, running_s=0.4) as server:
        for key, value in server.env().items():
            monkeypatch.setenv(key, value)
        yield server


def lepton_executor(**kw: Any) -> LeptonExecutor:
    executor = LeptonExecutor(
        container_image="nvcr.io/nvidia/nemo:25.07",
        nemo_run_dir="/nemo-workspace/nemo-run",
        node_group="nemo-nodes",
        resource_shape="gpu.1xh100-80gb",
        mounts=[{"path": "/", "mount_path": "/nemo-workspace", "from": "node-nfs:shared"}],
        **kw,
    )
    executor.lepton_job_dir = "/nemo-workspace/nemo-run/exp/job"
    return executor


def test_lepton_auth(lepton: LeptonServer, monkeypatch: pytest.MonkeyPatch) -> None:
    assert [g.metadata.name for g in APIClient().nodegroup.list_all()] == ["nemo-nodes"]
    monkeypatch.setenv("LEPTON_WORKSPACE_TOKEN", "not-the-token")
    with pytest.raises(ClientError, match="401"):
        APIClient().nodegroup.list_all()


def test_lepton_job_lifecycle_through_nemo_run(lepton: LeptonServer) -> None:
    executor = lepton_executor(nodes=2)
    executor.env_vars = {"A": "1"}
    job = executor.create_lepton_job("life-job")
    assert job.metadata.id_ == "life-job"
    sent = lepton.requests.find("POST", "/jobs")[0].body
    assert sent["spec"]["completions"] == 2 and sent["spec"]["envs"] == [
        {"name": "A", "value": "1"}
    ]
    group_id = lepton.node_groups["nemo-nodes"][0]
    assert sent["spec"]["affinity"]["allowed_dedicated_node_groups"] == [group_id]
    states = []
    wait_for(
        lambda: states.append(executor.status("life-job")) or states[-1] is LeptonJobState.Completed
    )
    assert states[0] is LeptonJobState.Starting and LeptonJobState.Running in states

    client = APIClient()
    replicas = client.job.get_replicas("life-job")
    assert sorted(r.metadata.id_.split("-")[2] for r in replicas) == ["0", "1"]
    lepton.set_log("life-job", "step 1\nstep 2\n")
    assert (
        "".join(client.job.get_log(id_or_job="life-job", replica=replicas[0])) == "step 1\nstep 2\n"
    )
    # Listed among archived jobs, found by substring.
    assert [
        j.metadata.id_ for j in client.job.list_all(job_query_mode="alive_and_archive", q="life")
    ] == ["life-job"]
    # Taken ids are refused; unknown fields and bad ids too.
    with pytest.raises(ClientError, match="409"):
        executor.create_lepton_job("life-job")
    bad = requests.post(
        f"{lepton.api_url}/jobs",
        json={"metadata": {"id": "x-job"}, "spec": {"no_such_field": 1}},
        headers={"Authorization": f"Bearer {lepton.token}"},
        timeout=5,
    )
    assert bad.status_code == 400 and "spec.no_such_field" in bad.text
    with pytest.raises(ClientError, match=r"metadata\.id"):
        executor.create_lepton_job("Bad_Name")


def test_lepton_list_selects_jobs_by_label(lepton: LeptonServer) -> None:
    """leptonai documents ``list_all(query=...)`` as a label selector over the jobs'
    ``metadata.labels``: equality, inequality, existence and absence, all of them must hold."""
    from leptonai.api.v1.types.common import Metadata
    from leptonai.api.v1.types.job import LeptonJob, LeptonJobUserSpec

    client = APIClient()
    for job_id, labels in (("lab-a", {"team": "rl", "run": "1"}), ("lab-b", {"team": "sft"})):
        client.job.create(
            LeptonJob(
                metadata=Metadata(id=job_id, labels=labels),
                spec=LeptonJobUserSpec(resource_shape="cpu.small"),
            )
        )
    client.job.create(LeptonJob(metadata=Metadata(id="lab-c"), spec=LeptonJobUserSpec()))

    def listed(selector: str) -> list[str]:
        return sorted(j.metadata.id_ for j in client.job.list_all(query=selector))

    assert listed("team=rl") == ["lab-a"] and listed("team==sft") == ["lab-b"]
    assert listed("team!=rl") == ["lab-b", "lab-c"] and listed("team") == ["lab-a", "lab-b"]
    assert listed("!team") == ["lab-c"] and listed("team=rl,run=2") == []
    (job,) = client.job.list_all(query="run=1")
    assert job.metadata.labels == {"team": "rl", "run": "1"}


def test_lepton_stop_and_delete(lepton: LeptonServer) -> None:
    lepton.hold("held")
    executor = lepton_executor()
    executor.create_lepton_job("held-stop")
    executor.create_lepton_job("held-delete")
    wait_for(lambda: executor.status("held-stop") is LeptonJobState.Running)
    executor.stop_job("held-stop")  # PATCH {"spec": {"stopped": true}}
    patch = lepton.requests.find("PATCH", "/jobs/held-stop")[0]
    assert patch.body == {"spec": {"stopped": True}}
    wait_for(lambda: executor.status("held-stop") is LeptonJobState.Stopped)
    executor.cancel("held-delete")  # DELETE
    assert lepton.deleted == ["held-delete"]
    with pytest.raises(ClientError, match="404"):
        APIClient().job.get("held-delete")


def test_lepton_single_argument_tarball_breaks_like_a_real_pod(
    lepton: LeptonServer, tmp_path: Path
) -> None:
    """NeMo-Run's data mover puts the whole job dir in one `sh -c` argument: past 128 KiB the
    pod cannot exec it. The chunked transport delivers the same code."""
    executor = lepton_executor()
    executor.job_dir = str(sample_source(tmp_path / "job", blob_bytes=150_000))
    with pytest.raises(RuntimeError, match="failed with status"):
        executor.move_data(poll_interval=0.05)
    (failed,) = lepton.requests.find("POST", "/jobs")
    assert len(failed.body["spec"]["container"]["command"][2]) > 128 * 1024
    mover = failed.body["metadata"]["id"]
    assert "argument list too long" in lepton.jobs[mover].message

    archive = build_archive(tmp_path / "job")
    plan = plan_for("lepton", archive, name="chunked")
    assert plan.chunks == 3  # ~200 KiB of base64 in 96 KiB pieces
    executor.env_vars = dict(plan.env)
    executor.create_lepton_job("chunked-job")
    wait_for(lambda: executor.status("chunked-job") is LeptonJobState.Completed)
    job = lepton.jobs["chunked-job"]
    dest = tmp_path / "shared" / "code"
    command = plan.setup_command(str(dest), shared=True, rank_env="LEPTON_JOB_WORKER_INDEX")
    results = run_pods(command, [lepton.pod_env(job, 1), lepton.pod_env(job, 0)])
    assert [r.returncode for r in results] == [0, 0], [r.stderr for r in results]
    assert (dest / "pkg" / "blob.bin").read_bytes() == (tmp_path / "job/pkg/blob.bin").read_bytes()


def test_lepton_ray_cluster_lifecycle(lepton: LeptonServer) -> None:
    from nemo_run.run.ray.lepton import LeptonRayCluster

    from prefect_nemo.backends.nemo_run.isolation import root_logger_kept

    with root_logger_kept():
        cluster = LeptonRayCluster(name="rl-cluster", executor=lepton_executor(nodes=2))
        assert cluster.create() == "rl-cluster"
        assert cluster.create() == "rl-cluster"  # exists: reused, not created twice
        assert len(lepton.requests.find("POST", "/rayclusters")) == 1
        wait_for(lambda: cluster.status()["ray_ready"])
        assert cluster.delete(wait=True, poll_interval=0.05)
    assert lepton.rayclusters == {}


def test_runai_executes_pods_when_asked(tmp_path: Path) -> None:
    """execute=True: pods run as local processes; the data mover really moves the job dir."""
    with RunaiServer(creating_s=0.05, initializing_s=0.05, execute=True) as server:
        pvc = tmp_path / "pvc"
        executor = dgx_executor(server)
        executor.pvcs = [{"path": str(pvc), "claimName": "nemo-pvc"}]
        token, project, cluster = ids(executor)
        executor.job_dir = str(tmp_path / "job")
        executor.pvc_job_dir = str(pvc / "exp" / "job")
        (tmp_path / "job").mkdir()
        (tmp_path / "job" / "launch_script.sh").write_text("echo hi\n")
        executor.move_data(token, project, cluster, sleep=0.1)
        assert (pvc / "exp" / "job" / "launch_script.sh").read_text() == "echo hi\n"

        def train(name: str, script: str) -> str:
            executor.custom_spec = {"command": "sh -c", "args": f"'{script}'"}
            response = executor.create_training_job(token, project, cluster, name)
            assert response.status_code == 202, response.text
            return response.json()["workloadId"]

        ok = train("ok", f"echo rank=$RANK > {pvc}/ok.txt")
        bad = train("bad", "exit 3")
        slow = train("slow", "sleep 30")
        wait_for(lambda: executor.status(ok) is DGXCloudState.COMPLETED)
        assert (pvc / "ok.txt").read_text() == "rank=0\n"
        wait_for(lambda: executor.status(bad) is DGXCloudState.FAILED)
        wait_for(lambda: executor.status(slow) is DGXCloudState.RUNNING)
        headers = executor._default_headers(token=token)
        requests.post(f"{server.base_url}/workloads/trainings/{slow}/suspend", headers=headers)
        wait_for(lambda: executor.status(slow) is DGXCloudState.STOPPED)
        (workload,) = server.by_name("slow")
        assert workload.processes[0].wait(5) != 0  # terminated


def test_lepton_executes_pods_when_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """execute=True: NeMo-Run's data mover and launch script really run (Lepton's init script
    from the pod's image, NeMo-Run's /nemo_run link under the pod's own root), the replica log
    endpoint serves the replicas' own output, each job's state comes from its exit codes, and
    stop, delete or closing the server ends the processes."""
    shared = tmp_path / "shared"

    def launch(name: str, command: str, nodes: int = 1) -> Any:
        executor = LeptonExecutor(
            container_image="nvcr.io/nvidia/nemo:25.07",
            nemo_run_dir=str(shared / "nemo-run"),
            node_group="nemo-nodes",
            resource_shape="cpu.small",
            nodes=nodes,
            mounts=[{"path": "/", "mount_path": str(shared), "from": "node-nfs:shared"}],
        )
        executor.job_dir = str(tmp_path / "local" / name)
        executor.lepton_job_dir = str(shared / "nemo-run" / name)
        (tmp_path / "local" / name / "code").mkdir(parents=True)
        (tmp_path / "local" / name / "code" / "hello.txt").write_text(f"code of {name}\n")
        executor.launch(name=name, cmd=[command])
        return executor

    def log(name: str, until: str | None = None) -> str:
        """Replica 0's log: all of it (the stream ends with the job), or up to `until`."""
        client = APIClient()
        (first,) = [r for r in client.job.get_replicas(name) if f"{name}-0-" in r.metadata.id_]
        stream, text = client.job.get_log(id_or_job=name, replica=first), ""
        for chunk in stream:
            text += chunk
            if until is not None and until in text:
                stream.close()  # a live job's log stays open: stop reading
                break
        return text

    def host_nemo_run() -> list[str] | None:
        """This machine's /nemo_run as it stands (an earlier, broken run may have left one)."""
        top = Path("/nemo_run")
        return sorted(p.name for p in top.iterdir()) if top.is_dir() else None

    before = host_nemo_run()
    with LeptonServer(start_s=0.05, execute=True) as server:
        for key, value in server.env().items():
            monkeypatch.setenv(key, value)
        ok = launch("ok-job", 'cat hello.txt; echo "rank $NODE_RANK of $NNODES in $PWD"', nodes=2)
        bad = launch("bad-job", "echo failing >&2; exit 3")
        held = launch("held-job", "echo started; sleep 60")
        wait_for(lambda: ok.status("ok-job") is LeptonJobState.Completed)
        text = log("ok-job")
        assert "code of ok-job\n" in text, text  # the data mover moved the job dir, cd worked
        assert re.search(r"^rank 0 of 2 in /\S+/nemo_run/code$", text, re.M), text
        wait_for(lambda: bad.status("bad-job") is LeptonJobState.Failed)
        assert "failing" in log("bad-job")
        wait_for(lambda: held.status("held-job") is LeptonJobState.Running)
        assert log("held-job", until="started\n") == "started\n"  # a live job's, so far
        held.stop_job("held-job")
        wait_for(lambda: held.status("held-job") is LeptonJobState.Stopped)
        assert server.jobs["held-job"].processes[0].wait(5) != 0  # terminated
        gone = launch("gone-job", "sleep 60")
        wait_for(lambda: gone.status("gone-job") is LeptonJobState.Running)
        (proc,) = server.jobs["gone-job"].processes
        gone.cancel("gone-job")  # DELETE
        assert proc.wait(5) != 0
        assert host_nemo_run() == before, "the pod's /nemo_run is its own, not this machine's"
        last = launch("last-job", "sleep 60")
        wait_for(lambda: last.status("last-job") is LeptonJobState.Running)
        (proc,) = server.jobs["last-job"].processes
    assert proc.wait(10) != 0, "closing the server ends the replicas it started"
