"""Ray on Slurm (issue 15 item 4): a Ray cluster started inside a 2-node allocation of the real
test Slurm by NeMo-Run's SlurmRayCluster, targeted by run_job for the life of a flow, and gone
(allocation, Ray processes) when the flow ends, however it ends."""

from __future__ import annotations

import contextvars
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.runtime import flow_run
from prefect.states import Cancelling

from prefect_nemo import BackendUnavailable, JobSpec, run_job, slurm_ray_cluster
from prefect_nemo.blocks.slurm import SlurmCluster
from prefect_nemo.local_ray import free_ports
from tests.conftest import wait_until
from tests.test_nemo_run_slurm import slurm_block

pytestmark = [pytest.mark.nemo_run, pytest.mark.slow, pytest.mark.xdist_group("slurm-ray")]

#: The ports NeMo-Run's ray.sub.j2 reads from the env (its defaults, 6379, 8265, ..., are the
#: ones a local Ray of another test may hold); the worker node's shim adds 100 to the fixed ones.
RAY_PORTS = (
    "PORT",
    "DASHBOARD_PORT",
    "RAY_CLIENT_SERVER_PORT",
    "DASHBOARD_AGENT_LISTEN_PORT",
    "NODE_MANAGER_PORT",
    "OBJECT_MANAGER_PORT",
    "RUNTIME_ENV_AGENT_PORT",
    "DASHBOARD_AGENT_GRPC_PORT",
    "METRICS_EXPORT_PORT",
)
#: NeMo-Run's template gives each node's Ray workers the ports MIN_WORKER_PORT..MAX_WORKER_PORT,
#: 54001-54257 by default (the worker node's shifted by the shim's 100), and Ray refuses to
#: start a node one of whose fixed ports lies in that range.
WORKER_PORTS = range(54001, 54257 + 100 + 1)


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def ray_ports() -> dict[str, str]:
    """A port for each of RAY_PORTS: free now, as is the worker node's (the port + 100); all
    different, and none inside either node's worker ports. (CI, twice: a free port given to
    the object manager became 54357 on the worker node, and its `ray start` failed.)"""
    chosen: list[int] = []
    while len(chosen) < len(RAY_PORTS):
        for port in free_ports(len(RAY_PORTS)):
            taken = {q for c in chosen for q in (c, c + 100)}
            if (
                port not in WORKER_PORTS
                and port + 100 not in WORKER_PORTS
                and not {port, port + 100} & taken
                and _bindable(port + 100)
            ):
                chosen.append(port)
    return {name: str(port) for name, port in zip(RAY_PORTS, chosen, strict=False)}


# NeMo-Run's template gives every node {"worker_units": 8} (its gpus_per_node=8)
DRIVER = """\
import ray

ray.init()
alive = [n for n in ray.nodes() if n["Alive"]]
print("ray nodes:", len(alive), "worker_units:", ray.cluster_resources()["worker_units"])
"""


@pytest.fixture
def multi_block(slurm, tmp_path: Path, prefect_api: str) -> SlurmCluster:
    """The Slurm block of the 2-node partition; jobs and Ray run this environment's python,
    through the test Slurm's site shims (`LocalSlurm.site_bin`)."""
    venv = Path(sys.executable).parent
    site = slurm.site_bin(venv / "ray")
    (tmp_path / "jobs").mkdir()
    return slurm_block(slurm, tmp_path / "jobs").model_copy(
        update={
            "partition": slurm.multi_partition,
            "cpus_per_task": 1,
            "setup_lines": f"export PATH={site}:{venv}:$PATH",
            "env": ray_ports(),
        }
    )


def _path_first(block: SlurmCluster) -> list[str]:
    """The block's PATH again on each node before Ray starts (NeMo-Run's
    pre_ray_start_commands): the step's shell startup files may put another python first,
    and the Ray job's driver must run this environment's."""
    return [block.setup_lines or ""]


def _queued(slurm, job_name: str) -> list[str]:
    out = slurm.run(["squeue", "-h", "-n", job_name, "-o", "%i %D %T"], check=False).stdout
    return out.strip().splitlines()


def _port_open(port: str) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", int(port))) == 0


def test_a_flow_runs_a_ray_job_on_a_two_node_ray_cluster_in_a_slurm_allocation(
    slurm, multi_block, tmp_path
):
    """The job reaches SUCCEEDED on Ray spanning both Slurm nodes; when the flow ends the
    allocation is gone from squeue (CANCELLED in sacct) and no Ray process of it is left."""
    name = f"ray-{uuid.uuid4().hex[:6]}"
    job_name = f"{slurm.account}-{slurm.account}.{name}"  # NeMo-Run's name for the allocation
    code = tmp_path / "driver"
    code.mkdir()
    (code / "driver.py").write_text(DRIVER)

    @flow
    def rl():
        with slurm_ray_cluster(
            multi_block, nodes=2, name=name, pre_ray_start_commands=_path_first(multi_block)
        ) as ray:
            during = _queued(slurm, job_name)
            owned = [j for j in multi_block.backend().owned_jobs() if j.job_id == job_name]
            result = run_job(
                JobSpec(entrypoint="python driver.py", working_dir=str(code), name="driver"),
                cluster=ray,
            )
            log = ray.backend().logs(result.handle.job_id)
        return during, result, log, owned, flow_run.id

    started = time.monotonic()
    during, result, log, owned, run_id = rl()
    took = time.monotonic() - started
    print(f"Ray on Slurm: 2-node cluster up, a Ray job, torn down in {took:.1f}s")
    assert len(during) == 1 and during[0].split()[1:] == ["2", "RUNNING"], during
    assert result.succeeded, result
    # the sweeper's view: the allocation is ours, owned by this flow run (Slurm comment)
    assert [j.flow_run_id for j in owned] == [run_id], owned
    assert "ray nodes: 2 worker_units: 16.0" in log, log
    assert _queued(slurm, job_name) == []
    sid = during[0].split()[0]
    assert slurm.wait_job(sid, ("CANCELLED",))["State"].startswith("CANCELLED")
    for port in ("PORT", "DASHBOARD_PORT"):  # the head's GCS and dashboard are gone too
        assert not _port_open(multi_block.env[port]), f"{port} still open: Ray orphaned"


def test_a_cluster_that_does_not_come_up_is_cancelled_and_the_flow_fails(slurm, multi_block):
    """Startup fails (not ready in time): the allocation is cancelled before the error."""
    name = f"ray-{uuid.uuid4().hex[:6]}"

    @flow
    def rl():
        with slurm_ray_cluster(multi_block, name=name, ready_timeout_s=1):
            raise AssertionError("never reached")

    with pytest.raises(BackendUnavailable, match=f"Ray cluster '{name}'.*did not come up"):
        rl()
    assert _queued(slurm, f"{slurm.account}-{slurm.account}.{name}") == []


def test_a_cluster_whose_ray_fails_to_start_fails_with_the_logs_last_lines(slurm, multi_block):
    """Ray's start fails on the head node: the allocation ends FAILED, and the error carries the
    last lines of its logs (the head's says why), not only where they are."""
    name = f"ray-{uuid.uuid4().hex[:6]}"
    # NeMo-Run's ray.sub probes the head with `ray status` until the head's srun is seen dead;
    # against a GCS that never started, that probe waits out Ray's reconnect timeout (60 s by
    # default, ~40 s of the test): 3 s here, the test is about the error, not that wait. In
    # setup_lines, not env: ray.sub upper-cases env names, and Ray reads this one as written.
    timeout = "export RAY_gcs_rpc_server_reconnect_timeout_s=3"
    quick = multi_block.model_copy(update={"setup_lines": f"{multi_block.setup_lines}\n{timeout}"})

    @flow
    def rl():
        broken = ["echo 'head-start-broke: no such venv' >&2; exit 7"]
        with slurm_ray_cluster(quick, name=name, pre_ray_start_commands=broken):
            raise AssertionError("never reached")

    with pytest.raises(BackendUnavailable, match=f"'{name}'.*before Ray was ready") as raised:
        rl()
    error = str(raised.value)
    assert "their last lines:" in error and "head-start-broke: no such venv" in error, error
    assert _queued(slurm, f"{slurm.account}-{slurm.account}.{name}") == []


def test_cancelling_the_flow_run_cancels_the_allocation(slurm, multi_block):
    """The flow run is cancelled through the API while its cluster waits in the queue: the
    run's stop hooks cancel the allocation and the flow ends."""
    name = f"ray-{uuid.uuid4().hex[:6]}"
    job_name = f"{slurm.account}-{slurm.account}.{name}"
    held = multi_block.model_copy(update={"additional_parameters": {"begin": "now+1hour"}})
    outcome: dict[str, object] = {}

    @flow
    def rl():
        outcome["id"] = flow_run.id
        with slurm_ray_cluster(held, name=name, ready_timeout_s=300):
            raise AssertionError("never reached")

    def run():
        outcome["state"] = rl(return_state=True)

    thread = threading.Thread(target=contextvars.copy_context().run, args=(run,), daemon=True)
    thread.start()
    assert wait_until(lambda: _queued(slurm, job_name), 60), "the allocation was never queued"
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(uuid.UUID(outcome["id"]), Cancelling(), force=True)
    assert wait_until(lambda: not _queued(slurm, job_name), 30), "the allocation is still queued"
    thread.join(60)
    assert not thread.is_alive(), "the flow must end once its cluster is gone"
    assert not outcome["state"].is_completed()


def test_the_allocation_of_a_killed_run_is_stopped_by_the_sweeper(slurm, multi_block):
    """Nothing in a SIGKILLed process runs, so the allocation carries its owner as every job we
    submit does (its Slurm comment): once that flow run is gone, `prefect-nemo sweep` finds
    the allocation among the block's jobs and cancels it."""
    from prefect_nemo.backends.nemo_run.slurm.ray_cluster import SlurmRay
    from prefect_nemo.tasks.sweeper import sweep

    held = multi_block.model_copy(
        update={"additional_parameters": {"begin": "now+1hour"}, "sweep_grace_s": 0}
    )
    dead_run = str(uuid.uuid4())  # a flow run the API never saw: what a killed run looks like
    ray = SlurmRay(held.backend(), name=f"ray-{uuid.uuid4().hex[:6]}", owner=dead_run)
    sid = ray.submit()  # sbatch'ed, then the process "died": nothing tears it down
    try:
        assert _queued(slurm, ray.job_name)
        [verdict] = [v for v in sweep([held]) if v.job_id == ray.job_name]
        assert verdict.stop and verdict.owner == dead_run, verdict
        assert wait_until(lambda: not _queued(slurm, ray.job_name), 30), "still queued"
    finally:
        slurm.run(["scancel", sid], check=False)
