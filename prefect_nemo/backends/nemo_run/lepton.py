"""DGX Cloud Lepton jobs through NeMo-Run's LeptonExecutor.

Submission is the executor's own ``launch()``: it writes the launch script, moves the job
directory to the shared mount with a busybox data-mover job and creates the Lepton job, whose
id is our job id (unique per run and attempt: NeMo-Run would use the task name, so re-runs
collided). A taken id means the job exists: attach. leptonai reads the workspace from
``LEPTON_WORKSPACE_ID/TOKEN/URL``; they are set only around NeMo-Run's calls, under a lock
(`workspace_env`), and our own calls pass them to ``APIClient`` explicitly.

Not through torchx's Lepton scheduler: it serializes the executor into NEMORUN_HOME and adds
nothing we use. The code never rides in NeMo-Run's data mover, whose whole tarball is one shell
argument (a pod cannot exec one past 128 KiB): it travels in env-var chunks of 96 KiB
(``packaging.plan_for("lepton")``) and a pre-launch command unpacks it on the shared mount,
LEPTON_JOB_WORKER_INDEX=0 only (the rank Lepton sets before NeMo-Run's init script maps it to
NODE_RANK), the other replicas waiting for its marker.

States: Queueing, Awaiting (the job waits in its node group's queue for nodes, by priority
class) → QUEUED, its reason Lepton's state (a job's status carries no message); Starting,
PendingRetry, Restarting, UNK → PENDING; Running (all replicas ready; else PENDING, as
NeMo-Run does), Stopping, Deleting → RUNNING; Completed, Archived → SUCCEEDED; Failed →
FAILED (its cause, for its recovery, from Kubernetes' words in the job's events:
`service.kube_failure`); Stopped, Deleted → STOPPED. Stop is
``PATCH {"spec": {"stopped": true}}`` (the job and its logs stay, out of the queue); NeMo-Run's
cancel deletes.

Where a job queues: JobSpec.queue is the dedicated node group (else LeptonWorkspace.node_group),
JobSpec.priority its ``spec.queue_config.priority_class`` (else LeptonWorkspace.priority_class,
else Lepton's default), one of Lepton's classes (`PRIORITY_CLASSES`, or the CLI's short names
low/mid/high, 1-9), checked before anything is sent.

Each job carries our labels (``metadata.labels``: managed-by prefect-nemo and the flow run that
submitted it, `service.owner_labels`), added to the job NeMo-Run creates (`dry_run.job_labels`);
`owned_jobs` lists the live jobs by that label (leptonai's ``query``, a label selector).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import requests

from prefect_nemo.backends.nemo_run.dry_run import (
    Answer,
    Sent,
    code_chunks_summarized,
    job_labels,
)
from prefect_nemo.backends.nemo_run.isolation import nemo_run, root_logger_kept
from prefect_nemo.backends.nemo_run.service import (
    ServiceBackend,
    check_torchrun_gpus,
    kube_failure,
    nodes_and_gpus,
    owner_labels,
)
from prefect_nemo.errors import AuthenticationFailed, BackendUnavailable, InvalidJobSpec
from prefect_nemo.jobs import Failure, JobSpec, JobState, JobStatus, OwnedJob, QueueInfo
from prefect_nemo.kube import FLOW_RUN_LABEL, managed_labels
from prefect_nemo.packaging.transport import ARG_STRLEN_LIMIT

T = TypeVar("T")

#: leptonai's environment variables that pick the workspace.
ENV_KEYS = ("LEPTON_WORKSPACE_ID", "LEPTON_WORKSPACE_TOKEN", "LEPTON_WORKSPACE_URL")
#: The rank variable Lepton sets in every replica (NODE_RANK comes later, from init.sh).
RANK_ENV = "LEPTON_JOB_WORKER_INDEX"
#: A log read returns after this many seconds, or this many without new output.
LOG_READ_S = 5.0
LOG_IDLE_S = 3.0
#: What a dry run shows where the workspace token would be (it sends nothing).
DRY_RUN_TOKEN = "<the workspace token>"

#: Lepton's queue priority classes (``queue_config.priority_class``), lowest first.
PRIORITY_CLASSES = tuple(
    f"{band}-{n}000" for band, ns in (("low", "123"), ("mid", "456"), ("high", "789")) for n in ns
)
#: The short names leptonai's CLI takes for them (``--queue-priority``).
_PRIORITY_SHORT = {
    "low": "low-1000", "l": "low-1000", "mid": "mid-4000", "m": "mid-4000",
    "high": "high-7000", "h": "high-7000",
    **{f"{c.split('-')[0]}-{c.split('-')[1][0]}": c for c in PRIORITY_CLASSES},
    **{c.split("-")[1][0]: c for c in PRIORITY_CLASSES},
}  # fmt: skip

_STATES: dict[str, JobState] = {
    "Starting": JobState.PENDING,
    "Queueing": JobState.QUEUED,
    "Awaiting": JobState.QUEUED,
    "PendingRetry": JobState.PENDING,
    "Restarting": JobState.PENDING,
    "UNK": JobState.PENDING,
    "Running": JobState.RUNNING,
    "Stopping": JobState.RUNNING,
    "Deleting": JobState.RUNNING,
    "Completed": JobState.SUCCEEDED,
    "Archived": JobState.SUCCEEDED,
    "Failed": JobState.FAILED,
    "Stopped": JobState.STOPPED,
    "Deleted": JobState.STOPPED,
}
_env_lock = threading.Lock()


@dataclass(frozen=True)
class LeptonConfig:
    """What the LeptonWorkspace block hands the backend (field names as NeMo-Run's)."""

    workspace_id: str
    token: str = field(repr=False)
    node_group: str
    workspace_url: str | None = None
    resource_shape: str = "gpu.1xh100-80gb"
    cpu_resource_shape: str = "cpu.small"
    container_image: str = "nvcr.io/nvidia/nemo:25.07"
    nemo_run_dir: str = "/nemo-workspace/nemo-run"
    mounts: list[dict[str, Any]] = field(default_factory=list)
    nodes: int = 1
    gpus_per_node: int = 1
    shared_memory_size: int = 65536
    priority_class: str | None = None
    image_pull_secrets: list[str] = field(default_factory=list)
    node_reservation: str = ""
    env_vars: dict[str, str] = field(default_factory=dict)
    secret_vars: dict[str, str] = field(default_factory=dict)
    request_timeout_s: float = 30.0


@contextlib.contextmanager
def workspace_env(config: LeptonConfig) -> Iterator[None]:
    """LEPTON_WORKSPACE_ID/TOKEN/URL set for the block (leptonai's ``APIClient()`` reads
    them), one caller at a time; the previous values come back afterwards."""
    values = {
        "LEPTON_WORKSPACE_ID": config.workspace_id,
        "LEPTON_WORKSPACE_TOKEN": config.token,
        "LEPTON_WORKSPACE_URL": config.workspace_url,
    }
    with _env_lock:
        saved = {k: os.environ.get(k) for k in ENV_KEYS}
        try:
            for key, value in values.items():
                if value:
                    os.environ[key] = value
                else:
                    os.environ.pop(key, None)
            yield
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


class LeptonBackend(ServiceBackend):
    """Jobs as Lepton jobs in one workspace, launched by NeMo-Run's LeptonExecutor."""

    kind = "lepton"
    max_job_id_len = 35  # NeMo-Run cuts longer job names to 34
    transport, noun = "lepton", "Lepton job"
    secret_env_fix = (
        "store them as workspace secrets and map them with "
        "LeptonWorkspace.secret_vars={'NAME': '<secret name>'}"
    )
    config: LeptonConfig
    _client: Any = None  # leptonai's APIClient, made on first use
    _group_names: dict[str, str] | None = None  # node group id -> name, listed once

    # -- identity -------------------------------------------------------------------------------

    @property
    def cluster(self) -> str:
        """The workspace (and its API URL when set)."""
        return f"lepton://{self.config.workspace_id}" + (
            f"@{self.config.workspace_url}" if self.config.workspace_url else ""
        )

    @property
    def secrets(self) -> list[str]:
        """The workspace token."""
        return [self.config.token]

    def links(self, job_id: str) -> dict[str, str]:
        """The job's page in the Lepton dashboard, when the URL is the usual gateway."""
        url = self.config.workspace_url or ""
        if "://gateway" not in url:
            return {}
        base = url.replace("://gateway", "://dashboard", 1).replace("/api/v2", "", 1)
        return {
            "dashboard": f"{base.replace('/workspaces', '/workspace', 1)}/compute/jobs/{job_id}"
        }

    # -- the leptonai client --------------------------------------------------------------------

    @property
    def client(self) -> Any:
        """leptonai's APIClient for this workspace (explicit credentials, no env)."""
        if self._client is None:
            nemo_run()
            from leptonai.api.v2.client import APIClient

            self._client = APIClient(
                workspace_id=self.config.workspace_id,
                auth_token=self.config.token,
                url=self.config.workspace_url,
            )
            # leptonai has no timeout argument: its default per request is 120 s
            self._client._timeout = self.config.request_timeout_s
        return self._client

    def close(self) -> None:
        """Close the workspace client's pooled connections (a later call opens a new client);
        idempotent. Lepton jobs and Ray clusters are left running: they outlive the backend."""
        client, self._client = self._client, None
        if client is not None:
            client._session.close()  # leptonai's APIClient has no close() of its own

    def _call(self, fn: Callable[[], T], what: str) -> T:
        """One leptonai call; auth and transport failures become our errors."""
        from leptonai.api.v1.api_resource import ClientError, ServerError

        try:
            return fn()
        except ClientError as exc:
            status = exc.response.status_code
            if status in (401, 403):
                raise AuthenticationFailed(
                    f"Lepton workspace '{self.config.workspace_id}' rejected the token ({status}) "
                    f"while {what}: set LeptonWorkspace.token to a valid workspace token"
                ) from None
            raise
        except ServerError as exc:
            raise BackendUnavailable(
                f"Lepton answered {exc.response.status_code} while {what}"
            ) from None
        except requests.RequestException as exc:
            raise BackendUnavailable(
                f"Lepton workspace '{self.config.workspace_id}' is unreachable while {what} "
                f"({type(exc).__name__}): check LeptonWorkspace.workspace_url and the network"
            ) from None

    # -- checks ---------------------------------------------------------------------------------

    def check_access(self) -> None:
        """The token works and the node group exists."""
        groups = self._call(self.client.nodegroup.list_all, "listing dedicated node groups")
        names = sorted(g.metadata.name for g in groups)
        if self.config.node_group not in names:
            raise InvalidJobSpec(
                f"LeptonWorkspace.node_group: no dedicated node group '{self.config.node_group}' "
                f"in workspace '{self.config.workspace_id}' (there are: {names})"
            )

    def validate(self, spec: JobSpec) -> None:
        """The priority class is one Lepton knows, then the checks every service makes."""
        priority_class(spec, self.config.priority_class)
        super().validate(spec)

    def env_refusal(self, key: str, value: str) -> str | None:
        """A pod cannot start with one env string (KEY=value) of 128 KiB or more."""
        if len(f"{key}={value}".encode()) >= ARG_STRLEN_LIMIT:
            return "a pod cannot start with an env string over 128 KiB"
        return None

    # -- NeMo-Run executor ----------------------------------------------------------------------

    def make_executor(self, spec: JobSpec, job_id: str) -> Any:
        """A LeptonExecutor for the spec; gpus_per_node=0 runs on the CPU resource shape."""
        run = nemo_run()
        nodes, gpus = nodes_and_gpus(
            spec,
            self.config.nodes,
            self.config.gpus_per_node,
            service="Lepton",
            pick_nodes="pick the nodes with LeptonWorkspace.node_group",
        )
        shape = self.config.resource_shape if gpus > 0 else self.config.cpu_resource_shape
        check_torchrun_gpus(spec, gpus, shape, "LeptonWorkspace.resource_shape")
        return run.LeptonExecutor(
            container_image=self.config.container_image,
            nemo_run_dir=self.config.nemo_run_dir,
            nodes=nodes,
            gpus_per_node=gpus,
            nprocs_per_node=max(gpus, 1),
            shared_memory_size=self.config.shared_memory_size,
            resource_shape=shape,
            node_group=spec.queue or self.config.node_group,
            queue_priority=priority_class(spec, self.config.priority_class),
            node_reservation=self.config.node_reservation,
            secret_vars=dict(self.config.secret_vars),
            mounts=[dict(m) for m in self.config.mounts],
            image_pull_secrets=list(self.config.image_pull_secrets),
            env_vars=dict(self.config.env_vars),
        )

    # -- submit-or-attach -----------------------------------------------------------------------

    def _get(self, job_id: str) -> Any:
        """The Lepton job, or None."""
        from leptonai.api.v1.api_resource import ClientError

        try:
            return self._call(lambda: self.client.job.get(job_id), f"reading job {job_id}")
        except ClientError as exc:
            if exc.response.status_code == 404:
                return None
            raise

    def _app_status(self, entry: dict[str, Any]) -> Any:
        """For the base's claim: does the recorded job still exist?"""
        return self._get(str(entry["app_handle"]).removeprefix("lepton://"))

    def find_app(self, job_id: str) -> str | None:
        """``lepton://<job id>`` when the workspace has a job by that id."""
        return f"lepton://{job_id}" if self._get(job_id) is not None else None

    def launch_app(
        self, spec: JobSpec, job_id: str, metadata: dict[str, str], local_dir: Path | None = None
    ) -> str | None:
        """Launch through the LeptonExecutor, the code unpacked by a pre-launch command on
        rank 0, the job labelled with its owner; None when Lepton answers 409 (another machine
        created the job first)."""
        from leptonai.api.v1.api_resource import ClientError

        if spec.queue:  # NeMo-Run would fail with a KeyError on an unknown node group
            groups = self._node_groups()
            if spec.queue not in groups.values():
                raise InvalidJobSpec(
                    f"JobSpec.queue: no dedicated node group '{spec.queue}' in workspace "
                    f"'{self.config.workspace_id}' (there are: {sorted(groups.values())})"
                )
        executor = self.assigned_executor(spec, job_id, local_dir)
        plan = self.add_code_env(spec, executor)
        if plan is not None:
            dest = f"{executor.lepton_job_dir}/code"  # where NeMo-Run's script cd's
            setup = plan.setup_command(dest, shared=True, rank_env=RANK_ENV)
            executor.pre_launch_commands = [*executor.pre_launch_commands, f"{setup} || exit 1"]
        try:
            with (
                workspace_env(self.config),
                root_logger_kept(),
                job_labels(job_id, owner_labels(metadata), executor.queue_priority),
            ):
                cmd = [self.pod_command(spec, executor)]
                self._call(lambda: executor.launch(name=job_id, cmd=cmd), "launching")
        except ClientError as exc:
            if exc.response.status_code == 409:
                return None
            raise BackendUnavailable(f"Lepton refused job '{job_id}': {exc}") from None
        return f"lepton://{job_id}"

    # -- dry run --------------------------------------------------------------------------------

    def dry_run_client_args(self) -> dict[str, Any]:
        """The workspace as leptonai addresses it, a placeholder for the token."""
        return dry_run_client_args(self.config)

    def dry_run_answer(self) -> Answer:
        """Lepton's answers to NeMo-Run's launch (`lepton_answer`)."""
        return lepton_answer(self.config)

    def sent_documents(
        self, job_id: str, local_dir: Path, sent: list[Sent]
    ) -> list[dict[str, Any]]:
        """The launch script NeMo-Run's data mover copies to the shared mount (its tarball
        shown as the script), then the job NeMo-Run creates (leptonai's LeptonJob, as sent)."""
        (job,) = [s for s in sent if s.path.endswith("/jobs") and _job_id(s.body) == job_id]
        script_path = job.body["spec"]["container"]["command"][-1].split()[-1]
        return [
            {
                "kind": "LeptonLaunchScript",
                "path": script_path,
                "copied_by": "NeMo-Run's data-mover job (busybox), before the job is created",
                "script": (local_dir / job_id / "launch_script.sh").read_text(),
            },
            {
                "kind": "LeptonJob",
                "method": job.method,
                "path": job.path,
                "request": code_chunks_summarized(job.body),
            },
        ]

    # -- status, stop, logs ---------------------------------------------------------------------

    def job_status(self, job_id: str) -> JobStatus | None:
        """One Lepton job's status by GET."""
        job = self._get(job_id)
        if job is None or job.status is None:
            return None
        raw, state = _state(job)
        queue = self._queue_info(job, raw) if state is JobState.QUEUED else None
        failure = self._failure(job_id) if state is JobState.FAILED else None
        return JobStatus(
            job_id=job_id,
            state=state,
            message=f"Lepton state {raw}" + (f": {failure.describe()}" if failure else ""),
            queue=queue,
            start_time=_seconds(job.status.creation_time),
            end_time=_seconds(job.status.completion_time),
            failure=failure,
            metadata=self.job_metadata(job_id),
        )

    def _failure(self, job_id: str) -> Failure | None:
        """Why a Failed job failed, where its events say it in Kubernetes' words
        (`service.KUBE_REASONS`: an evicted or preempted replica, a node not ready, an image
        that cannot be pulled), naming the node an event is about (one GET of
        ``/jobs/{id}/events``, once the job has failed). A job's status says only Failed."""
        from leptonai.api.v1.api_resource import ClientError

        try:
            events = self._call(lambda: self.client.job.get_events(job_id), "reading job events")
        except ClientError:  # no events served: the log tail decides
            return None
        nodes = [
            str(e.regarding.get("name"))
            for e in events
            if e.regarding and e.regarding.get("kind") == "Node" and e.regarding.get("name")
        ]
        return kube_failure([e.reason for e in events], node=nodes[0] if nodes else None)

    def _node_groups(self) -> dict[str, str]:
        """The workspace's dedicated node groups, id -> name (listed once per backend)."""
        if self._group_names is None:
            groups = self._call(self.client.nodegroup.list_all, "listing dedicated node groups")
            self._group_names = {str(g.metadata.id_): str(g.metadata.name) for g in groups}
        return self._group_names

    def _queue_info(self, job: Any, raw: str) -> QueueInfo:
        """Where a Queueing job waits (its node group, from its affinity) and why, as far as
        Lepton says: its state and priority class (its status has no message)."""
        affinity = job.spec.affinity if job.spec else None
        ids = list((affinity.allowed_dedicated_node_groups if affinity else None) or [])
        group = self._node_groups().get(ids[0], ids[0]) if ids else None
        queue_config = job.spec.queue_config if job.spec else None
        priority = (queue_config.priority_class if queue_config else None) or "default"
        return QueueInfo(queue=group, reason=f"Lepton state {raw} (priority class {priority})")

    def owned_jobs(self) -> list[OwnedJob]:
        """The workspace's live jobs with our label, in one listing (leptonai's ``list_all``:
        ``query`` is a label selector; it pages itself), each owner read from its labels."""
        ours = managed_labels()
        selector = ",".join(f"{k}={v}" for k, v in ours.items())
        jobs = self._call(
            lambda: self.client.job.list_all(job_query_mode="alive_only", query=selector),
            "listing jobs",
        )
        found = []
        for job in jobs:
            labels = (job.metadata.labels if job.metadata else None) or {}
            if any(labels.get(k) != v for k, v in ours.items()) or job.status is None:
                continue  # the selector already says so; a job we did not label is never ours
            _, state = _state(job)
            if not state.is_terminal():
                found.append(
                    OwnedJob(
                        job_id=str(job.metadata.id_),
                        state=state,
                        flow_run_id=labels.get(FLOW_RUN_LABEL) or None,
                        submitted_at=_seconds(job.status.creation_time),
                    )
                )
        return found

    def request_stop(self, job_id: str) -> None:
        """``PATCH {"spec": {"stopped": true}}``: the replicas end, the job and logs stay."""
        from leptonai.api.v1.api_resource import ClientError

        with contextlib.suppress(ClientError):  # gone already: nothing to stop
            self._call(
                lambda: self.client.job.update(job_id, spec={"spec": {"stopped": True}}),
                f"stopping job {job_id}",
            )

    def logs(self, job_id: str) -> str:
        """The log so far of the job's first replica (``<job>-0-...``), as NeMo-Run reads it.

        Lepton streams a live job's log until the connection times out, so the read stops
        after `LOG_READ_S` (or `LOG_IDLE_S` without new output) with what has arrived."""
        from leptonai.api.v1.api_resource import ClientError

        try:
            replicas = self._call(
                lambda: self.client.job.get_replicas(job_id), f"listing replicas of {job_id}"
            )
        except ClientError:
            return ""
        first = [r for r in replicas if (r.metadata.id_ or "").startswith(f"{job_id}-0-")]
        if not first:
            return ""
        chunks: list[str] = []
        deadline = time.monotonic() + LOG_READ_S
        stream = self.client.job.get_log(id_or_job=job_id, replica=first[0], timeout=LOG_IDLE_S)
        try:
            with contextlib.suppress(requests.RequestException, RuntimeError):
                for chunk in stream:
                    chunks.append(chunk)
                    if time.monotonic() > deadline:
                        break
        finally:
            stream.close()  # ends the request of a log still being streamed
        return "".join(chunks)


def priority_class(spec: JobSpec, default: str | None) -> str | None:
    """The Lepton priority class of the job (JobSpec.priority, else the block's), in Lepton's
    canonical form ("mid" is "mid-4000", as leptonai's CLI reads it); an unknown name is
    refused before anything is sent."""
    chosen = spec.priority or default
    if chosen is None or chosen in PRIORITY_CLASSES:
        return chosen
    canonical = _PRIORITY_SHORT.get(chosen.strip().lower())
    if canonical is not None:
        return canonical
    field = "JobSpec.priority" if spec.priority else "LeptonWorkspace.priority_class"
    raise InvalidJobSpec(
        f"{field}={chosen!r} is not a Lepton priority class: use one of "
        f"{', '.join(PRIORITY_CLASSES)} (or low, mid, high), the job's "
        "queue_config.priority_class in its node group's queue"
    )


def dry_run_client_args(config: LeptonConfig) -> dict[str, Any]:
    """leptonai APIClient arguments for a dry run: the workspace as the backend's own client
    addresses it (leptonai derives a missing URL without a request), no real token."""
    return {
        "workspace_id": config.workspace_id,
        "auth_token": DRY_RUN_TOKEN,
        "url": config.workspace_url,
    }


def lepton_answer(config: LeptonConfig, node_group_id: str | None = None) -> Answer:
    """How a dry run answers NeMo-Run's Lepton calls: the node group (by `node_group_id`, else
    a placeholder) and its nodes, creations echoed, jobs already Completed (the data mover's
    wait), and a Ray cluster only once it was created."""
    group = config.node_group
    group_id = node_group_id or f"<id of node group {group}>"
    created: dict[str, Any] = {}
    group_json = {
        "metadata": {"id": group_id, "name": group},
        "spec": {"workspaces": [config.workspace_id]},
        "status": {},
    }
    node_json = {
        "metadata": {"id": f"<each node of node group {group}>"},
        "spec": {"dedicated_node_group": group_id, "unschedulable": False},
        "status": {},
    }

    def answer(method: str, path: str, body: Any) -> tuple[int, Any]:
        tail = path.split(f"/workspaces/{config.workspace_id}", 1)[-1]
        if method == "GET" and tail == "/dedicated-node-groups":
            return 200, [group_json]
        if method == "GET" and tail.endswith("/nodes"):
            return 200, [node_json]
        if method == "POST" and tail == "/rayclusters":
            created[_job_id(body)] = {**body, "status": {"state": "Starting"}}
            return 200, {}
        if method == "POST":
            return 200, body
        if method == "GET" and tail.removeprefix("/rayclusters/") in created:
            return 200, created[tail.removeprefix("/rayclusters/")]
        if method == "GET" and tail.startswith("/jobs/"):
            job_id = tail.removeprefix("/jobs/")
            return 200, {"metadata": {"id": job_id}, "status": {"state": "Completed"}}
        if method == "DELETE":
            return 200, {}
        return 404, {"code": "NotFound", "message": f"{tail} does not exist yet (dry run)"}

    return answer


def _state(job: Any) -> tuple[str, JobState]:
    """Lepton's state of a job and ours: Running with replicas still starting is PENDING (as
    NeMo-Run reads it)."""
    raw = job.status.state.value if job.status.state is not None else "UNK"
    state = _STATES.get(raw, JobState.PENDING)
    if raw == "Running" and (job.status.ready or 0) < (job.status.active or 0):
        state = JobState.PENDING
    return raw, state


def _job_id(body: Any) -> str:
    return str(((body or {}).get("metadata") or {}).get("id") or "")


def _seconds(value: int | None) -> datetime | None:
    return datetime.fromtimestamp(value, tz=UTC) if value else None
