"""DGX Cloud (run:ai) jobs through NeMo-Run's DGXCloudExecutor.

Submission is the executor's own ``launch()`` (token, project, ``create_training_job``): one
run:ai training (one node) or distributed workload (several) named by our job id, which run:ai
suffixes (``useGivenNameAsPrefix``), so a job is found again by name from any machine.

Not through torchx's DGX scheduler, on purpose: it writes the executor, client secret
included, to ``NEMORUN_HOME/.dgx_jobs.json`` and renders every env var into a script that
NeMo-Run's data mover must carry in 9,500 characters. Instead the code travels in env-var
chunks of at most 9 KiB (``packaging.plan_for("dgx_cloud")``) and the pod command (set through
``custom_spec``, ``launched_from_cluster`` so no data mover runs) unpacks it on the PVC behind
the NODE_RANK=0 marker gate, then runs the entrypoint with its output tee'd to
``<pvc job dir>/log_<host>.out``.

What NeMo-Run 0.11.1 gets wrong and this module does itself (`RunaiClient`): cancel (it sends
GET ``/workloads/distributed/<id>/suspend``; run:ai documents POST
``/workloads/<trainings|distributed>/<id>/suspend``), token reuse (one token per call there;
here one cached token, refreshed once on a 401), bad credentials (three tries 10 s apart
there; a clear error naming the block field here). Phases map to our states as: Creating,
Initializing, Pending, Resuming, Unknown → PENDING; Running, Updating, Stopping, Deleting,
Terminating → RUNNING (still live); Completed → SUCCEEDED; Failed, Degraded → FAILED;
Stopped → STOPPED.
"""

from __future__ import annotations

import contextlib
import logging
import shlex
import threading
import weakref
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import requests

from prefect_nemo.backends.nemo_run.base import EXPERIMENT_TITLE, experiment_id
from prefect_nemo.backends.nemo_run.dry_run import Answer, Sent, code_chunks_summarized
from prefect_nemo.backends.nemo_run.isolation import nemo_run, root_logger_kept
from prefect_nemo.backends.nemo_run.service import ServiceBackend, nodes_and_gpus
from prefect_nemo.errors import AuthenticationFailed, BackendUnavailable, InvalidJobSpec
from prefect_nemo.jobs import JobSpec, JobState, JobStatus
from prefect_nemo.packaging import TransportPlan
from prefect_nemo.packaging.transport import RUNAI_ENV_VALUE_LIMIT

#: run:ai refuses workload args longer than about this (NeMo-Run's MAX_ARGS_CHARS).
ARGS_LIMIT = 9_500
#: Where the pod unpacks the code: ``<pvc job dir>/code`` (NeMo-Run's layout).
CODE_SUBDIR = "code"
#: What a dry run shows for what only run:ai knows (it sends nothing).
DRY_RUN_TOKEN = "<a run:ai access token>"
DRY_RUN_WORKLOAD = "<the workload id run:ai assigns>"

_PHASES: dict[str, JobState] = {
    "Creating": JobState.PENDING,
    "Initializing": JobState.PENDING,
    "Pending": JobState.PENDING,
    "Resuming": JobState.PENDING,
    "Unknown": JobState.PENDING,
    "Running": JobState.RUNNING,
    "Updating": JobState.RUNNING,
    "Stopping": JobState.RUNNING,
    "Deleting": JobState.RUNNING,
    "Terminating": JobState.RUNNING,
    "Completed": JobState.SUCCEEDED,
    "Failed": JobState.FAILED,
    "Degraded": JobState.FAILED,
    "Stopped": JobState.STOPPED,
}
_KINDS = {"Training": "trainings", "Distributed": "distributed"}
# NeMo-Run logs each workload payload (env values, code chunks) at INFO and run:ai's answer at
# DEBUG: `_DropPayloads` drops that logger's records under WARNING while one of ours submits.
_NOISY = "nemo_run.core.execution.dgxcloud"
_submitting: ContextVar[bool] = ContextVar("prefect_nemo_dgx_submitting", default=False)


@dataclass(frozen=True)
class DGXCloudConfig:
    """What the DGXCloudCluster block hands the backend (field names as NeMo-Run's)."""

    base_url: str
    client_id: str
    client_secret: str = field(repr=False)
    project_name: str
    pvc_nemo_run_dir: str
    pvcs: list[dict[str, Any]]
    kube_apiserver_url: str = ""
    container_image: str = "nvcr.io/nvidia/nemo:25.07"
    nodes: int = 1
    gpus_per_node: int = 1
    nprocs_per_node: int = 1
    distributed_framework: str = "PyTorch"
    custom_spec: dict[str, Any] = field(default_factory=dict)
    env_vars: dict[str, str] = field(default_factory=dict)
    secret_env: dict[str, str] = field(default_factory=dict)
    request_timeout_s: float = 30.0


class RunaiClient:
    """The run:ai calls we make ourselves: token (cached, refreshed once on 401), project,
    workload lookup by id or name, and the documented suspend."""

    def __init__(self, config: DGXCloudConfig) -> None:
        self.config = config
        self._token: str | None = None
        self._lock = threading.Lock()
        self._session = requests.Session()
        # a block builds a backend per task: the pooled connections close when it is dropped
        self._closer = weakref.finalize(self, self._session.close)

    def close(self) -> None:
        """Close the pooled connections now (else when the client is garbage-collected)."""
        self._closer()

    @property
    def token_value(self) -> str | None:
        """The token in use (for redaction), if any."""
        return self._token

    def token(self, *, refresh: bool = False) -> str:
        """A bearer token: the cached one, or a new one from ``POST {base_url}/token``."""
        with self._lock:
            if self._token and not refresh:
                return self._token
            payload = {
                "grantType": "client_credentials",
                "clientId": self.config.client_id,
                "clientSecret": self.config.client_secret,
            }
            response = self._send("POST", "/token", json=payload)
            if response.status_code in (400, 401, 403):
                raise AuthenticationFailed(
                    f"DGX Cloud at {self.config.base_url} refused the credentials of client_id "
                    f"'{self.config.client_id}' ({response.status_code}): check "
                    "DGXCloudCluster.client_id and DGXCloudCluster.client_secret (a run:ai "
                    "application's id and secret)"
                )
            self._raise_for_server(response, "/token")
            token = _json(response).get("accessToken")
            if not token:
                raise BackendUnavailable(
                    f"DGX Cloud at {self.config.base_url} answered /token without an accessToken"
                )
            self._token = str(token)
            return self._token

    def request(self, method: str, path: str, **kwargs: Any) -> requests.Response:
        """One authenticated call; an expired token is refreshed and the call retried once."""
        for attempt in range(2):
            token = self.token(refresh=attempt > 0)
            response = self._send(
                method, path, headers={"Authorization": f"Bearer {token}"}, **kwargs
            )
            if response.status_code != 401:
                self._raise_for_server(response, path)
                return response
        raise AuthenticationFailed(
            f"DGX Cloud at {self.config.base_url} rejected a fresh token for {path}: check that "
            f"the application of DGXCloudCluster.client_id may use project "
            f"'{self.config.project_name}'"
        )

    def _send(self, method: str, path: str, **kwargs: Any) -> requests.Response:
        try:
            return self._session.request(
                method,
                self.config.base_url + path,
                timeout=self.config.request_timeout_s,
                **kwargs,
            )
        except requests.RequestException as exc:
            raise BackendUnavailable(
                f"DGX Cloud at {self.config.base_url} is unreachable ({type(exc).__name__}): "
                "check DGXCloudCluster.base_url and the network"
            ) from None

    def _raise_for_server(self, response: requests.Response, path: str) -> None:
        if response.status_code >= 500:
            raise BackendUnavailable(
                f"DGX Cloud at {self.config.base_url} answered {response.status_code} to {path}"
            )

    def project(self) -> tuple[str, str]:
        """(project id, cluster id) of the configured project, or a clear error."""
        projects = _json(self.request("GET", "/org-unit/projects")).get("projects") or []
        for project in projects:
            if project.get("name") == self.config.project_name:
                return str(project["id"]), str(project["clusterId"])
        names = sorted(str(p.get("name")) for p in projects)
        raise InvalidJobSpec(
            f"DGXCloudCluster.project_name: no project '{self.config.project_name}' is visible "
            f"to this application (visible: {names}): fix the name or the application's access"
        )

    def named(self, job_id: str) -> dict[str, Any] | None:
        """The live (not deleted) training or distributed workload created for job_id."""
        response = self.request(
            "GET", "/workloads", params={"filterBy": f"name=^{job_id}-", "limit": "500"}
        )
        for item in _json(response).get("workloads") or []:
            rest = str(item.get("name", ""))[len(job_id) + 1 :]
            # the suffix run:ai adds has no '-'; '<job_id>-r1-<suffix>' is another attempt
            if rest and "-" not in rest and item.get("type") in _KINDS:
                return item
        return None

    def workload(self, kind: str, workload_id: str) -> dict[str, Any] | None:
        """The workload's data, or None when run:ai has no such workload."""
        response = self.request("GET", f"/workloads/{kind}/{workload_id}")
        if response.status_code == 404:
            return None
        if response.status_code != 200:
            raise BackendUnavailable(
                f"DGX Cloud answered {response.status_code} for workload {workload_id}: "
                f"{response.text[:200]}"
            )
        return _json(response)

    def suspend(self, kind: str, workload_id: str) -> None:
        """``POST /workloads/<kind>/<id>/suspend``: stops the pods, keeps the workload."""
        response = self.request("POST", f"/workloads/{kind}/{workload_id}/suspend")
        if response.status_code not in (200, 202, 404):
            raise BackendUnavailable(
                f"DGX Cloud refused to suspend workload {workload_id}: {response.status_code} "
                f"{response.text[:200]}"
            )


class DGXCloudBackend(ServiceBackend):
    """Jobs as run:ai trainings / distributed workloads, submitted by NeMo-Run's executor."""

    kind = "dgx-cloud"
    max_job_id_len = 34  # NeMo-Run cuts longer workload names to 34
    transport, noun = "dgx_cloud", "run:ai workload"
    secret_env_fix = (
        "keep them in a Kubernetes secret and map them with "
        "DGXCloudCluster.secret_env={'NAME': '<secret name>/<key>'}"
    )
    config: DGXCloudConfig

    def __init__(self, config: DGXCloudConfig) -> None:
        super().__init__(config)
        self.client = RunaiClient(config)

    def close(self) -> None:
        """Close the run:ai client's pooled connections (they also close when the backend is
        dropped); idempotent. Workloads are left running: stopping them is `request_stop`'s."""
        self.client.close()

    # -- identity -------------------------------------------------------------------------------

    @property
    def cluster(self) -> str:
        """The API base and project: one watcher per project."""
        return f"{self.config.base_url}#{self.config.project_name}"

    @property
    def secrets(self) -> list[str]:
        """The client secret and the token in use."""
        return [s for s in (self.config.client_secret, self.client.token_value) if s]

    def links(self, job_id: str) -> dict[str, str]:
        """The run:ai workloads page."""
        ui = self.config.base_url.removesuffix("/api/v1")
        return {"workloads": f"{ui}/workloads"}

    # -- checks ---------------------------------------------------------------------------------

    def check_access(self) -> None:
        """A token and the project: bad credentials or project fail here, clearly."""
        self.client.token(refresh=True)
        self.client.project()

    def env_refusal(self, key: str, value: str) -> str | None:
        """run:ai takes env values up to `RUNAI_ENV_VALUE_LIMIT` characters."""
        if len(value) > RUNAI_ENV_VALUE_LIMIT:
            return f"run:ai takes at most {RUNAI_ENV_VALUE_LIMIT} per value"
        return None

    def check_code(self, spec: JobSpec, plan: TransportPlan | None) -> None:
        """The pod command must fit run:ai's args limit (for the longest job dir)."""
        longest = "x" * self.max_job_id_len
        pvc_job_dir = Path(
            self.config.pvc_nemo_run_dir, "experiments", EXPERIMENT_TITLE, experiment_id(longest)
        )
        args = self._args(spec, plan, str(pvc_job_dir / longest))
        if len(args) > ARGS_LIMIT:
            raise InvalidJobSpec(
                f"JobSpec.entrypoint: the pod command is {len(args)} characters; run:ai takes at "
                f"most {ARGS_LIMIT}: move the long part into a script under working_dir"
            )

    def _args(self, spec: JobSpec, plan: TransportPlan | None, pvc_job_dir: str) -> str:
        """The pod's one-line shell script, quoted as run:ai's ``args`` (as NeMo-Run's data
        mover does): unpack the code (rank 0; the others wait), then run the entrypoint in
        it, everything tee'd to ``<pvc job dir>/log_<host>.out``; a failed unpack fails the pod.
        """
        job_dir = shlex.quote(pvc_job_dir)
        run = spec.entrypoint
        if plan is not None:
            dest = f"{pvc_job_dir}/{CODE_SUBDIR}"
            run = f"{plan.setup_command(dest, shared=True)} && cd {shlex.quote(dest)} && {run}"
        script = (
            # run:ai's PyTorch pods get RANK from the training operator; NODE_RANK wins if set
            'set -o pipefail; export NODE_RANK="${NODE_RANK:-${RANK:-0}}"; '
            f'mkdir -p {job_dir} && {{ {run}\n}} 2>&1 | tee -a {job_dir}/"log_$HOSTNAME.out"'
        )
        return shlex.quote(script)

    # -- NeMo-Run executor ----------------------------------------------------------------------

    def make_executor(self, spec: JobSpec, job_id: str) -> Any:
        """A DGXCloudExecutor for the spec (env and code chunks are added at submit)."""
        run = nemo_run()
        nodes, gpus = nodes_and_gpus(
            spec,
            self.config.nodes,
            self.config.gpus_per_node,
            service="DGX Cloud",
            pick_nodes="pick node pools with DGXCloudCluster.custom_spec={'nodePools': [...]}",
        )
        return run.DGXCloudExecutor(
            base_url=self.config.base_url,
            kube_apiserver_url=self.config.kube_apiserver_url,
            client_id=self.config.client_id,
            client_secret=self.config.client_secret,  # in memory only: nothing is serialized
            project_name=self.config.project_name,
            container_image=self.config.container_image,
            pvc_nemo_run_dir=self.config.pvc_nemo_run_dir,
            pvcs=[dict(p) for p in self.config.pvcs],
            nodes=nodes,
            gpus_per_node=gpus,
            nprocs_per_node=self.config.nprocs_per_node,
            distributed_framework=self.config.distributed_framework,
            custom_spec=dict(self.config.custom_spec),
            env_vars=dict(self.config.env_vars),
            launched_from_cluster=True,  # the code travels in env chunks: no data mover
        )

    # -- submit-or-attach -----------------------------------------------------------------------

    def find_app(self, job_id: str) -> str | None:
        """The handle of the live workload run:ai created for job_id (found by name)."""
        item = self.client.named(job_id)
        return _handle(item["type"], item["id"]) if item is not None else None

    def launch_app(self, spec: JobSpec, job_id: str, local_dir: Path | None = None) -> str | None:
        """Create the workload through the DGXCloudExecutor, with our pod command."""
        executor = self.assigned_executor(spec, job_id, local_dir)
        plan = self.add_code_env(spec, executor)
        custom = {
            **executor.custom_spec,
            "command": "/bin/bash -c",
            "args": self._args(spec, plan, executor.pvc_job_dir),
        }
        if self.config.secret_env:  # references to Kubernetes secrets, never values
            custom["environmentVariables"] = [
                *({"name": k, "value": v} for k, v in executor.env_vars.items()),
                *(
                    {"name": k, "secret": _secret_ref(ref)}
                    for k, ref in self.config.secret_env.items()
                ),
            ]
        executor.custom_spec = custom
        with root_logger_kept(), _quiet():
            try:
                workload_id, _ = executor.launch(name=job_id, cmd=["true"])
            except RuntimeError as exc:
                raise BackendUnavailable(f"DGX Cloud refused the workload: {exc}") from None
        return _handle("distributed" if executor.nodes > 1 else "trainings", workload_id)

    # -- dry run --------------------------------------------------------------------------------

    def dry_run_answer(self) -> Answer:
        """run:ai's answers to NeMo-Run's launch (`runai_answer`)."""
        return runai_answer(self.config)

    def sent_documents(
        self, job_id: str, local_dir: Path, sent: list[Sent]
    ) -> list[dict[str, Any]]:
        """The workloads NeMo-Run creates, as run:ai receives them (path and body)."""
        return [workload_document(s) for s in sent if "/workloads/" in s.path]

    # -- status, stop, logs ---------------------------------------------------------------------

    def _locate(self, job_id: str) -> tuple[str, str] | None:
        """(kind, workload id) of job_id: from this machine's record, else by name."""
        handle = self.app_handle(job_id)
        if not handle:
            handle = self.find_app(job_id)
            if handle is None:
                return None
            self.record(job_id, handle, self.job_metadata(job_id))
        return _parse(handle)

    def job_status(self, job_id: str) -> JobStatus | None:
        """One workload's status by GET (run:ai cannot filter several names in one list call)."""
        where = self._locate(job_id)
        if where is None:
            return None
        data = self.client.workload(*where)
        if data is None:
            return None
        phase = str(data.get("actualPhase") or data.get("phase") or "Unknown")
        return JobStatus(
            job_id=job_id,
            state=_PHASES.get(phase, JobState.PENDING),
            message=f"run:ai phase {phase}",
            start_time=_time(data.get("createdAt")),
            metadata=self.job_metadata(job_id),
        )

    def _app_status(self, entry: dict[str, Any]) -> Any:
        """For the base's claim: is the recorded workload still there? (not the torchx runner:
        our handles are ``dgx_cloud://<kind>/<workload id>``)."""
        return self.client.workload(*_parse(str(entry["app_handle"])))

    def request_stop(self, job_id: str) -> None:
        """Suspend the workload the way run:ai documents it (POST .../<kind>/<id>/suspend)."""
        where = self._locate(job_id)
        if where is not None:
            self.client.suspend(*where)

    def logs(self, job_id: str) -> str:
        """The job's log files on the PVC when this machine mounts it (as in-cluster
        launches do), else empty: run:ai serves logs in its UI only."""
        executor_dir = self.local_experiment_dir(job_id) / job_id
        home = Path(nemo_run().config.get_nemorun_home())
        try:
            sub = executor_dir.relative_to(home)
        except ValueError:
            return ""
        pvc_dir = Path(self.config.pvc_nemo_run_dir) / sub
        files = sorted(pvc_dir.glob("log_*.out")) if pvc_dir.is_dir() else []
        return "".join(f.read_text(errors="replace") for f in files)


def runai_answer(config: DGXCloudConfig) -> Answer:
    """How a dry run answers NeMo-Run's run:ai calls: a placeholder token, the project by
    placeholder ids, creations accepted, a data-mover workspace already Completed."""
    project = config.project_name
    listed = {
        "id": f"<id of project {project}>",
        "name": project,
        "clusterId": f"<cluster id of project {project}>",
    }

    def answer(method: str, path: str, body: Any) -> tuple[int, Any]:
        if path.endswith("/token"):
            return 200, {"accessToken": DRY_RUN_TOKEN}
        if path.endswith("/org-unit/projects"):
            return 200, {"projects": [listed]}
        if method == "POST" and "/workloads/" in path:
            name = (body or {}).get("name")
            return 202, {"workloadId": DRY_RUN_WORKLOAD, "name": name, "actualPhase": "Creating"}
        if method == "GET" and "/workloads/workspaces/" in path:
            return 200, {"actualPhase": "Completed"}
        if method == "DELETE":
            return 202, {}
        return 404, {"code": 404, "message": f"{path} does not exist yet (dry run)"}

    return answer


def workload_document(sent: Sent) -> dict[str, Any]:
    """One workload creation as a dry-run document (code chunks shown by size)."""
    return {
        "kind": "RunaiWorkload",
        "method": sent.method,
        "path": sent.path,
        "request": code_chunks_summarized(sent.body),
    }


def _handle(kind: str, workload_id: str) -> str:
    return f"dgx_cloud://{_KINDS.get(kind, kind)}/{workload_id}"


def _parse(handle: str) -> tuple[str, str]:
    kind, _, workload_id = handle.removeprefix("dgx_cloud://").partition("/")
    return kind, workload_id


def _secret_ref(ref: str) -> dict[str, str]:
    name, _, key = ref.partition("/")
    return {"name": name, "key": key}


def _json(response: requests.Response) -> dict[str, Any]:
    try:
        data = response.json()
    except ValueError:
        raise BackendUnavailable(
            f"DGX Cloud answered {response.status_code} with a non-JSON body"
        ) from None
    return data if isinstance(data, dict) else {}


def _time(text: Any) -> datetime | None:
    try:
        return datetime.fromisoformat(str(text).replace("Z", "+00:00")) if text else None
    except ValueError:
        return None


class _DropPayloads(logging.Filter):
    """Drops NeMo-Run's DGX Cloud records under WARNING in a thread that is submitting for us
    (a context variable, not the logger's level: concurrent submits cannot race on it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or not _submitting.get()


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """NeMo-Run's payload records (env values, code chunks) are dropped during the block."""
    token = _submitting.set(True)
    try:
        yield
    finally:
        _submitting.reset(token)


logging.getLogger(_NOISY).addFilter(_DropPayloads())  # once, when this module is imported
