"""The "SFT on Kubeflow Trainer" flow end to end: a real Prefect API, the loopback Kubernetes
API server (strict CRD validation) and the TrainJob simulator running the shipped code in real
local processes (torchrun stand-in, ConfigMap volumes as files)."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import SecretStr

from flows.sft_kubeflow import sft_kubeflow
from prefect_nemo import JobFailed, JobStopped, JobTimedOut
from prefect_nemo.kube import CONFIGMAP, POD, SECRET, TRAIN_JOB

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trainer(kube_server: Any) -> Iterator[Any]:
    from prefect_nemo.testing.operators import TrainJobSimulator

    with TrainJobSimulator(kube_server) as sim:
        yield sim


@pytest.fixture
def env(kube_server: Any, trainer: Any, prefect_api: str) -> dict[str, Any]:
    """The server, simulator, a Kubernetes block and a unique experiment name."""
    from prefect_nemo.blocks.kubernetes import KubernetesCluster

    kube = KubernetesCluster(kubeconfig=kube_server.kubeconfig())
    return {"server": kube_server, "sim": trainer, "kube": kube, "api": kube.api(),
            "experiment": f"sft-{uuid.uuid4().hex[:6]}"}  # fmt: skip


def block(env: dict[str, Any], **kw: Any) -> Any:
    from prefect_nemo.blocks import KubeflowTrainerCluster

    kw.setdefault("image", "nvcr.io/nvidia/pytorch:25.01-py3")
    return KubeflowTrainerCluster(kubernetes=env["kube"], max_poll_interval_s=0.5, **kw)


def mine(env: dict[str, Any], kind: Any) -> list[dict[str, Any]]:
    items, _ = env["api"].list(kind)
    return [o for o in items if o["metadata"]["name"].startswith(env["experiment"])]


def pod_log(server: Any, pod: str) -> str:
    """A pod's `node` container log, read through the API like kubectl logs."""
    from kubernetes import client

    core = client.CoreV1Api(server.api_client())
    return core.read_namespaced_pod_log(pod, "default", container="node")


def wait_until(predicate: Any, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return bool(predicate())


def test_success_ships_the_code_and_streams_real_logs(env: dict[str, Any], caplog: Any) -> None:
    secret = f"hf_{uuid.uuid4().hex}"
    caplog.set_level("INFO")
    out = sft_kubeflow(cluster=block(env), experiment=env["experiment"], steps=60,
                       secrets={"HF_TOKEN": SecretStr(secret)}, env={"MODE": "sft"})  # fmt: skip
    assert out["state"] == "SUCCEEDED" and not out["attached"]
    logged = caplog.text
    assert "sft: rank 0 done: final loss" in logged, "node-0's real log reached the run logger"
    (tj,) = mine(env, TRAIN_JOB)
    assert tj["metadata"]["name"] == out["job_id"]
    assert tj["spec"]["trainer"]["command"][-1].splitlines()[-1].startswith("torchrun ")
    cms = mine(env, CONFIGMAP)
    assert cms and all(c["metadata"]["ownerReferences"][0]["uid"] == tj["metadata"]["uid"]
                       for c in cms)  # fmt: skip
    (stored,) = mine(env, SECRET)
    stored_tj = env["server"].get("trainjobs", "default", out["job_id"], "trainer.kubeflow.org",
                                  version="v1alpha1")  # fmt: skip
    assert stored_tj is not None
    everything = json.dumps([tj, cms, stored_tj])
    assert secret not in everything and secret not in logged  # fmt: skip
    assert stored["metadata"]["ownerReferences"][0]["uid"] == tj["metadata"]["uid"]


def test_secret_reaches_no_log_event_artifact_or_object(env: dict[str, Any], caplog: Any,
                                                        tmp_path: Any) -> None:  # fmt: skip
    """The job prints its secret and fails: Prefect's logs, events, artifacts and state, and
    every object we created, stay free of it; the job still got the value (via the Secret)."""
    import httpx
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterId,
        LogFilter,
        LogFilterFlowRunId,
    )
    from prefect.settings import PREFECT_API_URL

    secret = f"hf_{uuid.uuid4().hex}"
    (tmp_path / "sft.py").write_text(
        "import os, sys\nprint('token is', os.environ['HF_TOKEN'], flush=True)\nsys.exit(4)\n"
    )
    since = time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(time.time() - 5))
    state = sft_kubeflow(cluster=block(env), experiment=env["experiment"], code_dir=str(tmp_path),
                         secrets={"HF_TOKEN": SecretStr(secret)}, return_state=True)  # fmt: skip
    with pytest.raises(JobFailed) as info:
        state.result()
    assert "token is **********" in str(info.value), "the job had the value; we masked it"
    job_id = info.value.result.handle.job_id
    flow_run_id = state.state_details.flow_run_id
    api_url = str(PREFECT_API_URL.value())
    haystacks = {"exception": str(info.value) + repr(info.value.result), "caplog": caplog.text}
    with get_client(sync_client=True) as client:
        for _ in range(60):  # Prefect ships logs and events in the background
            logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
            haystacks["prefect logs"] = "\n".join(log.message for log in logs)
            body = {"filter": {"occurred": {"since": since},
                               "related": {"id": [f"prefect.flow-run.{flow_run_id}"]}},
                    "limit": 50}  # fmt: skip
            haystacks["events"] = httpx.post(f"{api_url}/events/filter", json=body).text
            if "token is" in haystacks["prefect logs"] and "job.failed" in haystacks["events"]:
                break
            time.sleep(0.5)
        artifacts = client.read_artifacts(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        )
        haystacks["artifacts"] = json.dumps([a.model_dump(mode="json") for a in artifacts])
        haystacks["flow run"] = client.read_flow_run(flow_run_id).model_dump_json()
    haystacks["objects"] = json.dumps([mine(env, k) for k in (TRAIN_JOB, CONFIGMAP, POD)])
    assert "token is" in haystacks["prefect logs"] and "job.failed" in haystacks["events"]
    assert job_id in haystacks["objects"]
    for where, text in haystacks.items():
        assert secret not in text, f"the secret leaked into {where}"
        assert env["server"].token not in text, f"the API token leaked into {where}"


def test_failure_has_the_log_tail(env: dict[str, Any]) -> None:
    with pytest.raises(JobFailed) as info:
        sft_kubeflow(cluster=block(env), experiment=env["experiment"],
                     extra_args=["--fail-at-step", "5"])  # fmt: skip
    assert "giving up at step 5" in str(info.value)
    assert info.value.result.exit_code == 3
    assert "FailedJobs" in info.value.result.message


def test_rerun_attaches_to_the_same_trainjob(env: dict[str, Any]) -> None:
    cluster = block(env)
    first = sft_kubeflow(cluster=cluster, experiment=env["experiment"], steps=10)
    second = sft_kubeflow(cluster=cluster, experiment=env["experiment"], steps=10)
    assert second["attached"] and second["job_id"] == first["job_id"]
    assert [o["metadata"]["name"] for o in mine(env, TRAIN_JOB)] == [first["job_id"]]


def test_timeout_deletes_the_trainjob_and_what_it_owns(env: dict[str, Any]) -> None:
    with pytest.raises(JobTimedOut) as info:
        sft_kubeflow(cluster=block(env, num_nodes=2), experiment=env["experiment"],
                     steps=100_000, extra_args=["--step-delay-s", "0.05"], timeout_s=4,
                     secrets={"TOKEN": SecretStr("x" * 20)})  # fmt: skip
    job_id = info.value.result.handle.job_id
    assert info.value.result.state.value == "STOPPED"
    assert mine(env, TRAIN_JOB) == [] and mine(env, CONFIGMAP) == [] and mine(env, SECRET) == []
    assert wait_until(lambda: not env["sim"].local_pids(job_id), 10), "local processes remain"


def test_cancel_through_the_api_stops_the_job(env: dict[str, Any]) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
    from prefect.states import Cancelling

    raised: list[BaseException | None] = [None]

    def target() -> None:
        try:
            sft_kubeflow(cluster=block(env), experiment=env["experiment"], steps=100_000,
                         extra_args=["--step-delay-s", "0.05"])  # fmt: skip
        except BaseException as exc:
            raised[0] = exc

    thread = threading.Thread(target=target)
    thread.start()

    def running() -> bool:
        pods = mine(env, POD)
        return bool(pods) and pods[0].get("status", {}).get("phase") == "Running"

    assert wait_until(running, 60)
    (pod,) = mine(env, POD)
    job_id = pod["metadata"]["labels"]["jobset.sigs.k8s.io/jobset-name"]
    with get_client(sync_client=True) as client:
        (flow_run,) = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[env["experiment"]]))
        )
        client.set_flow_run_state(flow_run.id, Cancelling(), force=True)
    thread.join(90)
    assert not thread.is_alive(), "the flow did not notice the cancellation"
    assert isinstance(raised[0], JobStopped), raised[0]
    assert mine(env, TRAIN_JOB) == [] and mine(env, CONFIGMAP) == []
    assert wait_until(lambda: not env["sim"].local_pids(job_id), 10)


def test_two_nodes_reassemble_the_code(env: dict[str, Any], tmp_path: Any) -> None:
    """Two pods each unpack the ConfigMap parts (several: small chunks) and run two ranks."""
    code = tmp_path / "code"
    (code / "sftlib").mkdir(parents=True)
    (code / "sftlib" / "__init__.py").write_text("")
    (code / "sftlib" / "blob.bin").write_bytes(os.urandom(40_000))  # forces several parts
    (code / "sft.py").write_text(
        "import hashlib, os, pathlib\n"
        "blob = pathlib.Path('sftlib/blob.bin').read_bytes()\n"
        # One write per line: the node's ranks share the pod's stdout, unbuffered.
        "os.write(1, f\"node {os.environ['PET_NODE_RANK']} rank {os.environ['RANK']} of"
        " {os.environ['WORLD_SIZE']} blob {hashlib.sha256(blob).hexdigest()[:12]}\\n\".encode())\n"
    )
    digest = hashlib.sha256((code / "sftlib" / "blob.bin").read_bytes()).hexdigest()[:12]
    out = sft_kubeflow(cluster=block(env, num_nodes=2, procs_per_node=2, code_chunk_bytes=16_000),
                       experiment=env["experiment"], code_dir=str(code))  # fmt: skip
    assert out["state"] == "SUCCEEDED"
    assert len(mine(env, CONFIGMAP)) >= 3
    logs = {}
    for pod in mine(env, POD):
        index = pod["metadata"]["labels"]["batch.kubernetes.io/job-completion-index"]
        logs[index] = pod_log(env["server"], pod["metadata"]["name"])
    assert f"node 0 rank 0 of 4 blob {digest}" in logs["0"] and "rank 1 of 4" in logs["0"]
    assert f"node 1 rank 2 of 4 blob {digest}" in logs["1"] and "rank 3 of 4" in logs["1"]


def test_gpu_nodes_run_end_to_end_on_the_simulator(env: dict[str, Any]) -> None:
    """The TrainJob's `resourcesPerNode.limits["nvidia.com/gpu"]` is an integer (valid for the
    CRD's int-or-string quantities and for a real cluster, whose controllers write the pods'
    quantities as strings): the SFT flow with GPUs per node runs to the end, one torchrun
    process per GPU on each node, and every node pod asks for its GPUs."""
    out = sft_kubeflow(cluster=block(env, num_nodes=2, gpus_per_node=2),
                       experiment=env["experiment"], steps=20, timeout_s=120)  # fmt: skip
    assert out["state"] == "SUCCEEDED"
    (tj,) = mine(env, TRAIN_JOB)
    assert tj["spec"]["trainer"]["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == 2
    assert tj["spec"]["trainer"]["numProcPerNode"] == 2
    pods = mine(env, POD)
    assert len(pods) == 2
    for pod in pods:
        (node,) = [c for c in pod["spec"]["containers"] if c["name"] == "node"]
        assert node["resources"]["limits"]["nvidia.com/gpu"] == "2"
        assert "/4 on node" in pod_log(env["server"], pod["metadata"]["name"])  # 2 x 2 ranks
