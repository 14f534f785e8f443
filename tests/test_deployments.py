"""deployments/prefect.yaml: valid, applied by `prefect-nemo deploy`, and its event triggers chain
separately triggered experiments on a real Prefect server with a real worker and real Ray."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import psutil
import pytest
import yaml
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName
from prefect.client.schemas.objects import FlowRun, StateType

from prefect_nemo.blocks.documents import load_documents
from prefect_nemo.deployments import check_deployments, read_deployments
from prefect_nemo.errors import InvalidJobSpec
from tests.conftest import subprocess_env, wait_until

ROOT = Path(__file__).resolve().parent.parent
PREFECT_FILE = ROOT / "deployments" / "prefect.yaml"
PREFECT = str(Path(sys.executable).parent / "prefect")
COMPLETED = "prefect-nemo.experiment.completed"
T = TypeVar("T")


def _yaml() -> dict[str, Any]:
    return yaml.safe_load(PREFECT_FILE.read_text())


def _deployment(name: str) -> dict[str, Any]:
    return next(d for d in _yaml()["deployments"] if d["name"] == name)


# -- the file -------------------------------------------------------------------------------------


def test_every_entrypoint_loads_and_every_parameter_is_accepted() -> None:
    entries = read_deployments(PREFECT_FILE)
    check_deployments(entries, ROOT)  # raises with every problem listed
    names = {e.name for e in entries}
    for flow in ("demo-pipeline", "demo-data-prep", "demo-train", "demo-eval"):
        assert flow in names
    for backend in ("sft-kubeflow", "rl-with-dynamo", "serve-and-evaluate"):
        assert backend in names
    if (ROOT / "flows" / "slurm_pipeline.py").exists():
        assert any(e.entrypoint.startswith("flows/slurm_pipeline.py:") for e in entries)
    assert all(e.work_pool for e in entries), "every deployment names a work pool"


def test_schedule_triggers_and_fan_in_are_declared() -> None:
    deployments = _yaml()["deployments"]
    assert any(d.get("schedules") for d in deployments), "at least one deployment has a schedule"
    train = _deployment("demo-train")["triggers"][0]
    assert train["expect"] == [COMPLETED]
    assert train["match_related"]["prefect.resource.name"] == "demo-data-prep"
    fan_in = _deployment("serve-and-evaluate")["triggers"][0]
    assert fan_in["type"] == "compound" and fan_in["require"] == "all"
    assert len(fan_in["triggers"]) >= 2
    assert "checkpoint_uri" in fan_in["parameters"]["model_path"]


def test_saved_cluster_names_are_documents_of_blocks_yaml() -> None:
    """Every 'slug/name' cluster a deployment uses is defined in blocks/*.yaml."""
    defined = set()
    for path in (ROOT / "blocks").glob("*.yaml"):
        names = set(__import__("re").findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)", path.read_text()))
        defined |= {s.ref for s in load_documents(path, env=dict.fromkeys(names, "x"))}
    for entry in read_deployments(PREFECT_FILE):
        cluster = entry.parameters.get("cluster")
        if isinstance(cluster, str):
            assert cluster in defined, f"{entry.name}: cluster {cluster!r} is in no blocks/*.yaml"


def test_bad_entrypoints_and_parameters_are_named(tmp_path: Path) -> None:
    bad = tmp_path / "prefect.yaml"
    bad.write_text(
        yaml.safe_dump(
            {
                "deployments": [
                    {
                        "name": "typo",
                        "entrypoint": "flows/demo.py:data_prep",
                        "parameters": {"experiment": "x", "run_dri": "/tmp"},
                        "work_pool": {"name": "p"},
                    },
                    {
                        "name": "trigger-typo",
                        "entrypoint": "flows/demo.py:train",
                        "triggers": [{"type": "event", "parameters": {"checkpoint": "x"}}],
                    },
                    {"name": "gone", "entrypoint": "flows/nope.py:flow"},
                    {
                        "name": "wrong-type",
                        "entrypoint": "flows/sft_kubeflow.py:sft_kubeflow",
                        "parameters": {"cluster": "x/y", "steps": "many"},
                    },
                ]
            }
        )
    )
    with pytest.raises(InvalidJobSpec) as err:
        check_deployments(read_deployments(bad), ROOT)
    message = str(err.value)
    assert "'typo': parameters ['run_dri']" in message
    assert "'trigger-typo': triggers[0].parameters ['checkpoint']" in message
    assert "'gone': entrypoint 'flows/nope.py:flow'" in message
    assert "'wrong-type': parameters do not validate" in message and "steps" in message


# -- on a real server -----------------------------------------------------------------------------


def _wait(what: str, probe: Callable[[], T | None], timeout_s: float = 300.0) -> T:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = probe()
        if found:
            return found
        time.sleep(1.0)
    raise AssertionError(f"timed out waiting for {what}")


def _runs_of(deployment: str, **match: Any) -> list[FlowRun]:
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=[deployment]))
        )
    return [r for r in runs if all(r.parameters.get(k) == v for k, v in match.items())]


def _completed_event(experiment: str) -> dict[str, Any] | None:
    """The experiment's completed event as the server stored it (None until it has)."""
    query = {
        "filter": {
            "event": {"name": [COMPLETED]},
            "resource": {"id": [f"prefect-nemo.experiment.{experiment}"]},
        }
    }
    with get_client(sync_client=True) as client:
        events = client._client.post("/events/filter", json=query).json()["events"]
    return events[0] if events else None


def _state(run_id: Any) -> StateType | None:
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(run_id)
    if run.state_type in {StateType.FAILED, StateType.CRASHED, StateType.CANCELLED}:
        raise AssertionError(f"flow run {run.name} is {run.state_type}: {run.state.message}")
    return run.state_type


@pytest.fixture(scope="module")
def deployed(prefect_api: str, ray_head: Any) -> Iterator[str]:
    """blocks/local.yaml applied for the session's Ray head, and the file deployed."""
    env = subprocess_env(
        prefect_api, RAY_DASHBOARD_URL=ray_head.dashboard_url, RAY_AUTH_TOKEN=ray_head.token
    )
    for command in (["blocks", "apply", "blocks/local.yaml"], ["deploy"]):
        result = subprocess.run(
            [sys.executable, "-m", "prefect_nemo.cli", *command],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert ray_head.token not in result.stdout + result.stderr
    yield prefect_api
    with get_client(sync_client=True) as client:  # leave the session's server as we found it
        for deployment in client.read_deployments():
            if deployment.work_pool_name == _deployment("demo-train")["work_pool"]["name"]:
                client.delete_resource_owned_automations(f"prefect.deployment.{deployment.id}")
                client.delete_deployment(deployment.id)
        left = {a["name"] for a in client._client.post("/automations/filter", json={}).json()}
    ours = {t["name"] for d in _yaml()["deployments"] for t in d.get("triggers", [])}
    assert not left & ours


@pytest.fixture
def worker(deployed: str) -> Iterator[subprocess.Popen[bytes]]:
    """A real process worker on the jobs queue (not the serving one)."""
    pool = _deployment("demo-train")["work_pool"]
    process = subprocess.Popen(
        [
            PREFECT,
            "worker",
            "start",
            "--pool",
            pool["name"],
            "--work-queue",
            pool["work_queue_name"],
            "--type",
            "process",
        ],
        # polls every second, not Prefect's 10 s: each triggered run is picked up at once
        env=subprocess_env(deployed, PREFECT_WORKER_QUERY_SECONDS="1"),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    yield process
    # Let the flow runs it started end, then kill it: it has nothing left to finish. (On
    # SIGTERM a worker stops taking runs but waits for the ones it runs; in CI it was still
    # waiting 30 s after its last run had ended.)
    worker = psutil.Process(process.pid)
    wait_until(lambda: not worker.children(), 60)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(10)


@pytest.mark.slow
def test_deploy_is_idempotent_and_creates_the_work_pool(deployed: str) -> None:
    pool = _deployment("demo-train")["work_pool"]["name"]
    with get_client(sync_client=True) as client:
        assert client.read_work_pool(pool).type == "process"
        before = client._client.post("/automations/filter", json={}).json()
    result = subprocess.run(
        [sys.executable, "-m", "prefect_nemo.cli", "deploy", "--name", "demo-train"],
        env=subprocess_env(deployed),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    with get_client(sync_client=True) as client:
        after = client._client.post("/automations/filter", json={}).json()
        schedules = client.read_deployment_by_name("demo-pipeline/demo-pipeline").schedules
    assert sorted(a["name"] for a in after) == sorted(a["name"] for a in before)
    assert schedules and schedules[0].schedule.cron == "0 2 * * *"


@pytest.mark.slow
def test_completed_experiments_trigger_their_downstream_with_their_outputs(
    worker: subprocess.Popen[bytes], tmp_path: Path
) -> None:
    """data-prep, started from the API, triggers train (its run dir and flow run passed on), train
    triggers eval; serve-and-evaluate (fan-in) starts only once train AND eval completed, with
    the checkpoint from train's event payload."""
    from prefect.deployments import run_deployment

    experiment = f"chain-{uuid.uuid4().hex[:6]}"
    run_dir = str(tmp_path / "run")
    prep = run_deployment(
        "demo-data-prep/demo-data-prep",
        parameters={"experiment": experiment, "run_dir": run_dir},
        timeout=0,
    )

    train = _wait("the triggered train run", lambda: _runs_of("demo-train", run_dir=run_dir))[0]
    assert train.parameters["experiment"] == f"{experiment}-train"
    assert train.parameters["depends_on"] == [str(prep.id)]
    assert train.parameters["cluster"] == "ray-jobs-cluster/local"  # the deployment's own
    assert _state(prep.id) == StateType.COMPLETED or _wait(
        "data-prep completed", lambda: _state(prep.id) == StateType.COMPLETED
    )

    evaluate = _wait("the triggered eval run", lambda: _runs_of("demo-eval", run_dir=run_dir))[0]
    assert evaluate.parameters["experiment"] == f"{experiment}-train-eval"
    assert evaluate.parameters["depends_on"] == [str(train.id)]
    _wait("train completed", lambda: _state(train.id) == StateType.COMPLETED)
    checkpoint = _wait("train's event", lambda: _completed_event(f"{experiment}-train"))["payload"][
        "checkpoint_uri"
    ]
    # Fan-in: train has completed, eval is still running its jobs: nothing may serve yet.
    assert not _runs_of("serve-and-evaluate", model_path=checkpoint), "fan-in fired early"

    serve = _wait(
        "the fan-in serve run", lambda: _runs_of("serve-and-evaluate", model_path=checkpoint)
    )
    eval_done = _wait("eval's event", lambda: _completed_event(f"{experiment}-train-eval"))
    assert serve[0].created >= datetime.fromisoformat(eval_done["occurred"])
    assert len(serve) == 1
    assert serve[0].parameters["replicas"] == 2
    assert Path(checkpoint).is_file() and checkpoint.startswith(run_dir)
    with get_client(sync_client=True) as client:  # nothing here runs the serving queue
        client.delete_flow_run(serve[0].id)


def test_deploy_refuses_unknown_names_before_touching_the_server() -> None:
    from prefect_nemo.deployments import deploy

    with pytest.raises(InvalidJobSpec, match=r"--name: no deployment \['nope'\].*demo-train"):
        deploy(PREFECT_FILE, names=["nope"], api_url="http://127.0.0.1:9/api", root=ROOT)
