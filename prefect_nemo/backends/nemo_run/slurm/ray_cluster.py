"""Ray on Slurm: a Ray cluster started inside one Slurm allocation by NeMo-Run's
``SlurmRayCluster`` (its sbatch template ``ray.sub.j2``, unchanged), and the Ray Jobs backend
that reaches its head's dashboard.

The allocation is sbatch'ed through the Slurm block's SSH connection with the block's account,
partition, time, setup lines and env (NeMo-Run's template reads its ports and
``CPUS_PER_WORKER`` from the env). NeMo-Run writes ``ray_cluster_info.json`` (head IP, dashboard
port) once every node has joined; Ray jobs then go to ``http://<head ip>:<dashboard port>``,
so the machine running the flow must reach the head node (run the flow on the login node or
inside the cluster's network). `delete` scancels the allocation and waits until
``squeue`` no longer lists it. The allocation carries its flow run in its Slurm comment, as our
jobs do, so `SlurmBackend.owned_jobs` lists it (by its job name) for the sweeper.
"""

from __future__ import annotations

import shlex
import time
from typing import Any

from prefect_nemo.backends.nemo_run.isolation import nemo_run, root_logger_kept
from prefect_nemo.backends.nemo_run.slurm.accounting import SLURM_STATES, owner_comment
from prefect_nemo.backends.nemo_run.slurm.executor import SlurmBackend
from prefect_nemo.errors import BackendUnavailable, InvalidJobSpec
from prefect_nemo.jobs import JobSpec
from prefect_nemo.redaction import Redactor

#: Where the clusters' dirs go, under the block's remote job dir (NeMo-Run's cluster_dir).
CLUSTERS_DIR = "ray-clusters"
#: How much of the allocation's logs a startup error carries: lines per log, characters in all.
LOG_TAIL_LINES, LOG_TAIL_CHARS = 12, 4000


class SlurmRay:
    """One Ray cluster in one Slurm allocation of `nodes` nodes, named `name`."""

    def __init__(
        self,
        slurm: SlurmBackend,
        *,
        name: str,
        nodes: int = 2,
        ready_timeout_s: float = 600.0,
        pre_ray_start_commands: list[str] | None = None,
        owner: str | None = None,
    ) -> None:
        if nodes < 1:
            raise InvalidJobSpec(f"nodes={nodes}: a Ray cluster needs at least 1 node")
        self.slurm = slurm
        self.name = name
        self.nodes = nodes
        self.ready_timeout_s = ready_timeout_s
        self.pre_ray_start_commands = pre_ray_start_commands or []
        self.owner = owner
        self.slurm_job_id: str | None = None
        self._cluster: Any = None

    @property
    def cluster_dir(self) -> str:
        """NeMo-Run's cluster dir on the login node: ray.sub, logs/, ray_cluster_info.json."""
        return f"{self.slurm.remote_root()}/{CLUSTERS_DIR}/{self.name}"

    @property
    def job_name(self) -> str:
        """The allocation's Slurm job name, as NeMo-Run names it (and finds it again)."""
        from nemo_run.run.ray.slurm import SlurmRayRequest

        return str(SlurmRayRequest.get_job_name(self._ray_cluster().executor, self.name))

    def _ray_cluster(self) -> Any:
        """NeMo-Run's SlurmRayCluster on the block's executor settings, sized to `nodes`."""
        if self._cluster is None:
            nemo_run()
            from nemo_run.core.execution.slurm import SlurmJobDetails
            from nemo_run.run.ray.slurm import SlurmRayCluster

            executor = self.slurm.make_executor(JobSpec(entrypoint="ray"), self.name)
            executor.nodes = self.nodes
            executor.tunnel.job_dir = f"{self.slurm.remote_root()}/{CLUSTERS_DIR}"
            executor.job_details = SlurmJobDetails()  # NeMo-Run names the job, as it looks it up
            if self.owner:  # the sweeper's mark: a killed run's allocation is found and stopped
                executor.comment = owner_comment(self.owner)
            cpus = self.slurm.config.cpus_per_task
            if cpus and "CPUS_PER_WORKER" not in executor.env_vars:  # the template's 16 per GPU
                executor.env_vars["CPUS_PER_WORKER"] = str(cpus)
            self._cluster = SlurmRayCluster(name=self.name, executor=executor)
        return self._cluster

    def render(self) -> str:
        """The sbatch script NeMo-Run would submit (sends nothing)."""
        from nemo_run.run.ray.slurm import SlurmRayRequest

        cluster = self._ray_cluster()
        script: str = SlurmRayRequest(
            name=self.name,
            cluster_dir=self.cluster_dir,
            template_name="ray.sub.j2",
            executor=cluster.executor,
            pre_ray_start_commands=self.pre_ray_start_commands or None,
            launch_cmd=["sbatch", "--parsable"],
        ).materialize()
        return script

    def start(self, *, poll_s: float = 1.0) -> str:
        """`submit`, then wait until every node has joined Ray; returns its head's dashboard
        address (where Ray Jobs go). On any failure the allocation is cancelled before the
        error is raised: nothing is left queued."""
        try:
            self.submit()
            cluster = self._ray_cluster()
            with root_logger_kept():
                self._wait_ready(cluster, poll_s)
                info = cluster._get_ray_cluster_info()
        except BaseException:
            self.delete()
            raise
        return f"http://{info['head_ip']}:{info['dashboard_port']}"

    def submit(self) -> str:
        """sbatch the allocation (NeMo-Run's create: its template, its cluster dir); returns
        its Slurm job id (a live cluster of this name is reused, as NeMo-Run does)."""
        from invoke.exceptions import UnexpectedExit

        cluster = self._ray_cluster()
        try:
            # Slurm opens the batch output in logs/ and creates no directory; NeMo-Run
            # makes only the cluster dir: without this the batch step fails at once
            self.slurm.run(f"mkdir -p {shlex.quote(self.cluster_dir)}/logs")
            with root_logger_kept():
                sid = cluster.create(pre_ray_start_commands=self.pre_ray_start_commands or None)
                self.slurm_job_id = sid or cluster.status()["job_id"]
        except UnexpectedExit as exc:
            detail = (exc.result.stderr or exc.result.stdout).strip()[-300:]
            raise BackendUnavailable(
                f"sbatch refused Ray cluster '{self.name}': {detail}"
            ) from None
        return str(self.slurm_job_id)

    def _wait_ready(self, cluster: Any, poll_s: float) -> None:
        """Poll NeMo-Run's status until Ray is ready on a RUNNING allocation. (Its own
        wait_until_running matches states exactly, so sacct's "CANCELLED by 0" of an
        allocation cancelled meanwhile would keep it waiting until the timeout.)"""
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            status = cluster.status()
            state = str(status.get("state") or "").split(" ")[0]
            if state == "RUNNING" and status.get("ray_ready"):
                return
            # over (sacct may add "by <uid>"); NeMo-Run says NOT_FOUND for one gone from both
            ended = SLURM_STATES.get(state)
            if state == "NOT_FOUND" or (ended is not None and ended.is_terminal()):
                raise BackendUnavailable(
                    f"Ray cluster '{self.name}' (Slurm job {self.slurm_job_id}) ended {state} "
                    f"before Ray was ready; {self._logs_tail()}"
                )
            if time.monotonic() > deadline:
                raise BackendUnavailable(
                    f"Ray cluster '{self.name}' (Slurm job {self.slurm_job_id}) did not come "
                    f"up within {self.ready_timeout_s:g}s (Slurm state {state}); "
                    f"{self._logs_tail()}"
                )
            time.sleep(poll_s)

    def _logs_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """Where the allocation's logs are and their last lines (the batch script's, the head's,
        each worker's): why Ray did not start, told to someone with no login to the cluster."""
        logs, redact = f"{self.cluster_dir}/logs", Redactor(self.slurm.secrets)
        try:
            out = self.slurm.run(f"tail -n {lines} {shlex.quote(logs)}/*.log", warn=True).stdout
        except Exception as exc:  # the error it goes into matters more than this detail
            return redact(f"its logs are in {logs} (not read: {exc})")
        tail = redact(out.strip())[-LOG_TAIL_CHARS:]
        if not tail:
            return f"its logs are in {logs} (none written)"
        return f"its logs are in {logs}; their last lines:\n{tail}"

    def delete(self, *, timeout_s: float = 60.0) -> str:
        """scancel the allocation and wait until squeue no longer lists it; never raises,
        returns what happened (for the run's teardown log)."""
        sid = self.slurm_job_id
        if sid is None:
            return f"Ray cluster {self.name}: no Slurm allocation was made"
        try:
            self.slurm.run(f"scancel {shlex.quote(sid)}", warn=True)
            deadline = time.monotonic() + timeout_s
            while self._queued(sid):
                if time.monotonic() > deadline:
                    return f"Ray cluster {self.name}: Slurm job {sid} cancelled, still queued"
                time.sleep(0.5)
            return f"Ray cluster {self.name}: Slurm job {sid} cancelled and gone"
        except Exception as exc:  # a teardown reports, it never raises
            return f"Ray cluster {self.name}: Slurm job {sid} could not be cancelled: {exc}"

    def _queued(self, sid: str) -> bool:
        out = self.slurm.run(f"squeue -h -j {shlex.quote(sid)} -o %T", warn=True).stdout
        return bool(out.strip())
