"""Ray on DGX Cloud Lepton and DGX Cloud (run:ai) for multi-node RL, on NeMo-Run's Ray classes.

Lepton (`LeptonRayBackend`): NeMo-Run's ``LeptonRayCluster`` creates (or, when one by that
name exists, reuses) a Lepton RayCluster; jobs are Ray jobs submitted through the workspace's
dashboard proxy ``{workspace url}/rayclusters/<name>/dashboard`` with the workspace token, as
NeMo-Run's ``LeptonRayJob`` does, but by our `RayJobsBackend` (deterministic submission ids,
so a re-run attaches; statuses in one list call; stop; logs). The cluster's state is read with
the workspace client itself (the process env and its lock are only for NeMo-Run's create and
delete). The cluster outlives its jobs, and nothing deletes it on its own (it keeps its nodes):
`delete_cluster()` ends it. A create that fails raises, except "already exists", which is the
cluster to attach to.

DGX Cloud (`DGXCloudRayBackend`): there is no RayCluster on run:ai. NeMo-Run's
``DGXCloudRayJob`` deploys a bootstrap script to the PVC (a busybox workspace) and creates a
distributed workload whose pods start Ray (worker-0 the head) and run the command on the head.
Each job is one such workload, named by our job id, so status, stop (the documented suspend)
and attach are the DGX Cloud backend's. The code reaches the pods as in `DGXCloudBackend`:
env-var chunks unpacked on the PVC behind the rank-0 gate.
"""

from __future__ import annotations

import base64
import gzip
import shlex
import time
from collections.abc import AsyncGenerator, Collection
from typing import Any, ClassVar

from prefect_nemo import names
from prefect_nemo.backends.nemo_run.base import poll_logs
from prefect_nemo.backends.nemo_run.dgx_cloud import ARGS_LIMIT, DGXCloudBackend, _handle, _quiet
from prefect_nemo.backends.nemo_run.isolation import nemo_run, root_logger_kept
from prefect_nemo.backends.nemo_run.lepton import LeptonBackend, LeptonConfig, workspace_env
from prefect_nemo.backends.ray_jobs import RayJobsBackend
from prefect_nemo.errors import BackendUnavailable, InvalidJobSpec
from prefect_nemo.jobs import JobHandle, JobSpec, JobStatus
from prefect_nemo.packaging import TransportPlan

#: Lepton RayCluster names: NeMo-Run cuts longer ones to 34 characters.
MAX_CLUSTER_NAME = 35


class LeptonRayBackend:
    """Ray jobs on a Lepton RayCluster that NeMo-Run creates or reuses.

    A cluster created by `submit` is not deleted when its jobs end (it is shared by the jobs
    and runs of the block, and keeps its nodes): `delete_cluster()` ends it."""

    kind: ClassVar[str] = "lepton-ray"
    max_job_id_len: ClassVar[int] = names.MAX_LABEL

    def __init__(
        self,
        config: LeptonConfig,
        *,
        cluster_name: str,
        head_resource_shape: str = "",
        ray_version: str | None = None,
        worker_nodes: int | None = None,
        ready_timeout_s: float = 1800.0,
    ) -> None:
        if not names.is_dns1035_label(cluster_name, MAX_CLUSTER_NAME):
            raise InvalidJobSpec(
                f"LeptonRayCluster.ray_cluster_name='{cluster_name}': use 1-{MAX_CLUSTER_NAME} "
                "lowercase letters, digits and '-', starting with a letter"
            )
        self.config = config
        self.cluster_name = cluster_name
        self.head_resource_shape = head_resource_shape
        self.ray_version = ray_version
        self.worker_nodes = worker_nodes or config.nodes
        self.ready_timeout_s = ready_timeout_s
        self.lepton = LeptonBackend(config)  # the workspace client and its error mapping
        self._ray: RayJobsBackend | None = None

    # -- identity -------------------------------------------------------------------------------

    @property
    def cluster(self) -> str:
        """The workspace and the Ray cluster in it."""
        return f"{self.lepton.cluster}/rayclusters/{self.cluster_name}"

    @property
    def secrets(self) -> list[str]:
        """The workspace token."""
        return [self.config.token]

    @property
    def dashboard_url(self) -> str:
        """The Ray dashboard (Jobs API) behind the workspace's proxy."""
        return f"{self.lepton.client.url}/rayclusters/{self.cluster_name}/dashboard"

    @property
    def ray(self) -> RayJobsBackend:
        """Our Ray Jobs backend on the proxied dashboard (the workspace token authenticates)."""
        if self._ray is None:
            origin = self.lepton.client.workspace_origin_url
            self._ray = RayJobsBackend(
                self.dashboard_url,
                token=self.config.token,
                headers={"origin": origin} if origin else {},
                request_timeout_s=self.config.request_timeout_s,
            )
        return self._ray

    def handle(self, job_id: str) -> JobHandle:
        """The job's handle on this Ray cluster (the Ray backend's, with its dashboard link)."""
        return self.ray.handle(job_id).model_copy(
            update={"backend": self.kind, "cluster": self.cluster}
        )

    # -- the Ray cluster ------------------------------------------------------------------------

    def _nemo_cluster(self) -> Any:
        nemo_run()
        from nemo_run.run.ray.lepton import LeptonRayCluster  # NeMo-Run's, unchanged

        executor = self.lepton.make_executor(JobSpec(entrypoint="ray"), self.cluster_name)
        executor.nodes = self.worker_nodes
        executor.head_resource_shape = self.head_resource_shape
        executor.ray_version = self.ray_version
        return LeptonRayCluster(name=self.cluster_name, executor=executor)

    def cluster_state(self) -> dict[str, Any] | None:
        """The cluster's state and ray_ready (head and workers up, as NeMo-Run reads it); None
        when there is none. Read with the workspace client (explicit token): no process env and
        no lock, so status polls never wait behind a launch."""
        from leptonai.api.v1.api_resource import ClientError

        client = self.lepton.client
        try:
            cluster = self.lepton._call(
                lambda: client.raycluster.get(self.cluster_name),
                f"reading Ray cluster {self.cluster_name}",
            )
        except ClientError as exc:
            if exc.response.status_code == 404:
                return None
            raise
        state = cluster.status.state.value if cluster.status is not None else ""
        return {"state": state, "ray_ready": state == "Ready"}

    def ensure_cluster(self, *, poll_s: float = 2.0) -> None:
        """Create the Ray cluster unless it exists, then wait until Ray is ready."""
        from leptonai.api.v1.api_resource import ClientError

        if self.cluster_state() is None:
            cluster = self._nemo_cluster()
            try:
                with workspace_env(self.config), root_logger_kept():
                    self.lepton._call(cluster.create, f"creating Ray cluster {self.cluster_name}")
            except ClientError as exc:
                if exc.response.status_code != 409:  # 409: someone created it meanwhile
                    raise BackendUnavailable(
                        f"Lepton refused Ray cluster '{self.cluster_name}': {exc}"
                    ) from None
            except RuntimeError as exc:  # NeMo-Run's own checks (node group, ...)
                raise BackendUnavailable(
                    f"Lepton Ray cluster '{self.cluster_name}' could not be created: {exc}"
                ) from None
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            state = self.cluster_state()
            if state and state.get("ray_ready"):
                return
            if time.monotonic() > deadline:
                raise BackendUnavailable(
                    f"Lepton Ray cluster '{self.cluster_name}' is not ready after "
                    f"{self.ready_timeout_s:g}s (state {state and state.get('state')})"
                )
            time.sleep(poll_s)

    def delete_cluster(self, *, timeout_s: float = 120.0) -> bool:
        """Delete the Ray cluster and wait until it is gone (True) or the timeout (False)."""
        cluster = self._nemo_cluster()
        with workspace_env(self.config), root_logger_kept():
            return bool(
                self.lepton._call(
                    lambda: cluster.delete(wait=True, timeout=int(timeout_s), poll_interval=1),
                    f"deleting Ray cluster {self.cluster_name}",
                )
            )

    # -- Backend protocol -----------------------------------------------------------------------

    def validate(self, spec: JobSpec) -> None:
        """What Ray would refuse; placement belongs to the cluster (its worker groups)."""
        if spec.placement is not None and spec.placement.nodes > 1:
            raise InvalidJobSpec(
                "JobSpec.placement.nodes: a Ray job runs on the Ray cluster's nodes; size "
                "the cluster with LeptonRayCluster.worker_nodes and use placement groups in "
                "the driver"
            )
        self.ray.validate(spec)

    def check_access(self) -> None:
        """The workspace token and node group (the cluster may not exist yet)."""
        self.lepton.check_access()

    def submit(self, spec: JobSpec, job_id: str, metadata: dict[str, str]) -> JobHandle:
        """Ensure the cluster (created if missing, and left running: see `delete_cluster`),
        then submit the Ray job under job_id (JobAlreadyExists if taken)."""
        self.ensure_cluster()
        self.ray.submit(spec, job_id, metadata)
        return self.handle(job_id)

    def find(self, job_id: str) -> JobStatus | None:
        """The Ray job's status; None if the cluster or the job is not there."""
        if not self._cluster_up():
            return None
        return self.ray.find(job_id)

    def statuses(self, job_ids: Collection[str]) -> dict[str, JobStatus]:
        """One Ray list call for every job watched on the cluster."""
        if not self._cluster_up():
            return {}
        return self.ray.statuses(job_ids)

    def request_stop(self, job_id: str) -> None:
        """Ask Ray to stop the job."""
        if self._cluster_up():
            self.ray.request_stop(job_id)

    def logs(self, job_id: str) -> str:
        """The Ray job's whole log."""
        return self.ray.logs(job_id) if self._cluster_up() else ""

    def tail_logs(self, job_id: str) -> AsyncGenerator[str, None]:
        """The log, polled every second (the workspace proxy carries no websocket)."""
        return poll_logs(self, job_id)

    def close(self) -> None:
        """Close the workspace client and the Ray Jobs backend (no threads: their connections);
        idempotent. The Ray cluster keeps running: `delete_cluster()` ends it."""
        self.lepton.close()
        if self._ray is not None:
            self._ray.close()

    def _cluster_up(self) -> bool:
        state = self.cluster_state()
        return bool(state and state.get("ray_ready"))


class DGXCloudRayBackend(DGXCloudBackend):
    """Ray jobs on DGX Cloud: one distributed workload per job, bootstrapped by NeMo-Run."""

    kind: ClassVar[str] = "dgx-cloud-ray"

    def _command(self, spec: JobSpec, plan: TransportPlan | None, job_id: str) -> str:
        """What the bootstrap runs on the head once Ray is up: unpack the code, run."""
        if plan is None:
            return spec.entrypoint
        # Only the head runs it, so it unpacks alone: no rank gate needed.
        dest = f"{self.config.pvc_nemo_run_dir}/code/{job_id}"
        return f"{plan.setup_command(dest)} && cd {shlex.quote(dest)} && {spec.entrypoint}"

    def check_code(self, spec: JobSpec, plan: TransportPlan | None) -> None:
        """The bootstrap script travels gzip'd + base64 in one workspace's args."""
        nemo_run()
        from nemo_run.run.ray.dgxcloud import build_ray_bootstrap_script

        longest = "x" * self.max_job_id_len
        script = build_ray_bootstrap_script(
            self._command(spec, plan, longest), 0, 1, self.config.pvc_nemo_run_dir
        )
        size = len(base64.b64encode(gzip.compress(script.encode(), compresslevel=9))) + 200
        if size > ARGS_LIMIT:
            raise InvalidJobSpec(
                f"JobSpec.entrypoint: the Ray bootstrap script is {size} characters once packed; "
                f"run:ai takes at most {ARGS_LIMIT}: move the long part into working_dir"
            )

    def launch_app(self, spec: JobSpec, job_id: str) -> str | None:
        """Start NeMo-Run's DGXCloudRayJob: one distributed workload that bootstraps Ray."""
        nemo_run()
        from nemo_run.run.ray.dgxcloud import DGXCloudRayJob  # NeMo-Run's, unchanged

        executor = self.make_executor(spec, job_id)
        plan = self.add_code_env(spec, executor)
        job = DGXCloudRayJob(name=job_id, executor=executor)
        with root_logger_kept(), _quiet():
            try:
                workload_id = job.start(command=self._command(spec, plan, job_id), workdir="")
            except RuntimeError as exc:
                raise BackendUnavailable(f"DGX Cloud refused the Ray workload: {exc}") from None
        return _handle("distributed", str(workload_id))
