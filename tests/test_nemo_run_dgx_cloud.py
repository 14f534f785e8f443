"""The DGX Cloud (run:ai) backend against the loopback run:ai server, NeMo-Run unchanged.

The server runs each pod's command as a local process (``execute=True``) with the PVC on a
local directory, so code shipped in env-var chunks is really unpacked behind the rank-0 gate
and really runs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import subprocess
import time
import traceback
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import psutil
import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterId,
    LogFilter,
    LogFilterFlowRunId,
)
from pydantic import SecretStr

from prefect_nemo import lifecycle
from prefect_nemo.backends.nemo_run.isolation import home_files
from prefect_nemo.blocks.dgx_cloud import DGXCloudCluster
from prefect_nemo.errors import AuthenticationFailed, InvalidJobSpec
from prefect_nemo.jobs import JobSpec, JobState, Resources
from prefect_nemo.packaging import TransportTooLarge
from prefect_nemo.placement import PlacementSpec
from prefect_nemo.tasks import run_job
from prefect_nemo.testing.runai import RunaiServer

pytestmark = pytest.mark.nemo_run

SECRET = "dgx-" + "c11e47-5ecret-9b2f"


def sample_source(root: Path, blob_bytes: int = 30_000) -> Path:
    """A small project: a package, a script that uses it, an incompressible blob."""
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("VALUE = 42\n")
    (root / "train.py").write_text("import pkg\nprint('value', pkg.VALUE, flush=True)\n")
    (root / "pkg" / "blob.bin").write_bytes(os.urandom(blob_bytes))
    return root


def wait_for(check: Any, timeout_s: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


def prefect_haystacks(prefect_api: str, flow_run_id: Any, since: str, until: str) -> dict[str, str]:
    """Everything Prefect holds about a flow run: logs (once `until` shows), artifacts, state,
    events."""
    out: dict[str, str] = {}
    with get_client(sync_client=True) as client:
        for _ in range(60):  # logs ship in the background
            logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
            out["prefect logs"] = "\n".join(log.message for log in logs)
            if until in out["prefect logs"]:
                break
            time.sleep(0.5)
        artifacts = client.read_artifacts(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        )
        out["artifacts"] = json.dumps([a.model_dump(mode="json") for a in artifacts])
        out["flow run"] = client.read_flow_run(flow_run_id).model_dump_json()
    for _ in range(40):  # events land asynchronously
        body = {
            "filter": {
                "occurred": {"since": since},
                "related": {"id": [f"prefect.flow-run.{flow_run_id}"]},
            },
            "limit": 50,
        }
        out["events"] = httpx.post(f"{prefect_api}/events/filter", json=body).text
        if (
            "prefect-nemo.job.succeeded" in out["events"]
            or "prefect-nemo.job.failed" in out["events"]
        ):
            break
        time.sleep(0.5)
    return out


def files_text(*roots: Path) -> str:
    """All files under `roots`, as text (zlib/base64 records included, decoded as found)."""
    texts = []
    for root in roots:  # os.walk, and a file that vanished skipped: other workers share homes
        for top, _, names in os.walk(root):
            for name in names:
                with contextlib.suppress(FileNotFoundError):
                    texts.append(Path(top, name).read_bytes().decode(errors="ignore"))
    return "\n".join(texts)


def open_connections(url: str) -> int:
    """This process's established TCP connections to the server at `url`."""
    port = urlsplit(url).port
    return sum(
        1
        for c in psutil.Process().net_connections(kind="tcp")
        if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
    )


@pytest.fixture
def runai() -> Iterator[RunaiServer]:
    with RunaiServer(
        client_secret=SECRET, creating_s=0.05, initializing_s=0.05, running_s=0.3, execute=True
    ) as server:
        yield server


def cluster_block(runai: RunaiServer, pvc: Path | str, **extra: Any) -> DGXCloudCluster:
    """A DGXCloudCluster block on the loopback run:ai, its PVC mounted at `pvc` in the pods."""
    return DGXCloudCluster(
        base_url=runai.base_url,
        client_id=runai.client_id,
        client_secret=runai.client_secret,
        project_name="nemo-project",
        pvc_nemo_run_dir=f"{pvc}/nemo-run",
        pvcs=[{"path": str(pvc), "claimName": "nemo-pvc", "existingPvc": True}],
        **{"stop_timeout_s": 10, "max_poll_interval_s": 0.2, **extra},
    )


@pytest.fixture
def block(runai: RunaiServer, tmp_path: Path) -> DGXCloudCluster:
    pvc = tmp_path / "pvc"
    pvc.mkdir()  # the PVC, mounted here (the pods run here too)
    return cluster_block(runai, pvc, gpus_per_node=1)


def workload_posts(runai: RunaiServer) -> list[Any]:
    return runai.requests.find("POST", "/workloads/trainings") + runai.requests.find(
        "POST", "/workloads/distributed"
    )


@pytest.mark.slow
def test_run_job_on_dgx_cloud_through_prefect(
    prefect_api: str,
    runai: RunaiServer,
    block: DGXCloudCluster,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    caplog.set_level(logging.DEBUG)
    since = datetime.now(UTC).isoformat()
    src = sample_source(tmp_path / "src")
    spec = JobSpec(
        entrypoint="python3 train.py",
        name="dgx-train",
        working_dir=src,
        placement=PlacementSpec(nodes=2, gpus_per_node=0, strategy="spread"),  # CPU-only, 2 pods
        env={"MODE": "test"},
    )

    @flow
    def train():
        return run_job(spec, cluster=block)

    state = train(return_state=True)
    result = state.result()
    assert result.state is JobState.SUCCEEDED and not result.attached
    assert block.backend().logs(result.handle.job_id).count("value 42") == 2  # two pods' logs

    (post,) = workload_posts(runai)
    assert post.path == "/api/v1/workloads/distributed"
    sent = post.body["spec"]
    assert sent["compute"]["gpuDevicesRequest"] == 0 and sent["numWorkers"] == 2
    assert post.body["name"] == result.handle.job_id  # run:ai adds its suffix to it
    env = {e["name"]: e["value"] for e in sent["environmentVariables"]}
    chunks = int(env["PREFECT_NEMO_CODE_CHUNKS"])
    assert chunks >= 4 and env["MODE"] == "test"
    assert max(len(v) for v in env.values()) <= 9 * 1024 < 10_000
    assert len(sent["args"]) < 9_500
    (workload,) = runai.workloads.values()
    assert [p.returncode for p in workload.processes] == [0, 0]  # both pods ran the code

    haystacks = prefect_haystacks(prefect_api, state.state_details.flow_run_id, since, "SUCCEEDED")
    haystacks.update(
        {
            "caplog": caplog.text,
            "stdout/stderr": "".join(capfd.readouterr()),
            "result": result.model_dump_json(),
            "NEMORUN_HOME": files_text(*{p.parent for p in home_files()}),
            "pvc": files_text(tmp_path / "pvc"),
            "block": repr(block) + block.model_dump_json(),
        }
    )
    assert "prefect-nemo.job.succeeded" in haystacks["events"]
    assert "value 42" in haystacks["prefect logs"]  # the pods' output streamed into Prefect
    # NeMo-Run's torchx DGX scheduler would have written the executor (secret included) here
    assert not [p for p in home_files() if p.name == ".dgx_jobs.json"]
    tokens = runai.issued_tokens
    assert tokens
    for where, text in haystacks.items():
        for secret in (SECRET, *tokens):
            assert secret not in text, f"a secret leaked into {where}"


def test_rerun_attaches_and_a_new_run_does_not_collide(
    runai: RunaiServer, block: DGXCloudCluster, tmp_path: Path
) -> None:
    runai.hold("")  # every workload runs until suspended
    backend = block.backend()
    spec = JobSpec(entrypoint="sleep 30", name="train")
    first = lifecycle.submit_or_attach(backend, spec, scope="flow-run:a", key="train")
    again = lifecycle.submit_or_attach(backend, spec, scope="flow-run:a", key="train")
    other = lifecycle.submit_or_attach(backend, spec, scope="flow-run:b", key="train")
    assert not first.attached and again.attached
    assert again.handle.job_id == first.handle.job_id != other.handle.job_id
    assert len(workload_posts(runai)) == 2

    # Another machine (no local record) finds the job by name and attaches too.
    backend.release(first.handle.job_id)
    elsewhere = lifecycle.submit_or_attach(block.backend(), spec, scope="flow-run:a", key="train")
    assert elsewhere.attached and len(workload_posts(runai)) == 2
    for sub in (first, other):
        lifecycle.stop_and_confirm(backend, sub.handle.job_id, timeout_s=10)


def test_stop_sends_the_documented_suspend(runai: RunaiServer, block: DGXCloudCluster) -> None:
    runai.hold("")
    backend = block.backend()
    spec = JobSpec(entrypoint="sleep 30", name="held")
    sub = lifecycle.submit_or_attach(backend, spec, scope="flow-run:stop", key="held")
    job_id = sub.handle.job_id
    wait_for(lambda: backend.find(job_id).state is JobState.RUNNING)
    final = lifecycle.stop_and_confirm(backend, job_id, timeout_s=10, poll_s=0.05)
    assert final is not None and final.state is JobState.STOPPED
    (workload,) = runai.workloads.values()
    suspends = runai.requests.find(None, "/suspend")
    assert suspends and all(
        (r.method, r.path) == ("POST", f"/api/v1/workloads/trainings/{workload.id}/suspend")
        for r in suspends
    )
    assert workload.processes[0].wait(5) != 0  # the pod's process was really ended


def test_a_failing_job_is_failed_and_retried_under_a_new_id(
    runai: RunaiServer, block: DGXCloudCluster
) -> None:
    backend = block.backend()
    spec = JobSpec(entrypoint="echo broken >&2; exit 7", name="fails")
    first = lifecycle.submit_or_attach(backend, spec, scope="flow-run:f", key="fails")
    wait_for(lambda: backend.find(first.handle.job_id).state is JobState.FAILED)
    retry = lifecycle.submit_or_attach(backend, spec, scope="flow-run:f", key="fails")
    assert retry.handle.job_id == first.handle.job_id + "-r1" and not retry.attached


def test_token_expiry_is_refreshed_once(runai: RunaiServer, block: DGXCloudCluster) -> None:
    backend = block.backend()
    backend.check_access()
    sub = lifecycle.submit_or_attach(
        backend, JobSpec(entrypoint="true", name="t"), scope="flow-run:t", key="t"
    )
    issued = len(runai.issued_tokens)
    runai.expire_tokens()
    assert backend.find(sub.handle.job_id) is not None
    assert len(runai.issued_tokens) == issued + 1  # one refresh, then the call went through
    statuses = [r.status for r in runai.requests.find("GET", "/workloads/trainings/")]
    assert statuses[-2:] == [401, 200]
    assert backend.find(sub.handle.job_id) is not None
    assert len(runai.issued_tokens) == issued + 1  # the new token is reused


def test_bad_credentials_and_project_are_clear_errors(
    runai: RunaiServer, block: DGXCloudCluster
) -> None:
    wrong = block.model_copy(update={"client_secret": SecretStr("not-" + SECRET)})
    started = time.monotonic()
    with pytest.raises(AuthenticationFailed) as info:
        wrong.backend().check_access()
    assert time.monotonic() - started < 5  # no NeMo-Run 3 x 10 s retry
    text = "".join(traceback.format_exception(info.value))
    assert "DGXCloudCluster.client_secret" in text and SECRET not in text
    with pytest.raises(InvalidJobSpec, match=r"project_name.*nemo-project"):
        block.model_copy(update={"project_name": "nope"}).backend().check_access()
    assert not workload_posts(runai)


def test_bad_specs_are_refused_before_submit(
    runai: RunaiServer, block: DGXCloudCluster, tmp_path: Path
) -> None:
    backend = block.backend()
    big = sample_source(tmp_path / "big", blob_bytes=1_200_000)
    with pytest.raises(TransportTooLarge, match="dgx_cloud transport"):
        backend.validate(JobSpec(entrypoint="python3 train.py", working_dir=big))
    with pytest.raises(InvalidJobSpec, match=r"JobSpec.env\['BIG'\]"):
        backend.validate(JobSpec(entrypoint="true", env={"BIG": "x" * 10_001}))
    with pytest.raises(InvalidJobSpec, match="secret_env"):
        backend.validate(JobSpec(entrypoint="true", env={"KEY": SecretStr("s3cr3t-value")}))
    with pytest.raises(InvalidJobSpec, match=r"JobSpec\.entrypoint"):
        backend.validate(JobSpec(entrypoint="echo " + "y" * 9_500))
    with pytest.raises(InvalidJobSpec, match="runtime_env"):
        backend.validate(JobSpec(entrypoint="true", runtime_env={"pip": ["x"]}))
    with pytest.raises(InvalidJobSpec, match=r"JobSpec\.resources\.gpus=0\.5.*whole GPUs"):
        backend.validate(JobSpec(entrypoint="true", resources=Resources(gpus=0.5)))
    assert not runai.requests.find("POST", "/workloads")


def test_concurrent_submits_never_log_the_payload(
    runai: RunaiServer, block: DGXCloudCluster, caplog: pytest.LogCaptureFixture
) -> None:
    """NeMo-Run logs each workload payload at INFO: a filter drops it for every submit at once,
    without touching the logger's level (which two submits would race on)."""
    from prefect_nemo.backends.nemo_run.dgx_cloud import _NOISY, _DropPayloads

    caplog.set_level(logging.DEBUG)
    noisy = logging.getLogger(_NOISY)
    level = noisy.level
    backend = block.backend()
    markers = [f"payload-marker-{i}-{uuid.uuid4().hex}" for i in range(4)]

    def submit(i: int) -> None:
        spec = JobSpec(entrypoint="true", name=f"c{i}", env={"VALUE": markers[i]})
        lifecycle.submit_or_attach(backend, spec, scope=f"flow-run:c{i}", key="c")

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(submit, range(4)))
    assert len(workload_posts(runai)) == 4
    for marker in markers:
        assert marker not in caplog.text
        assert any(marker in json.dumps(p.body) for p in workload_posts(runai))
    assert noisy.level == level
    assert sum(isinstance(f, _DropPayloads) for f in noisy.filters) == 1
    noisy.info("outside a submit")  # the logger itself stays usable
    assert "outside a submit" in caplog.text
    backend.close()
    backend.close()  # idempotent


def test_secret_env_goes_as_a_reference(runai: RunaiServer, block: DGXCloudCluster) -> None:
    backend = block.model_copy(update={"secret_env": {"WANDB_API_KEY": "wandb/api-key"}}).backend()
    lifecycle.submit_or_attach(
        backend, JobSpec(entrypoint="true", name="s"), scope=f"flow-run:{uuid.uuid4()}", key="s"
    )
    (post,) = workload_posts(runai)
    envs = post.body["spec"]["environmentVariables"]
    assert {"name": "WANDB_API_KEY", "secret": {"name": "wandb", "key": "api-key"}} in envs


@pytest.mark.slow
def test_ray_on_dgx_cloud_is_a_bootstrapped_distributed_workload(
    prefect_api: str, block: DGXCloudCluster, tmp_path: Path
) -> None:
    """NeMo-Run's DGXCloudRayJob: a script-deploy workspace puts the Ray bootstrap on the PVC,
    then a distributed workload runs it. Ray itself is not started here (its `ray stop` would
    end every Ray on this machine): the deploy command is run for real, the phases simulated."""
    from prefect_nemo.blocks.dgx_cloud import DGXCloudRayCluster

    with RunaiServer(
        client_secret=SECRET, creating_s=0.05, initializing_s=0.05, running_s=0.5
    ) as server:
        cluster = block.model_copy(update={"base_url": server.base_url, "nodes": 2})
        backend = DGXCloudRayCluster(cluster=cluster).backend()
        server.hold("grpo")  # the Ray workload runs until stopped; the deploy workspace ends
        src = sample_source(tmp_path / "src")
        spec = JobSpec(entrypoint="python3 grpo.py", name="grpo", working_dir=src)
        backend.validate(spec)
        first = lifecycle.submit_or_attach(backend, spec, scope="flow-run:ray", key="grpo")
        again = lifecycle.submit_or_attach(backend, spec, scope="flow-run:ray", key="grpo")
        assert not first.attached and again.attached
        job_id = first.handle.job_id

        (deploy,) = server.requests.find("POST", "/workloads/workspaces")
        assert deploy.body["name"] == "script-deploy" and len(deploy.body["spec"]["args"]) < 9_500
        pvc_script = Path(cluster.pvc_nemo_run_dir) / f"ray_bootstrap_{job_id}.sh"
        ran = subprocess.run(
            ["sh", "-c", shlex.split(deploy.body["spec"]["args"])[0]], capture_output=True
        )
        assert ran.returncode == 0, ran.stderr
        script = pvc_script.read_text()
        assert "ray start --head" in script and "python3 grpo.py" in script
        assert "PREFECT_NEMO_CODE_" in script  # the head unpacks the code first

        (post,) = server.requests.find("POST", "/workloads/distributed")
        sent = post.body["spec"]
        assert sent["command"] == f"/bin/bash {pvc_script}" and sent["numWorkers"] == 2
        env = {e["name"]: e["value"] for e in sent["environmentVariables"]}
        assert max(len(v) for v in env.values()) <= 9 * 1024 and "PREFECT_NEMO_CODE_0" in env

        wait_for(lambda: backend.find(job_id).state is JobState.RUNNING)
        final = lifecycle.stop_and_confirm(backend, job_id, timeout_s=10, poll_s=0.05)
        assert final is not None and final.state is JobState.STOPPED
        (workload,) = [w for w in server.workloads.values() if w.kind == "distributed"]
        assert server.requests.find("POST", f"/workloads/distributed/{workload.id}/suspend")

        @flow
        def rl():
            return run_job(JobSpec(entrypoint="python3 eval.py", name="eval"), ray_block)

        ray_block = DGXCloudRayCluster(cluster=cluster, max_poll_interval_s=0.2)
        result = rl()  # through Prefect's task: deploy, workload, phases to Completed
        assert result.state is JobState.SUCCEEDED and result.handle.backend == "dgx-cloud-ray"


def assert_close_ends_connections(backend: Any, url: str) -> None:
    """backend.close() ends its pooled connections to `url`, and a second close is harmless."""
    backend.check_access()
    assert open_connections(url) >= 1
    backend.close()
    backend.close()
    wait_for(lambda: open_connections(url) == 0)


def test_close_ends_the_client_connections(runai: RunaiServer, block: DGXCloudCluster) -> None:
    """close() closes the run:ai client's pooled connections; workloads are left alone."""
    assert_close_ends_connections(block.backend(), runai.base_url)


def test_without_the_pvc_the_task_says_once_where_the_log_is_and_how_to_follow_it(
    prefect_api: str, tmp_path: Path
) -> None:
    """Issue 14 item 8: "DGX Cloud logs: fetched through the run:ai API when the PVC is not
    mounted locally; where that is impossible, the task says so once, with the fix, instead of
    staying silent." run:ai's REST API has no workload log endpoint (its OpenAPI lists pods and
    pod metrics only; NeMo-Run's `fetch_logs` says "Logs are available in the Run:AI UI"): the
    pods write their log to the PVC, so without the PVC mounted the task says so, once."""
    with RunaiServer(client_secret=SECRET, running_s=0.5) as runai:
        pvc = f"/prefect-nemo-pvc-{uuid.uuid4().hex[:8]}"  # mounted in the pods, not here
        block = cluster_block(runai, pvc)
        since = datetime.now(UTC).isoformat()

        @flow
        def train():
            return run_job(JobSpec(entrypoint="python3 train.py", name="far"), cluster=block)

        state = train(return_state=True)
        result = state.result()
        assert result.state is JobState.SUCCEEDED
        logs = prefect_haystacks(prefect_api, state.state_details.flow_run_id, since, "SUCCEEDED")
        said = logs["prefect logs"].count("cannot be read from this machine")
        assert said == 1, logs["prefect logs"]
        notice = block.backend().logs(result.handle.job_id)
        assert "run:ai's REST API serves no workload logs" in notice
        assert f"{pvc}/nemo-run (DGXCloudCluster.pvc_nemo_run_dir)" in notice  # the fix
        assert notice in logs["prefect logs"]
