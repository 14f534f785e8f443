"""NeMo-Run tasks as job definitions (issue 15): one run.Partial of one small real function
(numpy work that writes a file and prints a metric, tests/nemo_task_code/metric_task.py), run
unchanged on every backend; its identity from its configuration; bad tasks refused before submit;
its secrets kept out of everything we write."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import uuid
import zlib
from pathlib import Path
from typing import Any

import pytest
from prefect import flow
from pydantic import SecretStr

from prefect_nemo import InvalidJobSpec, JobSpec, JobState, run_job
from prefect_nemo.backends.nemo_run.local import NemoRunLocalBackend
from prefect_nemo.blocks.base import ClusterBlock
from tests.conftest import jobs_of_run, wait_until

CODE = Path(__file__).parent / "nemo_task_code"
CANARY = "canary-task-secret-5d09e1"
BACKENDS = ["ray-jobs", "nemo-run-local", "slurm", "kuberay", "kubeflow", "lepton", "dgx-cloud"]

pytestmark = pytest.mark.nemo_run


@pytest.fixture(scope="module")
def trainer(kube_server: Any) -> Any:
    """The Kubeflow Trainer + JobSet simulator."""
    from prefect_nemo.testing.operators import TrainJobSimulator

    with TrainJobSimulator(kube_server) as sim:
        yield sim


@pytest.fixture
def _stack() -> Any:
    """Loopback servers a test starts on demand, stopped when it ends."""
    import contextlib

    with contextlib.ExitStack() as stack:
        yield stack


@pytest.fixture
def metric(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The task's module, imported from CODE as the job imports it (working_dir=CODE); nemo_run
    first imported through prefect-nemo, which keeps its NEMORUN_HOME isolated."""
    from prefect_nemo.backends.nemo_run.isolation import nemo_run

    nemo_run()
    monkeypatch.syspath_prepend(str(CODE))
    import metric_task

    return metric_task


class NemoRunLocalTasks(ClusterBlock):
    """Test block: NeMo-Run's LocalExecutor; NeMo-Run's runner runs this env's python."""

    _block_type_slug = "test-nemo-run-local-tasks"

    def backend(self) -> NemoRunLocalBackend:
        """The local backend, this interpreter first on PATH."""
        path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        return NemoRunLocalBackend(env={"PATH": path})


def _block(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    """The cluster block of `backend`; only its own fixtures are started (the loopback Lepton
    and run:ai servers stay up until the test ends)."""
    if backend == "ray-jobs":
        return request.getfixturevalue("ray_head").block()
    if backend == "nemo-run-local":
        return NemoRunLocalTasks(max_poll_interval_s=0.5)
    if backend == "kuberay":
        from prefect_nemo.backends.kuberay import ensure_ray_cluster, wait_ray_cluster_ready
        from prefect_nemo.blocks import KubeRayCluster
        from tests.test_kuberay import cluster_spec

        request.getfixturevalue("kuberay")  # the operator simulator, backed by the real Ray
        kube = request.getfixturevalue("kube_block")
        ensure_ray_cluster(kube.api(), cluster_spec(), "tasks")
        wait_ray_cluster_ready(kube.api(), "tasks", timeout_s=60)
        token = request.getfixturevalue("ray_head").token
        return KubeRayCluster(kubernetes=kube, ray_token=token, ray_cluster_name="tasks")
    if backend == "lepton":
        from prefect_nemo.testing.lepton import LeptonServer
        from tests.test_nemo_run_lepton import workspace_block

        lepton = request.getfixturevalue("_stack").enter_context(
            LeptonServer(token="lep-" + uuid.uuid4().hex[:12], start_s=0.1, running_s=0.4)
        )
        request.node.lepton = lepton
        return workspace_block(lepton, tmp_path)
    if backend == "dgx-cloud":
        from prefect_nemo.testing.runai import RunaiServer
        from tests.test_nemo_run_dgx_cloud import cluster_block

        runai = request.getfixturevalue("_stack").enter_context(
            RunaiServer(creating_s=0.05, initializing_s=0.05, execute=True)
        )
        # the fake's pods inherit this PATH (an image's PATH): this env's python first
        path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        request.getfixturevalue("monkeypatch").setenv("PATH", path)
        return cluster_block(runai, tmp_path / "pvc")
    if backend == "kubeflow":
        from prefect_nemo.blocks import KubeflowTrainerCluster

        request.getfixturevalue("trainer")  # its pods run their command here, for real
        return KubeflowTrainerCluster(
            kubernetes=request.getfixturevalue("kube_block"),
            image="nvcr.io/nvidia/nemo:25.04",
            max_poll_interval_s=0.5,
        )
    from tests.test_nemo_run_slurm import slurm_block

    (tmp_path / "slurm-jobs").mkdir()
    return slurm_block(request.getfixturevalue("slurm"), tmp_path / "slurm-jobs")


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_one_partial_runs_unchanged_on_every_backend(
    backend, request, metric, prefect_api, tmp_path
):
    """"One small real function (for example numpy work that writes a file and prints a metric)
    as a `run.Partial` runs to SUCCEEDED, unchanged, on: local, real Slurm, a real local Ray
    cluster (Ray Jobs) ... One parametrized test over the backends, asserting the output, not
    just the state." On Ray Jobs it runs through NeMo-Run's runner entrypoint; on the NeMo-Run
    local executor NeMo-Run packages and runs it itself."""
    import nemo_run as run

    block = _block(backend, request, tmp_path)
    out = tmp_path / "out" / "summary.json"
    task = run.Partial(metric.summarize, n=2000, seed=7, out=str(out))
    spec = JobSpec(task=task, working_dir=CODE, timeout_s=240)

    @flow
    def nemo_task_flow():
        return run_job(spec, cluster=block)

    result = nemo_task_flow()
    assert result.state is JobState.SUCCEEDED
    std = metric.expected(2000, 7)
    if backend == "lepton":  # the fake runs nothing: run its pod's payload here
        log = _run_lepton_pod(request.node.lepton, block, result.handle.job_id)
    else:
        log = block.backend().logs(result.handle.job_id)
    assert f"metric std={std}" in log, log
    record = json.loads(out.read_text())
    assert record["std"] == std and record["n"] == 2000
    if backend == "ray-jobs":
        info = request.getfixturevalue("ray_client").get_job_info(result.handle.job_id)
        runner = "python -m nemo_run.core.runners.fdl_runner -n summarize "
        assert info.entrypoint.startswith(runner), "NeMo-Run's own runner entrypoint"
    if backend == "kubeflow":
        from prefect_nemo.kube import TRAIN_JOB

        trainjob = block.kubernetes.api().get(TRAIN_JOB, result.handle.job_id, "default")
        command = trainjob["spec"]["trainer"]["command"][-1]
        # no launcher: NeMo-Run's runner entrypoint as is (`specs.AppDef(entrypoint=...)`)
        assert command.splitlines()[-1].startswith(
            "python -m nemo_run.core.runners.fdl_runner -n summarize "
        ), command
        assert "torchrun" not in command


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["ray-jobs", "nemo-run-local", "kubeflow"])
def test_a_script_task_runs_with_its_env(backend, request, prefect_api, tmp_path):
    """A `run.Script` is a job definition too: its env travels as the job's env, its inline
    text runs as its entrypoint runs it (`bash -c`). On Kubeflow Trainer with
    launcher='torchrun', NeMo-Run's torchrun component runs a non-Python script under torchrun
    with `--no-python` (`if no_python: cmd += ["--no-python"]`): two processes per node here,
    each with its torch RANK."""
    import nemo_run as run

    from prefect_nemo.backends.nemo_run.isolation import nemo_run

    nemo_run()
    block = _block(backend, request, tmp_path)
    if backend == "kubeflow":
        block = block.model_copy(update={"procs_per_node": 2})
    task = run.Script(inline='echo "script rank=${RANK:-none} greeting=$GREETING"',
                      env={"GREETING": "hello"})  # fmt: skip

    job = JobSpec(task=task, launcher="torchrun") if backend == "kubeflow" else task

    @flow
    def script_flow():
        return run_job(job, cluster=block)

    result = script_flow()
    assert result.state is JobState.SUCCEEDED
    log = block.backend().logs(result.handle.job_id)
    if backend == "kubeflow":
        assert "script rank=0 greeting=hello" in log and "script rank=1 greeting=hello" in log
    else:
        assert "script rank=none greeting=hello" in log, log


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_task_secret_reaches_the_function_and_nothing_else(backend, request, metric, prefect_api,
                                                             tmp_path):  # fmt: skip
    """"Secrets in the task's configuration (SecretStr values) never appear in the serialized
    payload we log, the artifacts, or the dry-run output", on every backend: the dry run holds
    no secret; where the backend delivers secret env values (Ray Jobs, local, Slurm, Kubeflow)
    the function receives the SecretStr; where it would have to store them in plain text
    (KubeRay on an existing RayCluster, Lepton, DGX Cloud) the task is refused before submit,
    naming the field."""
    import nemo_run as run

    block = _block(backend, request, tmp_path)
    out = tmp_path / "secret.json"
    task = run.Partial(metric.summarize, n=10, seed=2, out=str(out), token=SecretStr(CANARY))
    spec = JobSpec(task=task, working_dir=CODE, timeout_s=240)

    @flow
    def secret_task_flow(dry_run: bool):
        return run_job(spec, cluster=block, dry_run=dry_run)

    if backend in ("kuberay", "lepton", "dgx-cloud"):
        with pytest.raises(InvalidJobSpec, match=r"PREFECT_NEMO_TASK_SECRET_0"):
            secret_task_flow(dry_run=True)
        return
    assert CANARY not in secret_task_flow(dry_run=True).yaml
    result = secret_task_flow(dry_run=False)
    assert result.state is JobState.SUCCEEDED
    assert CANARY not in block.backend().logs(result.handle.job_id)
    sent = json.loads(out.read_text())["token_sha256"]
    assert sent == hashlib.sha256(CANARY.encode()).hexdigest()


def _run_lepton_pod(lepton: Any, block: Any, job_id: str) -> str:
    """What the Lepton job's pod runs, run here: its launch script's code unpacking (on the
    shared mount), then its last line, the task's command, in the unpacked code dir (the
    script's /nemo_run/code; the image-specific lines, a wget of Lepton's env script and the
    /nemo_run symlink, are left out). Returns the pod's output."""
    job = lepton.jobs[job_id]
    job_dir = block.backend().local_experiment_dir(job_id) / job_id
    lines = (job_dir / "launch_script.sh").read_text().strip().splitlines()
    (setup,) = [line for line in lines if line.endswith("|| exit 1")]
    assert lines[-2] == "cd /nemo_run/code"
    assert lines[-1].startswith("python -m nemo_run.core.runners.fdl_runner -n summarize ")
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    env = {**lepton.pod_env(job, 0), "PATH": path}
    code = Path(block.nemo_run_dir).joinpath(*job_dir.relative_to(
        block.backend().local_experiment_dir(job_id).parents[2]).parts, "code")
    out = subprocess.run(["/bin/bash", "-c", setup], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    out = subprocess.run(["/bin/bash", "-c", lines[-1]], env=env, cwd=code, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_identity_is_the_configuration(metric):
    """"Its identity (the job id) is derived from the task's serialized configuration, so a
    re-run of the same task attaches": the same task gives the same key, any change another."""
    import nemo_run as run

    def spec(**kw: Any) -> JobSpec:
        args = {"n": 10, "seed": 1, "out": "/tmp/x.json", **kw}
        return JobSpec(task=run.Partial(metric.summarize, **args), working_dir=CODE)

    first, again, other = spec(), spec(), spec(seed=2)
    assert first.task.key == again.task.key and first.task.key.startswith("summarize-")
    assert first.fingerprint() == again.fingerprint()
    assert other.task.key != first.task.key
    with_secret = spec(token=SecretStr("a")).task.key
    assert spec(token=SecretStr("b")).task.key == with_secret, "secret values are not identity"
    assert JobSpec(**first.model_dump()) == first, "the spec round-trips as data"


def test_specs_without_task_or_launcher_keep_their_fingerprint():
    """The new fields are left out of the fingerprint when unset, so a job submitted before
    them is not reported as drifted when a re-run attaches (the value main computes)."""
    assert JobSpec(entrypoint="python train.py", name="x").fingerprint() == "4f9559a1a0ac5536"


@pytest.mark.slow
def test_a_rerun_of_the_same_task_attaches(metric, ray_head, ray_client, prefect_api, tmp_path):
    """A second run_job of the same task in the same run attaches to the first job (its id is
    the configuration's); the same function with another argument is another job."""
    import nemo_run as run

    block = ray_head.block()
    out = str(tmp_path / "s.json")

    @flow
    def twice():
        a = run_job(JobSpec(task=run.Partial(metric.summarize, n=50, seed=3, out=out),
                            working_dir=CODE), cluster=block)
        b = run_job(JobSpec(task=run.Partial(metric.summarize, n=50, seed=3, out=out),
                            working_dir=CODE), cluster=block)
        c = run_job(JobSpec(task=run.Partial(metric.summarize, n=50, seed=4, out=out),
                            working_dir=CODE), cluster=block)
        return a, b, c

    a, b, c = twice()
    assert b.handle.job_id == a.handle.job_id and b.attached and not a.attached
    assert c.handle.job_id != a.handle.job_id and not c.attached


def _in_main() -> None:
    """Stands for a function a notebook cell defines."""


_in_main.__module__ = "__main__"


def test_bad_tasks_fail_before_submit_naming_task_and_reason(metric, tmp_path):
    """"A task whose function cannot be imported in the job, or that is not serializable,
    fails before submit with an error naming the task and the reason." """
    import nemo_run as run
    import numpy as np

    def local_fn() -> None:
        pass

    cases = [
        (run.Partial(local_fn), None, "local_fn", "defined inside a function"),
        (run.Partial(_in_main), None, "_in_main", "defined in __main__"),
        (run.Partial(metric.summarize, n=1, seed=1, out="x"), None, "metric_task.summarize",
         "neither an installed package nor under JobSpec.working_dir"),
        (run.Partial(metric.summarize, n=1, seed=1, out="x"), tmp_path, "metric_task.summarize",
         "neither an installed package nor under JobSpec.working_dir"),
        (run.Partial(metric.summarize, n=np.arange(3), seed=1, out="x"), CODE,
         "metric_task.summarize", "not serializable by NeMo-Run's serializer"),
    ]
    for task, working_dir, names_task, reason in cases:
        with pytest.raises(InvalidJobSpec) as info:
            JobSpec(task=task, working_dir=working_dir)
        assert "JobSpec.task" in str(info.value) and names_task in str(info.value)
        assert reason in str(info.value), str(info.value)
    with pytest.raises(InvalidJobSpec, match="each say what the job runs"):
        JobSpec(entrypoint="true", task=run.Partial(metric.summarize), working_dir=CODE)


@pytest.mark.slow
def test_bad_task_through_run_job_submits_nothing(metric, ray_head, ray_client, prefect_api):
    """The notebook path, `run_job(run.Partial(fn, ...), cluster)`, refuses a function defined in
    a cell (__main__) before anything reaches the cluster."""
    import nemo_run as run


    @flow
    def from_a_cell():
        return run_job(run.Partial(_in_main), cluster=ray_head.block())

    state = from_a_cell(return_state=True)
    with pytest.raises(InvalidJobSpec, match=r"task __main__\._in_main cannot be imported"):
        state.result()
    assert jobs_of_run(ray_client, state.state_details.flow_run_id) == []


@pytest.mark.slow
def test_task_secrets_stay_out_of_payload_dry_run_logs_and_artifacts(
    metric, ray_head, prefect_api, tmp_path, caplog, capfd
):
    """"Secrets in the task's configuration (SecretStr values) never appear in the serialized
    payload we log, the artifacts, or the dry-run output." The payload is decoded (base64, zlib)
    before it is searched: a compressed secret would hide from a plain text search."""
    import nemo_run as run
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from tests.test_secrets import _logs_of_flow_run

    task = run.Partial(
        metric.summarize, n=10, seed=1, out=str(tmp_path / "o.json"), token=SecretStr(CANARY)
    )
    spec = JobSpec(task=task, working_dir=CODE, name=f"secret-{uuid.uuid4().hex[:6]}")
    payload = spec.entrypoint.rsplit(" ", 1)[-1]
    decoded = zlib.decompress(base64.urlsafe_b64decode(payload)).decode()
    assert CANARY not in decoded and "PREFECT_NEMO_TASK_SECRET_0" in decoded
    assert spec.env["PREFECT_NEMO_TASK_SECRET_0"].get_secret_value() == CANARY

    @flow
    def secret_flow():
        dry = run_job(spec, cluster=ray_head.block(), dry_run=True)
        return dry, run_job(spec, cluster=ray_head.block())

    state = secret_flow(return_state=True)
    dry, result = state.result()
    assert result.state is JobState.SUCCEEDED
    flow_run_id = state.state_details.flow_run_id
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        )
        logs = _logs_of_flow_run(client, flow_run_id, until=result.handle.job_id)
    haystacks = {
        "dry run": dry.yaml,
        "artifacts": json.dumps([a.model_dump(mode="json") for a in artifacts]),
        "prefect logs": logs,
        "caplog": caplog.text,
        "stdout/stderr": "".join(capfd.readouterr()),
        "spec": repr(spec) + spec.model_dump_json(),
    }
    assert payload in haystacks["dry run"], "the dry run shows the payload it would send"
    for where, text in haystacks.items():
        assert CANARY not in text, f"the task's secret leaked into {where}"
    sent = json.loads((tmp_path / "o.json").read_text())["token_sha256"]
    assert sent == hashlib.sha256(CANARY.encode()).hexdigest(), (
        "the SecretStr reached the function as a SecretStr with its value"
    )


def test_without_nemo_run_a_task_names_the_extra():
    """"nemo-run stays an optional extra; without it, passing a NeMo-Run task raises an
    ImportError naming `prefect-nemo[nemo-run]`." nemo_run is made unimportable in a child."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('nemo_run',):\n"
        "            raise ImportError('No module named ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from types import SimpleNamespace\n"
        "from prefect_nemo import JobSpec\n"
        "try:\n"
        "    JobSpec(task=SimpleNamespace(fn=print))\n"
        "except ImportError as exc:\n"
        "    print('ImportError:', exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert "ImportError:" in out.stdout and "prefect-nemo[nemo-run]" in out.stdout, (
        out.stdout + out.stderr[-2000:]
    )


# ---------------------------------------------------------------------------------------------
# Launchers (issue 15 item 3): rendered by each backend's dry run, nothing submitted


def _torchrun_spec(metric: Any, nodes: int, gpus: int) -> JobSpec:
    import nemo_run as run

    from prefect_nemo.placement import PlacementSpec

    return JobSpec(
        task=run.Partial(metric.summarize, n=10, seed=1, out="/tmp/unused.json"),
        working_dir=CODE,
        launcher="torchrun",
        placement=PlacementSpec(
            nodes=nodes, gpus_per_node=gpus, strategy="spread" if nodes > 1 else "pack"
        ),
    )


def test_torchrun_is_refused_for_a_ray_job_naming_the_field(metric):
    """"Bad combinations (torchrun with a Ray cluster job ...) fail before submission, naming
    the field." A Ray job's entrypoint is the driver, run once; Ray starts its workers."""
    from prefect_nemo.backends.ray_jobs import RayJobsBackend

    spec = _torchrun_spec(metric, 1, 0)
    with pytest.raises(InvalidJobSpec, match=r"JobSpec\.launcher='torchrun'.*launcher=None"):
        RayJobsBackend("http://127.0.0.1:9").validate(spec)  # no request: nothing listens


def test_torchrun_on_kubeflow_needs_the_blocks_torchrun_and_matching_gpus(metric):
    """Kubeflow Trainer: the block's shape is the runtime's; torchrun off in the block, or a
    placement whose GPUs per node differ from the block's, fail naming the field."""
    from prefect_nemo.backends.kubeflow import TrainerConfig
    from prefect_nemo.backends.kubeflow.trainjob import check_spec

    spec = _torchrun_spec(metric, 1, 2)
    with pytest.raises(InvalidJobSpec, match=r"KubeflowTrainerCluster\.torchrun is off"):
        check_spec(spec, TrainerConfig(image="img", gpus_per_node=2, torchrun=False))
    with pytest.raises(InvalidJobSpec, match=r"JobSpec\.placement\.gpus_per_node: 2.* is 4"):
        check_spec(spec, TrainerConfig(image="img", gpus_per_node=4))
    check_spec(spec, TrainerConfig(image="img", gpus_per_node=2))


def test_torchrun_on_local_is_nemo_runs_torchrun_with_procs_from_placement(metric, tmp_path):
    """NeMo-Run's torchrun component (`torchx_backend/components/torchrun.py`) runs a Partial as
    `torchrun ... --nnodes <n> --nproc-per-node <p> ... -m nemo_run.core.runners.fdl_runner`,
    `j=f"{executor.nnodes()}x{executor.nproc_per_node()}"`: on the local executor p is
    placement.gpus_per_node."""
    from prefect_nemo.backends.nemo_run.local import NemoRunLocalBackend

    backend = NemoRunLocalBackend()
    spec = _torchrun_spec(metric, 1, 2)
    backend.validate(spec)
    [doc] = backend.render(spec, f"tr-{uuid.uuid4().hex[:6]}", {})
    command = " ".join(doc["command"])
    assert doc["command"][0] == "torchrun", command
    assert "--nnodes 1 " in command and "--nproc-per-node 2 " in command
    assert " -m nemo_run.core.runners.fdl_runner -n " in command


@pytest.mark.slow
def test_torchrun_on_slurm_is_one_task_per_node_and_a_process_per_gpu(metric, slurm, tmp_path):
    """On Slurm NeMo-Run's SlurmExecutor under Torchrun sets `ntasks_per_node=1` and
    `torchrun_nproc_per_node` ("Detected Torchrun launcher, setting ntasks_per_node=1"): the
    sbatch script asks for the placement's nodes and GPUs and srun starts torchrun once per
    node with one process per GPU."""
    from tests.test_nemo_run_slurm import slurm_block

    (tmp_path / "jobs").mkdir()
    backend = slurm_block(slurm, tmp_path / "jobs").backend()
    spec = _torchrun_spec(metric, 2, 4)
    script = backend.render(spec, f"tr-{uuid.uuid4().hex[:6]}", {})[0]["script"]
    assert "#SBATCH --nodes=2" in script and "#SBATCH --ntasks-per-node=1" in script
    assert "#SBATCH --gpus-per-node=4" in script
    assert "torchrun" in script and "--nnodes 2" in script and "--nproc-per-node 4" in script
    assert "-m nemo_run.core.runners.fdl_runner -n " in script


def test_torchrun_on_lepton_and_dgx_cloud_is_nemo_runs_pod_command(metric, tmp_path):
    """Lepton and DGX Cloud run what NeMo-Run's packaging makes of the Partial under Torchrun
    (the command NeMo-Run's Lepton / DGX Cloud schedulers hand to `executor.launch`): Lepton's
    with `--node-rank $NODE_RANK --master-addr $MASTER_ADDR`, DGX Cloud's with `--nnodes` and
    `--nproc-per-node` only (run:ai's PyTorch operator sets the rendezvous env). A launcher
    around a plain command is refused there, naming the field."""
    from prefect_nemo.testing.lepton import LeptonServer
    from prefect_nemo.testing.runai import RunaiServer
    from tests.test_dry_run import LEPTON_ENV
    from tests.test_nemo_run_dgx_cloud import cluster_block
    from tests.test_nemo_run_lepton import workspace_block

    spec = _torchrun_spec(metric, 2, 1)
    with LeptonServer(token="lep-" + uuid.uuid4().hex[:12], start_s=0.1) as lepton:
        block = workspace_block(lepton, tmp_path, **LEPTON_ENV)
        documents = block.backend().render(spec, f"tr-{uuid.uuid4().hex[:6]}", {})
        script = next(d for d in documents if d["kind"] == "LeptonLaunchScript")["script"]
        assert not lepton.requests.entries
    line = script.strip().splitlines()[-1]
    assert line.startswith("torchrun --nnodes 2 --nproc-per-node 1 --node-rank $NODE_RANK "), line
    assert " -m nemo_run.core.runners.fdl_runner -n summarize " in line
    with pytest.raises(InvalidJobSpec, match=r"JobSpec\.launcher='torchrun': on lepton"):
        block.backend().validate(spec.model_copy(update={"task": None}))

    with RunaiServer(client_secret="dgx-" + uuid.uuid4().hex[:8]) as runai:
        block = cluster_block(runai, tmp_path / "pvc", gpus_per_node=1, nodes=2)
        [doc] = block.backend().render(spec, f"tr-{uuid.uuid4().hex[:6]}", {})
        assert not runai.requests.entries
    args = doc["request"]["spec"]["args"]
    assert "torchrun --nnodes 2 --nproc-per-node 1 " in args
    assert " -m nemo_run.core.runners.fdl_runner -n summarize " in args


# ---------------------------------------------------------------------------------------------
# The notebook path (issue 15 item 6)


def test_a_bare_task_ships_the_directory_its_module_came_from(metric):
    """`run_job(run.Partial(fn, ...), cluster)` with no JobSpec: the task's working_dir is the
    sys.path entry its module was imported from (a module written next to a notebook); code
    that is installed ships nothing."""
    import nemo_run as run

    from prefect_nemo.tasks.jobs import job_spec

    spec = job_spec(run.Partial(metric.summarize, n=1, seed=1, out="x"))
    assert spec.working_dir == CODE.resolve() and spec.task.target == "metric_task.summarize"
    assert job_spec(run.Partial(json.dumps, obj=1)).working_dir is None


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_example_notebook_runs_a_partial(prefect_api, ray_head, tmp_path):
    """examples/nemo_run_task.ipynb, executed headless against the session's Prefect API and Ray:
    "`run_job(run.Partial(my_fn, x=1), cluster)` from a notebook cell works; the example
    notebook shows it"."""
    import nbformat
    from nbclient import NotebookClient

    from tests.test_notebook import _kernel_manager, _outputs

    path = Path(__file__).parent.parent / "examples" / "nemo_run_task.ipynb"
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        assert cell.cell_type != "code" or not cell.outputs, "committed without outputs"
    env = dict(
        os.environ,
        PREFECT_API_URL=prefect_api,
        RAY_API_SERVER_ADDRESS=ray_head.dashboard_url,
        RAY_AUTH_TOKEN=ray_head.token or "",
    )
    env.pop("PREFECT_PROFILE", None)
    client = NotebookClient(
        nb, km=_kernel_manager(tmp_path), timeout=300,
        resources={"metadata": {"path": str(path.parent)}},
    )  # fmt: skip
    client.execute(env=env)
    stdout, _ = _outputs(nb, "run-task")
    assert ": SUCCEEDED" in stdout and "'n': 1000" in stdout, stdout


# ---------------------------------------------------------------------------------------------
# ${auto_mount:git+...} container mounts on Slurm (issue 15 item 5)


def _git_repo(path: Path) -> tuple[str, str]:
    """A local git repository with one commit; (its file:// URL, the commit)."""
    path.mkdir(parents=True)
    (path / "VERSION").write_text("v1\n")
    git = ["git", "-C", str(path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git[:3], "init", "--quiet"], check=True)
    subprocess.run([*git, "add", "VERSION"], check=True)
    subprocess.run([*git, "commit", "--quiet", "-m", "one"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True)
    return f"file://{path}", head.stdout.strip()


def _mount_block(slurm: Any, tmp_path: Path, mounts: list[str], image: str | None) -> Any:
    from tests.test_nemo_run_slurm import slurm_block

    (tmp_path / "jobs").mkdir(exist_ok=True)
    block = slurm_block(slurm, tmp_path / "jobs")
    return block.model_copy(update={"container_mounts": mounts, "container_image": image})


@pytest.mark.slow
def test_auto_mounts_are_bind_mounts_in_the_sbatch_script(slurm, tmp_path):
    """Nemotron's container mounts `${auto_mount:git+<url>@<ref>,<target>}` (its resolver
    "Returns a placeholder that gets filtered out from container_mounts", which is how such a
    mount went missing from the sbatch script): here each is a `<clone>:<target>` bind mount in
    the script NeMo-Run writes (`srun --container-mounts`), the dry run shows it and clones
    nothing; a submit clones the repository at the ref on the cluster, once, and the job reads
    the file at its mount."""
    url, commit = _git_repo(tmp_path / "repo")
    entry = f"${{auto_mount:git+{url}@{commit},/opt/repo}}"
    block = _mount_block(slurm, tmp_path, ["/data:/data", entry], "nvcr.io/nvidia/nemo:25.04")
    backend = block.backend()
    spec = JobSpec(entrypoint="cat /opt/repo/VERSION", name="mounts")
    [clone] = backend.git_mounts()
    assert clone.clone_dir.startswith(backend.remote_root() + "/git-mounts/repo-")
    script = backend.render(spec, f"mnt-{uuid.uuid4().hex[:6]}", {})[0]["script"]
    assert f"--container-mounts /data:/data,{clone.clone_dir}:/opt/repo," in script, script
    assert "${auto_mount" not in script
    assert not Path(clone.clone_dir).exists(), "the dry run cloned"

    # The real submit clones it on the cluster (over the SSH tunnel) before sbatch, and the
    # job reads the repository at its mount (the test Slurm's pyxis stand-in bind-mounts
    # --container-mounts: `LocalSlurm.site_bin`).
    venv = Path(sys.executable).parent
    site = slurm.site_bin(venv / "ray")
    backend = block.model_copy(update={"setup_lines": f"export PATH={site}:{venv}:$PATH"}).backend()
    job_id = f"mnt-{uuid.uuid4().hex[:6]}"
    backend.submit(spec, job_id, {})
    try:
        assert (Path(clone.clone_dir) / "VERSION").read_text() == "v1\n"
        head = subprocess.run(["git", "-C", clone.clone_dir, "rev-parse", "HEAD"],
                              capture_output=True, text=True)  # fmt: skip
        assert head.stdout.strip() == commit
        sent = Path(backend.remote_dir(job_id), f"{job_id}_sbatch.sh").read_text()
        assert f"{clone.clone_dir}:/opt/repo" in sent
        status = wait_until(
            lambda: (s := backend.find(job_id)) and s.state.is_terminal() and s, 60
        )
        assert status and status.state is JobState.SUCCEEDED, status
        assert "v1" in backend.logs(job_id), backend.logs(job_id)
    finally:
        from prefect_nemo.lifecycle import stop_and_confirm

        stop_and_confirm(backend, job_id, timeout_s=60)


def test_bad_auto_mounts_fail_before_submit_naming_the_field(tmp_path):
    """A malformed entry, or an auto_mount without a container image (no mount would reach the
    sbatch script), fails in validate, naming the block field."""
    from prefect_nemo.backends.nemo_run.slurm import SlurmBackend, SlurmConfig

    def backend(mounts: list[str], image: str | None) -> Any:
        config = SlurmConfig(host="127.0.0.1", user="u", job_dir=str(tmp_path), account="a",
                             container_image=image, container_mounts=mounts)  # fmt: skip
        return SlurmBackend(config)

    spec = JobSpec(entrypoint="true")
    with pytest.raises(InvalidJobSpec, match=r"SlurmCluster\.container_mounts\[1\]"):
        backend(["/a:/a", "${auto_mount:git+https://x/y.git,/opt/y}"], "img").validate(spec)
    with pytest.raises(InvalidJobSpec, match=r"set SlurmCluster\.container_image"):
        backend(["${auto_mount:git+https://x/y.git@main,/opt/y}"], None).validate(spec)


def test_torchrun_is_refused_for_every_ray_cluster_job(metric, tmp_path):
    """"Bad combinations (torchrun with a Ray cluster job ...) fail before submission, naming
    the field": Ray on Lepton and Ray on DGX Cloud refuse it as Ray Jobs does, sending nothing
    (the Nemotron recipes create their Ray executors with `launcher=None`)."""
    from prefect_nemo.blocks import DGXCloudRayCluster, LeptonRayCluster
    from prefect_nemo.testing.lepton import LeptonServer
    from prefect_nemo.testing.runai import RunaiServer
    from tests.test_nemo_run_dgx_cloud import cluster_block
    from tests.test_nemo_run_lepton import workspace_block

    spec = _torchrun_spec(metric, 1, 0)
    refused = r"JobSpec\.launcher='torchrun': a .* job's entrypoint is a Ray driver"
    with LeptonServer(token="lep-" + uuid.uuid4().hex[:12]) as lepton:
        workspace = workspace_block(lepton, tmp_path)
        ray = LeptonRayCluster(workspace=workspace, ray_cluster_name="rl").backend()
        with pytest.raises(InvalidJobSpec, match=refused):
            ray.validate(spec)
        assert not lepton.requests.entries
    with RunaiServer(client_secret="dgx-" + uuid.uuid4().hex[:8]) as runai:
        ray = DGXCloudRayCluster(cluster=cluster_block(runai, tmp_path / "pvc")).backend()
        with pytest.raises(InvalidJobSpec, match=refused):
            ray.validate(spec)
        assert not runai.requests.entries


def test_torchrun_processes_must_match_the_lepton_resource_shapes_gpus(metric, tmp_path):
    """"GPUs per node not matching the block" fails before submission, naming the field.
    NeMo-Run's torchrun starts `j=f"{executor.nnodes()}x{executor.nproc_per_node()}"` processes,
    and LeptonExecutor.nproc_per_node is "the number of GPUs specified per node"; the node's
    GPUs are its resource shape's (`gpu.8xh100-80gb`: 8). A launcher-less job is not checked."""
    from prefect_nemo.testing.lepton import LeptonServer
    from tests.test_nemo_run_lepton import workspace_block

    with LeptonServer(token="lep-" + uuid.uuid4().hex[:12]) as lepton:
        block = workspace_block(lepton, tmp_path, resource_shape="gpu.8xh100-80gb")
        backend = block.backend()
        with pytest.raises(
            InvalidJobSpec,
            match=r"JobSpec\.placement\.gpus_per_node=4: .* LeptonWorkspace\.resource_shape="
            r"'gpu\.8xh100-80gb' nodes have 8 GPUs",
        ):
            backend.validate(_torchrun_spec(metric, 2, 4))
        backend.validate(_torchrun_spec(metric, 2, 8))
        backend.validate(_torchrun_spec(metric, 2, 4).model_copy(update={"launcher": None}))
        assert not lepton.requests.entries
