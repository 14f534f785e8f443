"""Shared fixtures: one real Prefect API and one real local Ray cluster per test session."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from prefect_nemo.local_ray import LocalRayCluster, session_members, start_local_ray

IN_CI = os.environ.get("CI", "").lower() == "true"

# The Prefect 3.5 smoke: the core tests that the extras environment (Prefect 3.5, `make
# test-extras`) runs besides the nemo_run ones; the core environment runs the whole suite. One or
# two telling tests for each thing that leans on Prefect's API: task runs of real Ray jobs (logs,
# events, retry identity), experiments, cancellation and crash recovery, blocks and block
# documents, deployments. Listed here rather than marked in the files, so that one place says
# what the smoke is; a name that no longer exists fails the run (see below).
COMPAT = {
    "tests/test_run_job.py::test_run_job_success_streams_logs_and_reports",
    "tests/test_run_job.py::test_task_retry_attaches_instead_of_resubmitting",
    "tests/test_run_job.py::test_events_are_emitted_on_state_changes",
    "tests/test_experiments.py::test_running_dependency_is_waited_for",
    "tests/test_experiments.py::test_failed_dependency_fails_at_once",
    "tests/test_crash_safety.py::test_cancelling_a_served_flow_run_stops_its_jobs",
    "tests/test_crash_safety.py::test_kill_9_then_rerun_attaches_to_the_same_jobs",
    "tests/test_blocks.py::test_block_register_from_the_package",
    "tests/test_blocks.py::test_save_load_round_trip_keeps_secrets_secret",
    "tests/test_block_documents.py::test_apply_creates_then_reports_unchanged_then_updates",
    "tests/test_deployments.py::test_every_entrypoint_loads_and_every_parameter_is_accepted",
    "tests/test_deployments.py::test_deploy_is_idempotent_and_creates_the_work_pool",
    "tests/test_secrets.py::test_canaries_never_leak",
    "tests/test_usage.py::test_a_two_node_8_gpu_job_that_ran_90s_used_0_4_gpu_hours",
    "tests/test_usage.py::test_the_terminal_event_and_row_carry_the_usage_and_the_artifact_rolls_up",
}


# The longest files, longest first: seconds of a CI-like run on 2 cores in the comments (from
# PREFECT_NEMO_TEST_CPU's ledger; both phases' files in one list). Collection follows this order;
# xdist hands out the units with the most tests first, so it decides only among equals. Handed
# out strictly longest first, the workers ended together, yet test-core took 940 s and
# test-extras 338 s against 900 s and 296 s: on 2 busy cores the longest files, run at once,
# slowed each other more than the idle end saved.
LONGEST_FIRST = (
    "tests/test_real_kuberay.py",  # with the other ONE_CONTROL_PLANE files: one unit, 861
    "tests/test_outages.py",  # 228
    "tests/test_run_jobs.py",  # 208
    "tests/test_nemo_run_tasks.py",  # 173 (extras)
    "tests/test_deployments.py",  # 123
    "tests/test_ui.py",  # 116
    "tests/test_crash_safety.py",  # 109
    "tests/test_kube_job_backends.py",  # 103
    "tests/test_nemo_run_slurm.py",  # 103 (extras)
    # ONE_SLURM_QUEUE, by its first file in each phase: 97 s (extras), 44 s (core)
    "tests/test_nemo_run_slurm_queues.py",
    "tests/test_local_slurm_queues.py",
    "tests/test_kuberay.py",  # 95
    "tests/test_sweeper.py",  # 87
    "tests/test_nemo_run_lepton.py",  # 87 (extras)
    "tests/test_sweeper_backends.py",  # 85
    "tests/test_slurm_ray.py",  # 83 (extras)
    "tests/test_run_job.py",  # 82
    "tests/test_recovery.py",  # 76
    "tests/test_run_jobs_quota.py",  # 72
    "tests/test_rl_dynamo_flow.py",  # 69
    "tests/test_one_flow_any_backend.py",  # 63 (extras)
    "tests/test_wheel.py",  # 58
    "tests/test_serving.py",  # 51
    "tests/test_block_documents.py",  # 50
    "tests/test_nemo_run_dgx_cloud.py",  # 48 (extras)
    "tests/test_bad_input.py",  # 47
    "tests/test_ray_jobs_queue.py",  # 45
    "tests/test_saved_logs.py",  # 44
    "tests/test_progress_reports.py",  # 42
    "tests/test_operators.py",  # 40
    "tests/test_doctor.py",  # 39
    "tests/test_pushback.py",  # 36 (extras), 17 (core)
    "tests/test_kube_failures.py",  # 28
    "tests/test_nemo_run_progress.py",  # 28 (extras)
    "tests/test_nemo_run_owned_jobs.py",  # 27 (extras)
    "tests/test_blocks.py",  # 26
)


# The files that use the real control plane: one work unit for `--dist loadfile`, so one worker
# starts one control plane (each takes ~15 s to start and ~6% of a core while it runs). Split in
# two units (two workers, a control plane each, at once), test-core was no faster on 2 cores
# (906 and 982 s against 900) and one run of three failed: a KubeRay submitter's `ray job
# submit` reached its backoff limit while the other plane ran its Ray pods (cause not found).
ONE_CONTROL_PLANE = (
    "tests/test_kube_api.py",
    "tests/test_real_control_plane.py",
    "tests/test_real_kuberay.py",
    "tests/test_real_kuberay_progress.py",
    "tests/test_real_dynamo_trainer.py",
    "tests/test_real_kuberay_simulator.py",
    "tests/test_real_rl_dynamo_flow.py",
    "tests/test_real_sft_kubeflow_flow.py",
    "tests/test_real_doctor.py",
    "tests/test_real_kueue.py",
    "tests/test_real_node_loss.py",
    "tests/test_real_trainer_logs.py",
    "tests/test_real_progress.py",
)


# The files that fill the local Slurm's small partitions (the one-job queue partition, the
# low/high pair that preempts): one work unit, so no other file's jobs wait in their queue.
ONE_SLURM_QUEUE = (
    "tests/test_local_slurm_queues.py",
    "tests/test_slurm_recovery.py",
    "tests/test_nemo_run_slurm_queues.py",
)
#: work unit -> its files, each unit run whole by one worker
ONE_WORKER = {"real-control-plane": ONE_CONTROL_PLANE, "slurm-queues": ONE_SLURM_QUEUE}


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which would return its plain loadfile
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadfile`, with each ONE_WORKER group of files as one unit."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    unit_of = {file: unit for unit, files in ONE_WORKER.items() for file in files}

    class SharedEnginesWhole(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return unit_of.get(scope, scope)

    return SharedEnginesWhole(config, log)


# `PREFECT_NEMO_TEST_CPU=<file>`: one JSON line per test, its worker, start, wall and CPU seconds
# (this worker, the processes under it, the children it reaped), to see what fills the cores and
# the workers under `make test` (a shared engine's own processes, the Ray head, Slurm, the control
# plane, are not counted).
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    ledger = os.environ.get("PREFECT_NEMO_TEST_CPU")
    if not ledger:
        yield
        return
    started, wall, cpu = time.time(), time.monotonic(), _cpu_s()
    yield
    line = {
        "test": item.nodeid,
        "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
        "started": started,
        "wall_s": time.monotonic() - wall,
        "cpu_s": _cpu_s() - cpu,
    }
    with open(ledger, "a") as out:
        out.write(json.dumps(line) + "\n")


def _cpu_s() -> float:
    import resource

    import psutil

    me = psutil.Process()
    total = sum(me.cpu_times()[:2]) + sum(resource.getrusage(resource.RUSAGE_CHILDREN)[:2])
    for child in me.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            total += sum(child.cpu_times()[:2])
    return total


@pytest.hookimpl(tryfirst=True)  # before -m deselects: `-m compat` must see the marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the COMPAT tests `compat`; fail when a listed test is gone from a collected file;
    put the longest files first (a stable sort: the same order on every worker)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))
    found = set()
    for item in items:
        if (name := item.nodeid.split("[")[0]) in COMPAT:
            item.add_marker(pytest.mark.compat)
            found.add(name)
    if not any("::" in arg for arg in config.args):  # whole files collected: a miss is real
        files = {item.nodeid.split("::")[0] for item in items}
        if gone := sorted(t for t in COMPAT - found if t.split("::")[0] in files):
            raise pytest.UsageError(f"tests/conftest.py COMPAT names tests that are gone: {gone}")


@pytest.fixture(scope="session", autouse=True)
def saved_job_logs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Jobs' saved logs go to the session's temporary folder, not the checkout's
    ./.prefect-nemo/logs (child processes inherit it); a test may move them again."""
    from prefect_nemo.log_files import LOGS_DIR_ENV

    before = os.environ.get(LOGS_DIR_ENV)
    folder = os.environ[LOGS_DIR_ENV] = str(tmp_path_factory.mktemp("job-logs"))
    yield Path(folder)
    if before is None:
        os.environ.pop(LOGS_DIR_ENV, None)
    else:
        os.environ[LOGS_DIR_ENV] = before


@pytest.fixture(scope="session")
def prefect_api() -> Iterator[str]:
    """A real Prefect server (temporary database) for the whole session; yields its API URL."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    # the harness's server inherits this environment: its telemetry service would only try a
    # network this machine may not have, and its write at start races the server's own
    # (a "database is locked" traceback in the log)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    with prefect_test_harness(server_startup_timeout=180):
        yield str(PREFECT_API_URL.value())


# `pytest -n N` starts ONE Ray head in its controller process for all N workers (a head costs
# a core's worth of seconds a minute even when idle: its dashboard, agents, GCS and raylet); its
# address and token reach the workers in this variable. A module whose tests judge every job on
# the cluster (the sweeper's, the Lepton Ray cleanup tests') takes a head of its own:
# `own_ray_head`.
SHARED_RAY = "PREFECT_NEMO_TEST_RAY"
_shared_head = pytest.StashKey[LocalRayCluster]()


def _ray_head() -> LocalRayCluster:
    # two logical GPUs (Ray needs no device for them): a GPU job's GPU-hours are measured on
    # the real engine (tests/test_usage.py)
    return start_local_ray(num_cpus=8, num_gpus=2, resources={"slot": 4})


def pytest_configure(config: pytest.Config) -> None:
    workers = getattr(config.option, "numprocesses", None)
    if workers and not hasattr(config, "workerinput") and SHARED_RAY not in os.environ:
        head = config.stash[_shared_head] = _ray_head()  # before the workers start
        os.environ[SHARED_RAY] = json.dumps(
            {"dashboard_url": head.dashboard_url, "gcs_address": head.gcs_address,
             "token": head.token, "temp_dir": str(head.temp_dir)}
        )  # fmt: skip


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """When tests failed, say whether the shared Ray head lost its raylet during the run: every
    Ray test after that fails, and the first failure is then not where the cause is."""
    head = config.stash.get(_shared_head, None)
    if exitstatus == 0 or head is None or head.process is None:
        return
    names = [_command_name(pid) for pid in session_members(head.process.pid)]
    if "raylet" not in names:
        terminalreporter.write_line(
            f"the shared Ray head lost its raylet during the run (left: {sorted(set(names))}); "
            f"{head.temp_dir}/session_latest/logs/raylet.out says why",
            red=True,
        )


def _command_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def pytest_unconfigure(config: pytest.Config) -> None:
    if (head := config.stash.get(_shared_head, None)) is not None:
        os.environ.pop(SHARED_RAY, None)
        head.stop()


@pytest.fixture(scope="session")
def ray_head() -> Iterator[LocalRayCluster]:
    """A real Ray head with its dashboard and token auth on, on free ports: the one shared by
    every worker of this run (not ours to stop), or one of this process's own."""
    if shared := os.environ.get(SHARED_RAY):
        fields = json.loads(shared)
        yield LocalRayCluster(**{**fields, "temp_dir": Path(fields["temp_dir"])})
        return
    with _ray_head() as cluster:
        yield cluster


@pytest.fixture(scope="module")
def own_ray_head() -> Iterator[LocalRayCluster]:
    """A Ray head of the module's own, for tests that sweep every job on the cluster: the
    shared head also runs the other workers' jobs, whose flow runs are in their own Prefect
    servers (a sweep would take them for runs that no longer exist)."""
    with _ray_head() as cluster:
        yield cluster


@pytest.fixture
def cluster(ray_head: LocalRayCluster, prefect_api: str):
    """A RayJobsCluster block for the session's Ray head."""
    return ray_head.block()


def jobs_of_run(ray_client: Any, flow_run_id: Any) -> list[str]:
    """The cluster's jobs that a flow run submitted (our metadata names it): on the shared head
    "nothing was submitted" is asked of the run, not of the whole cluster."""
    from prefect_nemo.jobs import META_FLOW_RUN

    return [
        j.submission_id for j in ray_client.list_jobs()
        if (j.metadata or {}).get(META_FLOW_RUN) == str(flow_run_id)
    ]  # fmt: skip


@pytest.fixture
def ray_client(ray_head: LocalRayCluster):
    """Ray's own client, to look at the cluster behind our back."""
    return ray_head.block().backend().client


# -- Kubernetes: one loopback API server per test module, and the operator simulators on it ------


@pytest.fixture(scope="module")
def kube_server() -> Iterator[Any]:
    from prefect_nemo.testing.kube_api import LoopbackKubeServer, crd_dir

    with LoopbackKubeServer(crds=[crd_dir()]) as server:
        yield server


_planes: list[Any] = []  # the running control plane of this process, if any


@pytest.fixture(scope="module")
def control_plane() -> Any:
    """The real control plane (etcd, kube-apiserver, kube-controller-manager, KubeRay operator,
    and once built the Trainer, JobSet and Kueue managers) built from Go modules; the one `make
    control-plane up` left running is reused. Started for the first test that asks, stopped
    after the last ONE_CONTROL_PLANE test of this process (`pytest_runtest_teardown`; idle, it
    takes ~4% of a core) or at the session's end."""
    from prefect_nemo.testing.control_plane import ControlPlane, build

    if not _planes:
        if reason := build.unavailable_reason():  # no Go, or `make control-plane` not run
            (pytest.fail if IN_CI else pytest.skip)(reason)
        _planes.append((ControlPlane.attach() or ControlPlane()).start())
    return _planes[0]


def _stop_control_plane() -> None:
    while _planes:
        _planes.pop().stop()  # a plane attached to (`make control-plane up`) is left running


@pytest.hookimpl(trylast=True)  # after pytest's own: the module fixtures using it are gone
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop the control plane once the next test is not one of the ONE_CONTROL_PLANE files
    (under xdist they come to a worker as one unit; alone, a later file may start it again)."""
    if _planes and (nextitem is None or nextitem.nodeid.split("::")[0] not in ONE_CONTROL_PLANE):
        if item.nodeid.split("::")[0] in ONE_CONTROL_PLANE:
            _stop_control_plane()


def pytest_sessionfinish(session: pytest.Session) -> None:
    _stop_control_plane()


@pytest.fixture(scope="module")
def dynamo_sim(kube_server: Any) -> Iterator[Any]:
    from prefect_nemo.testing.operators import DynamoSimulator

    with DynamoSimulator(kube_server, start_delay_s=0.2) as sim:
        yield sim


@pytest.fixture(scope="module")
def kuberay(kube_server: Any, ray_head: Any) -> Iterator[Any]:
    from prefect_nemo.testing.operators import KubeRaySimulator

    with KubeRaySimulator(kube_server, ray_head.dashboard_url, ray_head.token) as sim:
        yield sim


@pytest.fixture(scope="module")
def kube_block(kube_server: Any) -> Any:
    from prefect_nemo.blocks.kubernetes import KubernetesCluster

    return KubernetesCluster(kubeconfig=kube_server.kubeconfig())


def real_kube_server_fixture() -> Any:
    """A module's `kube_server` fixture that is the real control plane: the loopback tests a
    module re-runs there take it unchanged (their simulators are the kubelets of nodes of their
    own, which need the pod network)."""

    @pytest.fixture(scope="module", name="kube_server")
    def kube_server(control_plane: Any) -> Any:
        from prefect_nemo.testing.control_plane import pod_network

        if reason := pod_network.unavailable_reason():
            (pytest.fail if IN_CI else pytest.skip)(reason)
        return control_plane

    return kube_server


def kuberay_in_default_fixture() -> Any:
    """A module's `kuberay` fixture: the KubeRay simulator in `default` only (on the real control
    plane the real operator reconciles a namespace of its own)."""

    @pytest.fixture(scope="module", name="kuberay")
    def kuberay(kube_server: Any, ray_head: Any) -> Iterator[Any]:
        from prefect_nemo.testing.operators import KubeRaySimulator

        with KubeRaySimulator(
            kube_server, ray_head.dashboard_url, ray_head.token, namespace="default"
        ) as sim:
            yield sim

    return kuberay


def wait_until(predicate: Callable[[], Any], timeout_s: float = 60.0) -> Any:
    """Poll `predicate` every 0.1 s until it gives a truthy value or `timeout_s` passes; the
    last value either way."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.1)
    return predicate()


def job_events(prefect_api: str, resource_id: str, until: str, timeout_s: float = 30) -> list[Any]:
    """The prefect-nemo.job.* events of one job, oldest first, once `until` is among them."""
    import httpx

    events: list[Any] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        body = {"filter": {"resource": {"id": [resource_id]}}, "limit": 50}
        events = httpx.post(f"{prefect_api}/events/filter", json=body).json()["events"]
        if any(e["event"] == until for e in events):
            break
        time.sleep(0.5)
    return sorted(events, key=lambda e: e["occurred"])


def subprocess_env(prefect_api: str, **extra: str) -> dict[str, str]:
    """Environment for a child process that talks to the session's Prefect API."""
    env = dict(os.environ, PREFECT_API_URL=prefect_api, PYTHONUNBUFFERED="1", **extra)
    env.pop("PREFECT_PROFILE", None)
    return env


# -- Slurm: one real local cluster (munge, MariaDB, slurmdbd, slurmctld, slurmd) and an sshd ------


@pytest.fixture(scope="session")
def slurm() -> Iterator[Any]:
    """A real one-node Slurm cluster + sshd on 127.0.0.1 (started, or the running one reused)."""
    from prefect_nemo.testing.slurm import LocalSlurm, unavailable_reason

    reason = unavailable_reason()
    if reason:
        if IN_CI:
            pytest.fail(f"CI needs the local Slurm cluster: {reason}")
        pytest.skip(reason)
    with LocalSlurm() as cluster:  # stops it at the end only if this session started it
        yield cluster
