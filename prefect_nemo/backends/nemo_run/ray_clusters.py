"""Ray on DGX Cloud Lepton and DGX Cloud (run:ai) for multi-node RL, on NeMo-Run's Ray classes.

Lepton (`LeptonRayBackend`): a Lepton RayCluster is created unless one by that name exists
(then it is reused); the create request is the one NeMo-Run's ``LeptonRayCluster.create``
builds (recorded, `dry_run.recording`) with one addition, the `RUN_LABEL` naming the flow run
it is created for, and we send it with the workspace client. Jobs are Ray jobs submitted
through the workspace's dashboard proxy ``{workspace url}/rayclusters/<name>/dashboard`` with
the workspace token, as NeMo-Run's ``LeptonRayJob`` does, but by our `RayJobsBackend`
(deterministic submission ids, so a re-run attaches; statuses in one list call; stop; logs).
The cluster is read and deleted with the workspace client itself (no process env, no lock).
It outlives its jobs; the run it was created for deletes it when it ends, however it ends
(`teardown_for`, tracked by the Prefect side), unless the block keeps it (``keep_cluster``);
one a crashed run left is found by its label (`cleanup`). A create that fails raises, except
"already exists", which is the cluster to attach to.

DGX Cloud (`DGXCloudRayBackend`): there is no RayCluster on run:ai. NeMo-Run's
``DGXCloudRayJob`` deploys a bootstrap script to the PVC (a busybox workspace) and creates a
distributed workload whose pods start Ray (worker-0 the head) and run the command on the head.
Each job is one such workload, named by our job id, so status, stop (the documented suspend)
and attach are the DGX Cloud backend's. The code reaches the pods as in `DGXCloudBackend`:
env-var chunks unpacked on the PVC behind the rank-0 gate.
"""

from __future__ import annotations

import base64
import functools
import gzip
import re
import shlex
import time
from collections.abc import AsyncGenerator, Callable, Collection
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlsplit

from prefect_nemo import jobs, names
from prefect_nemo.backends.nemo_run.base import poll_logs
from prefect_nemo.backends.nemo_run.dgx_cloud import (
    ARGS_LIMIT,
    DGXCloudBackend,
    _handle,
    _quiet,
)
from prefect_nemo.backends.nemo_run.dry_run import Sent, recording
from prefect_nemo.backends.nemo_run.isolation import nemo_run, root_logger_kept
from prefect_nemo.backends.nemo_run.lepton import (
    LeptonBackend,
    LeptonConfig,
    dry_run_client_args,
    lepton_answer,
)
from prefect_nemo.backends.nemo_run.runai import workload_document
from prefect_nemo.backends.ray_jobs import RayJobsBackend
from prefect_nemo.errors import BackendUnavailable, InvalidJobSpec
from prefect_nemo.jobs import META_FLOW_RUN, JobHandle, JobSpec, JobState, JobStatus, OwnedJob
from prefect_nemo.packaging import TransportPlan

#: Lepton RayCluster names: NeMo-Run cuts longer ones to 34 characters.
MAX_CLUSTER_NAME = 35
#: The label a Ray cluster created for a flow run carries: that run's id. The run's teardown
#: deletes it; `prefect-nemo cleanup` deletes one whose run is over (a crashed run's).
RUN_LABEL = "prefect-nemo/flow-run"
#: NeMo-Run's script-deploy command: ``echo <gzip+base64> | base64 -d | gunzip > <path>``.
_DEPLOYED = re.compile(r"echo (\S+) \| base64 -d \| gunzip > (\S+)")


class LeptonRayBackend:
    """Ray jobs on a Lepton RayCluster, created (NeMo-Run's request) unless one by that name
    exists. A cluster created for a run carries that run's label (`RUN_LABEL`) and is deleted
    when the run ends (`teardown_for`), unless the block keeps it (`keep_cluster`)."""

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
        keep_cluster: bool = False,
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
        self.keep_cluster = keep_cluster
        self.lepton = LeptonBackend(config)  # the workspace client and its error mapping
        self._ray: RayJobsBackend | None = None

    # -- identity -------------------------------------------------------------------------------

    @property
    def cluster(self) -> str:
        """The workspace and the Ray cluster in it."""
        return f"{self.lepton.cluster}/rayclusters/{self.cluster_name}"

    @property
    def credentials_key(self) -> str:
        """The workspace token, hashed."""
        return names.secret_hash(self.config.token)

    @property
    def secrets(self) -> list[str]:
        """The workspace token."""
        return [self.config.token]

    @property
    def ray(self) -> RayJobsBackend:
        """Our Ray Jobs backend on the proxied dashboard (the workspace token authenticates)."""
        if self._ray is None:
            client = self.lepton.client
            self._ray = self._ray_jobs(self.cluster_name, client.url, client.workspace_origin_url)
        return self._ray

    def _ray_jobs(self, name: str, url: str, origin: str | None) -> RayJobsBackend:
        """The Ray Jobs backend of Ray cluster `name` behind the workspace API at `url`."""
        return RayJobsBackend(
            f"{url}/rayclusters/{name}/dashboard",
            token=self.config.token,
            headers={"origin": origin} if origin else {},
            request_timeout_s=self.config.request_timeout_s,
        )

    def handle(self, job_id: str) -> JobHandle:
        """The job's handle on this Ray cluster (the Ray backend's, with its dashboard link)."""
        return self.ray.handle(job_id).model_copy(
            update={"backend": self.kind, "cluster": self.cluster}
        )

    # -- the Ray cluster ------------------------------------------------------------------------

    def cluster_request(self, node_group_id: str, owner: str | None) -> dict[str, Any]:
        """The create request of the Ray cluster, as NeMo-Run's ``LeptonRayCluster.create``
        builds it (run with its requests answered locally: `dry_run.recording`), labelled
        with the flow run it is created for (`owner`) unless the block keeps the cluster."""
        nemo_run()
        from nemo_run.run.ray.lepton import LeptonRayCluster  # NeMo-Run's, unchanged

        executor = self.lepton.make_executor(JobSpec(entrypoint="ray"), self.cluster_name)
        executor.nodes = self.worker_nodes
        executor.head_resource_shape = self.head_resource_shape
        executor.ray_version = self.ray_version
        answer = lepton_answer(self.config, node_group_id=node_group_id)
        with (
            recording(answer, _creates_cluster, dry_run_client_args(self.config)) as recorder,
            root_logger_kept(),
        ):
            LeptonRayCluster(name=self.cluster_name, executor=executor).create()
        (sent,) = recorder.sent
        request = dict(sent.body)
        if owner and not self.keep_cluster:
            metadata = request["metadata"] = dict(request.get("metadata") or {})
            metadata["labels"] = {**(metadata.get("labels") or {}), RUN_LABEL: owner}
        return request

    def _node_group_id(self) -> str:
        groups = self.lepton._call(self.lepton.client.nodegroup.list_all, "listing node groups")
        for group in groups:
            if group.metadata.name == self.config.node_group:
                return str(group.metadata.id_)
        raise InvalidJobSpec(
            f"LeptonWorkspace.node_group: no dedicated node group '{self.config.node_group}' in "
            f"workspace '{self.config.workspace_id}'"
        )

    def _get(self, name: str) -> Any:
        """The workspace's Ray cluster `name` (leptonai's model), or None."""
        from leptonai.api.v1.api_resource import ClientError

        client = self.lepton.client
        try:
            return self.lepton._call(
                lambda: client.raycluster.get(name), f"reading Ray cluster {name}"
            )
        except ClientError as exc:
            if exc.response.status_code == 404:
                return None
            raise

    def cluster_state(self) -> dict[str, Any] | None:
        """The cluster's state and ray_ready (head and workers up, as NeMo-Run reads it); None
        when there is none. Read with the workspace client (explicit token): no process env and
        no lock, so status polls never wait behind a launch."""
        cluster = self._get(self.cluster_name)
        if cluster is None:
            return None
        state = cluster.status.state.value if cluster.status is not None else ""
        return {"state": state, "ray_ready": state == "Ready"}

    def ensure_cluster(self, *, poll_s: float = 2.0, owner: str | None = None) -> None:
        """Create the Ray cluster unless it exists (labelled for flow run `owner`), then wait
        until Ray is ready."""
        from leptonai.api.v1.api_resource import ClientError
        from leptonai.api.v1.types.raycluster import LeptonRayCluster

        if self.cluster_state() is None:
            try:
                request = self.cluster_request(self._node_group_id(), owner)
            except RuntimeError as exc:  # NeMo-Run's own checks
                raise BackendUnavailable(
                    f"Lepton Ray cluster '{self.cluster_name}' could not be created: {exc}"
                ) from None
            client = self.lepton.client
            try:
                self.lepton._call(
                    lambda: client.raycluster.create(LeptonRayCluster.model_validate(request)),
                    f"creating Ray cluster {self.cluster_name}",
                )
            except ClientError as exc:
                if exc.response.status_code != 409:  # 409: someone created it meanwhile
                    raise BackendUnavailable(
                        f"Lepton refused Ray cluster '{self.cluster_name}': {exc}"
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

    def delete_cluster(self, *, timeout_s: float = 120.0, name: str | None = None) -> bool:
        """Delete the Ray cluster (this block's, or `name`) and wait until it is gone (True)
        or the timeout (False)."""
        from leptonai.api.v1.api_resource import ClientError

        name = name or self.cluster_name
        client = self.lepton.client
        try:
            self.lepton._call(
                lambda: client.raycluster.delete(name), f"deleting Ray cluster {name}"
            )
        except ClientError as exc:
            if exc.response.status_code != 404:
                raise
        deadline = time.monotonic() + timeout_s
        while self._get(name) is not None:
            if time.monotonic() > deadline:
                return False
            time.sleep(1.0)
        return True

    # -- teardown and cleanup -------------------------------------------------------------------

    def teardown_for(self, flow_run_id: str) -> Callable[[], str] | None:
        """What to call when flow run `flow_run_id` ends, however it ends: it deletes the Ray
        cluster if that run created it (the cluster's `RUN_LABEL` says so). None when the block
        keeps its cluster."""
        if self.keep_cluster:
            return None
        return functools.partial(self.delete_if_created_by, flow_run_id)

    def delete_if_created_by(self, flow_run_id: str) -> str:
        """Delete the Ray cluster if flow run `flow_run_id` created it; never raises, returns
        what happened (for the run's teardown log)."""
        name = self.cluster_name
        try:
            cluster = self._get(name)
            if cluster is None:
                return f"Lepton Ray cluster {name} is already gone"
            owner = _labels(cluster).get(RUN_LABEL)
            if owner != flow_run_id:
                return f"Lepton Ray cluster {name} kept: this run did not create it"
            if self.delete_cluster(timeout_s=self.config.request_timeout_s * 4):
                return f"Lepton Ray cluster {name} deleted"
            return f"Lepton Ray cluster {name}: deletion requested, still there"
        except Exception as exc:  # a teardown reports, it never raises
            return f"Lepton Ray cluster {name} could not be deleted: {exc}"

    def cleanup(self, run_is_over: Callable[[str], bool]) -> list[str]:
        """Delete the workspace's Ray clusters created for a flow run that is over (a crashed
        run leaves its cluster: its `RUN_LABEL` names the run) and running no Ray job; returns
        their names. `run_is_over(flow_run_id)` asks the orchestrator."""
        client = self.lepton.client
        clusters = self.lepton._call(client.raycluster.list_all, "listing Ray clusters")
        removed = []
        for cluster in clusters:
            name = str(cluster.metadata.id_ if cluster.metadata else "")
            owner = _labels(cluster).get(RUN_LABEL)
            if not name or not owner or not run_is_over(owner) or self._has_live_jobs(name):
                continue
            if self.delete_cluster(name=name, timeout_s=self.config.request_timeout_s * 4):
                removed.append(f"Lepton Ray cluster {name} (created for flow run {owner})")
        return removed

    def _has_live_jobs(self, name: str) -> bool:
        """True when Ray cluster `name` runs or queues a Ray job (or cannot tell: then keep)."""
        cluster = self._get(name)
        state = cluster.status.state.value if cluster and cluster.status else ""
        if state != "Ready":
            return False  # no Ray to run jobs on
        client = self.lepton.client
        ray = self._ray_jobs(name, client.url, client.workspace_origin_url)
        try:
            jobs = ray._call(ray.client.list_jobs)
        except Exception:
            return True
        finally:
            ray.close()
        return any(not JobState(str(j.status.value)).is_terminal() for j in jobs)

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
        """Ensure the cluster (created for this job's flow run if missing), then submit the
        Ray job under job_id (JobAlreadyExists if taken)."""
        self.ensure_cluster(owner=metadata.get(META_FLOW_RUN) or None)
        self.ray.submit(spec, job_id, metadata)
        return self.handle(job_id)

    def render(self, spec: JobSpec, job_id: str, metadata: dict[str, str]) -> list[dict[str, Any]]:
        """What `submit` would send, sending nothing: the cluster's create request (sent only
        when no cluster of that name exists), then the Ray job submission (`RayJobsBackend`)."""
        owner = metadata.get(META_FLOW_RUN) or None
        request = self.cluster_request(f"<id of node group {self.config.node_group}>", owner)
        return [
            {
                "kind": "LeptonRayCluster",
                "method": "POST",
                "path": f"{urlsplit(self.lepton.client.url).path}/rayclusters",
                "sent_if": f"workspace {self.config.workspace_id} has no Ray cluster named "
                f"{self.cluster_name} (else the job runs on that one)",
                "request": request,
            },
            *self.ray.render(spec, job_id, metadata),
        ]

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

    def owned_jobs(self) -> list[OwnedJob]:
        """Our live Ray jobs on the cluster (one Ray list call: their metadata names the
        owner); none when the cluster is not up."""
        return self.ray.owned_jobs() if self._cluster_up() else []

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
        idempotent. The Ray cluster is left as it is: `teardown_for` and `delete_cluster` end
        it."""
        self.lepton.close()
        if self._ray is not None:
            self._ray.close()

    def _cluster_up(self) -> bool:
        state = self.cluster_state()
        return bool(state and state.get("ray_ready"))


def _creates_cluster(method: str, path: str) -> bool:
    return method == "POST" and path.endswith("/rayclusters")


def _labels(cluster: Any) -> dict[str, str]:
    return dict((cluster.metadata.labels if cluster.metadata else None) or {})


class DGXCloudRayBackend(DGXCloudBackend):
    """Ray jobs on DGX Cloud: one distributed workload per job, bootstrapped by NeMo-Run."""

    kind: ClassVar[str] = "dgx-cloud-ray"

    def validate(self, spec: JobSpec) -> None:
        """A Ray job takes no launcher (Ray starts its workers), then DGX Cloud's checks."""
        jobs.refuse_launcher(spec, self.kind)
        super().validate(spec)

    def _command(self, spec: JobSpec, plan: TransportPlan | None, job_id: str) -> str:
        """What the bootstrap runs on the head once Ray is up: unpack the code, run."""
        if plan is None:
            return spec.entrypoint or ""
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

    def launch_app(
        self, spec: JobSpec, job_id: str, metadata: dict[str, str], local_dir: Path | None = None
    ) -> str | None:
        """Start NeMo-Run's DGXCloudRayJob: one distributed workload that bootstraps Ray,
        carrying its owner as `DGXCloudBackend`'s workloads do."""
        nemo_run()
        from nemo_run.run.ray.dgxcloud import DGXCloudRayJob  # NeMo-Run's, unchanged

        executor = self.make_executor(spec, job_id)
        plan = self.add_code_env(spec, executor)
        self.carry_owner(executor, metadata)
        job = DGXCloudRayJob(name=job_id, executor=executor)
        with root_logger_kept(), _quiet():
            try:
                workload_id = job.start(command=self._command(spec, plan, job_id), workdir="")
            except RuntimeError as exc:
                raise BackendUnavailable(f"DGX Cloud refused the Ray workload: {exc}") from None
        return _handle("distributed", str(workload_id))

    def sent_documents(
        self, job_id: str, local_dir: Path, sent: list[Sent]
    ) -> list[dict[str, Any]]:
        """The script-deploy workspace (its gzip'd, base64 payload shown as the Ray bootstrap
        script it writes, the next document), then the distributed workload that runs it."""
        out: list[dict[str, Any]] = []
        for item in sent:
            doc = workload_document(item)
            args = str((item.body or {}).get("spec", {}).get("args", ""))
            packed = _DEPLOYED.search(args)
            if packed is None:
                out.append(doc)
                continue
            script = gzip.decompress(base64.b64decode(packed[1])).decode()
            doc["request"]["spec"]["args"] = args.replace(
                packed[1], "<the Ray bootstrap script below, gzip + base64>"
            )
            out += [doc, {"kind": "RayBootstrapScript", "path": packed[2], "script": script}]
        return out
