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

What NeMo-Run 0.11.1 gets wrong and this backend does itself (`runai.RunaiClient`): cancel (it sends
GET ``/workloads/distributed/<id>/suspend``; run:ai documents POST
``/workloads/<trainings|distributed>/<id>/suspend``), token reuse (one token per call there;
here one cached token, refreshed once on a 401), bad credentials (three tries 10 s apart
there; a clear error naming the block field here). Phases map to our states as: Pending
(run:ai: "the Job is waiting to be scheduled", for quota or nodes; again after a preemption)
→ QUEUED, its reason run:ai's ``phaseMessage`` (from ``GET /workloads/{id}``, asked only while
Pending); Creating, Initializing, Resuming, Unknown → PENDING; Running, Updating, Stopping,
Deleting, Terminating → RUNNING (still live); Completed → SUCCEEDED; Failed, Degraded →
FAILED; Stopped → STOPPED. A Failed workload's cause (JobStatus.failure, for its recovery) is
read from Kubernetes' words in its ``phaseMessage`` and conditions (`service.kube_failure`).

Where a job queues: JobSpec.queue is the run:ai project (else DGXCloudCluster.project_name),
JobSpec.priority the workload's ``spec.priorityClass`` (else
DGXCloudCluster.priority_class, else run:ai's default for trainings), one of run:ai's priority
dictionary (`runai.PRIORITY_CLASSES`), checked before anything is sent.

The owner: each workload carries our run:ai labels (``spec.labels``, which run:ai puts on its
pods: managed-by prefect-nemo and the flow run that submitted it, `service.owner_labels`) and
the `OWNER_ENV` variable with the same flow run id. `owned_jobs` reads the variable: run:ai's
one workload listing, ``GET /workloads``, returns each workload's ``environmentVariables``
(API 2.19 and later) but not its labels.

Logs are the pods' ``log_<host>.out`` files on the PVC, read where the PVC is mounted (as
NeMo-Run's ``fetch_logs`` reads them; it says "Logs are available in the Run:AI UI" otherwise):
run:ai's REST API (``{base_url}``, its OpenAPI) has no workload log endpoint, so elsewhere the
log is one line saying so, with the fix (`unreadable_log`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
from collections.abc import Iterator
from contextvars import ContextVar
from datetime import datetime
from pathlib import Path
from typing import Any

from prefect_nemo import names
from prefect_nemo.backends.nemo_run.base import EXPERIMENT_TITLE, OWNER_ENV, experiment_id
from prefect_nemo.backends.nemo_run.dry_run import Answer, Sent
from prefect_nemo.backends.nemo_run.isolation import nemo_run, root_logger_kept
from prefect_nemo.backends.nemo_run.runai import (
    KINDS,
    PRIORITY_CLASSES,
    DGXCloudConfig,
    RunaiClient,
    runai_answer,
    workload_document,
)
from prefect_nemo.backends.nemo_run.service import (
    ServiceBackend,
    kube_failure,
    nodes_and_gpus,
    owner_labels,
)
from prefect_nemo.errors import BackendUnavailable, InvalidJobSpec
from prefect_nemo.jobs import (
    META_FLOW_RUN,
    Failure,
    JobSpec,
    JobState,
    JobStatus,
    OwnedJob,
    QueueInfo,
)
from prefect_nemo.packaging import TransportPlan
from prefect_nemo.packaging.transport import RUNAI_ENV_VALUE_LIMIT

#: run:ai refuses workload args longer than about this (NeMo-Run's MAX_ARGS_CHARS).
ARGS_LIMIT = 9_500
#: Where the pod unpacks the code: ``<pvc job dir>/code`` (NeMo-Run's layout).
CODE_SUBDIR = "code"

_PHASES: dict[str, JobState] = {
    "Creating": JobState.PENDING,
    "Initializing": JobState.PENDING,
    "Pending": JobState.QUEUED,
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
# NeMo-Run logs each workload payload (env values, code chunks) at INFO and run:ai's answer at
# DEBUG: `_DropPayloads` drops that logger's records under WARNING while one of ours submits.
_NOISY = "nemo_run.core.execution.dgxcloud"
_submitting: ContextVar[bool] = ContextVar("prefect_nemo_dgx_submitting", default=False)


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
    def credentials_key(self) -> str:
        """The application's id and secret, hashed (not the token: it changes on refresh)."""
        return names.secret_hash(self.config.client_id, self.config.client_secret)

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

    def validate(self, spec: JobSpec) -> None:
        """The priority class is one run:ai knows, then the checks every service makes."""
        priority_class(spec, self.config.priority_class)
        super().validate(spec)

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
        command = self.pod_command(spec, self.make_executor(spec, "validate"))
        args = self._args(command, plan, str(pvc_job_dir / longest))
        if len(args) > ARGS_LIMIT:
            raise InvalidJobSpec(
                f"JobSpec.entrypoint: the pod command is {len(args)} characters; run:ai takes at "
                f"most {ARGS_LIMIT}: move the long part into a script under working_dir"
            )

    def _args(self, command: str, plan: TransportPlan | None, pvc_job_dir: str) -> str:
        """The pod's one-line shell script, quoted as run:ai's ``args`` (as NeMo-Run's data
        mover does): unpack the code (rank 0; the others wait), then run the command (the
        entrypoint, or `pod_command`'s) in it, everything tee'd to ``<pvc job dir>/log_<host>.out``;
        a failed unpack fails the pod.
        """
        job_dir = shlex.quote(pvc_job_dir)
        run = command
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
        custom = dict(self.config.custom_spec)
        priority = priority_class(spec, self.config.priority_class)
        if priority is not None:
            custom["priorityClass"] = priority
        return run.DGXCloudExecutor(
            base_url=self.config.base_url,
            kube_apiserver_url=self.config.kube_apiserver_url,
            client_id=self.config.client_id,
            client_secret=self.config.client_secret,  # in memory only: nothing is serialized
            project_name=spec.queue or self.config.project_name,
            container_image=self.config.container_image,
            pvc_nemo_run_dir=self.config.pvc_nemo_run_dir,
            pvcs=[dict(p) for p in self.config.pvcs],
            nodes=nodes,
            gpus_per_node=gpus,
            nprocs_per_node=self.config.nprocs_per_node,
            distributed_framework=self.config.distributed_framework,
            custom_spec=custom,
            env_vars=dict(self.config.env_vars),
            launched_from_cluster=True,  # the code travels in env chunks: no data mover
        )

    # -- submit-or-attach -----------------------------------------------------------------------

    def find_app(self, job_id: str) -> str | None:
        """The handle of the live workload run:ai created for job_id (found by name)."""
        item = self.client.named(job_id)
        return _handle(item["type"], item["id"]) if item is not None else None

    def carry_owner(self, executor: Any, metadata: dict[str, str]) -> None:
        """The owner on the workload: our run:ai labels (merged over the block's custom_spec
        labels) and `OWNER_ENV`, which the workload list returns."""
        ours = owner_labels(metadata)
        theirs = [
            label
            for label in executor.custom_spec.get("labels") or []
            if label.get("name") not in ours
        ]
        labels = [*theirs, *({"name": k, "value": v} for k, v in ours.items())]
        executor.custom_spec = {**executor.custom_spec, "labels": labels}
        executor.env_vars = {**executor.env_vars, OWNER_ENV: metadata.get(META_FLOW_RUN, "")}

    def launch_app(
        self, spec: JobSpec, job_id: str, metadata: dict[str, str], local_dir: Path | None = None
    ) -> str | None:
        """Create the workload through the DGXCloudExecutor, with our pod command and owner."""
        if spec.queue:  # NeMo-Run would say only "Unable to determine project/cluster IDs"
            self.client.project(spec.queue, field="JobSpec.queue (the run:ai project)")
        executor = self.assigned_executor(spec, job_id, local_dir)
        plan = self.add_code_env(spec, executor)
        self.carry_owner(executor, metadata)
        custom = {
            **executor.custom_spec,
            "command": "/bin/bash -c",
            "args": self._args(self.pod_command(spec, executor), plan, executor.pvc_job_dir),
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
        state = _PHASES.get(phase, JobState.PENDING)
        queue = self._queue_info(where[1]) if state is JobState.QUEUED else None
        failure = self._failure(where[1]) if state is JobState.FAILED else None
        said = queue.reason if queue else failure.describe() if failure else ""
        return JobStatus(
            job_id=job_id,
            state=state,
            message=f"run:ai phase {phase}" + (f": {said}" if said else ""),
            queue=queue,
            start_time=_time(data.get("createdAt")),
            failure=failure,
            metadata=self.job_metadata(job_id),
        )

    def _failure(self, workload_id: str) -> Failure | None:
        """Why a Failed workload failed, where run:ai says it in Kubernetes' words
        (`service.KUBE_REASONS`: an evicted or preempted pod, a lost node, an image that cannot
        be pulled): its ``phaseMessage`` and its conditions' reasons and messages (one GET, once
        the workload has failed). run:ai's phase alone ("Failed: image retrieval failed or
        containers experienced a crash") does not tell the cluster's fault from the job's."""
        data = self.client.workload_summary(workload_id) or {}
        conditions = [
            f"{c.get('reason') or ''}: {c.get('message') or ''}".strip(": ")
            for c in data.get("conditions") or []
            if isinstance(c, dict)
        ]
        return kube_failure([str(data.get("phaseMessage") or ""), *conditions])

    def _queue_info(self, workload_id: str) -> QueueInfo:
        """Why a Pending workload waits: run:ai's ``phaseMessage`` (else the messages of its
        conditions that do not hold), in its project."""
        data = self.client.workload_summary(workload_id) or {}
        reason = str(data.get("phaseMessage") or "")
        if not reason:
            reason = "; ".join(
                str(c.get("message") or c.get("reason"))
                for c in data.get("conditions") or []
                if c.get("status") != "True" and (c.get("message") or c.get("reason"))
            )
        return QueueInfo(
            queue=str(data.get("projectName") or "") or None,
            reason=reason or "waiting for the run:ai scheduler",
        )

    def owned_jobs(self) -> list[OwnedJob]:
        """The project's live trainings and distributed workloads that carry `OWNER_ENV`, in
        one listing; the job id is the workload's name without the suffix run:ai added."""
        found = []
        for item in self.client.workloads():
            env = item.get("environmentVariables")
            if not isinstance(env, dict) or OWNER_ENV not in env or item.get("type") not in KINDS:
                continue
            state = _PHASES.get(str(item.get("phase") or "Unknown"), JobState.PENDING)
            if not state.is_terminal():
                found.append(
                    OwnedJob(
                        job_id=str(item.get("name", "")).rsplit("-", 1)[0],
                        state=state,
                        flow_run_id=str(env[OWNER_ENV]) or None,
                        submitted_at=_time(item.get("createdAt")),
                    )
                )
        return found

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
        launches do). Without the mount the log cannot be read here (run:ai's REST API serves
        no workload logs): the log is then one line that says so and names the fix, so the
        task shows it once (a followed log sends only what is new) instead of nothing."""
        executor_dir = self.local_experiment_dir(job_id) / job_id
        home = Path(nemo_run().config.get_nemorun_home())
        pvc_dir = Path(self.config.pvc_nemo_run_dir) / executor_dir.relative_to(home)
        if not self._pvc_mounted():
            return unreadable_log(job_id, pvc_dir, self.config.pvc_nemo_run_dir)
        files = sorted(pvc_dir.glob("log_*.out")) if pvc_dir.is_dir() else []
        return "".join(f.read_text(errors="replace") for f in files)

    def _pvc_mounted(self) -> bool:
        """True when the PVC that holds pvc_nemo_run_dir is mounted at its path here."""
        job_root = os.path.abspath(self.config.pvc_nemo_run_dir)
        for pvc in self.config.pvcs:
            mount = os.path.abspath(str(pvc.get("path", "")))
            if os.path.commonpath([mount, job_root]) == mount and os.path.isdir(mount):
                return True
        return False


def unreadable_log(job_id: str, pvc_dir: Path, pvc_nemo_run_dir: str) -> str:
    """The log of a job whose log files this machine cannot read: what to do instead."""
    return (
        f"[prefect-nemo] the log of DGX Cloud job {job_id} cannot be read from this machine: "
        "run:ai's REST API serves no workload logs (they are in the run:ai UI, under "
        f"Workloads), and the job writes them to {pvc_dir}/log_<pod>.out on its PVC, which is "
        "not mounted here. To follow them in Prefect, run the flow where that PVC is mounted "
        f"at {pvc_nemo_run_dir} (DGXCloudCluster.pvc_nemo_run_dir), e.g. in a pod of the "
        "cluster.\n"
    )


def priority_class(spec: JobSpec, default: str | None) -> str | None:
    """The run:ai priority class of the job (JobSpec.priority, else the block's), checked
    against run:ai's dictionary: an unknown name is refused before anything is sent."""
    chosen = spec.priority or default
    if chosen is None or chosen in PRIORITY_CLASSES:
        return chosen
    field = "JobSpec.priority" if spec.priority else "DGXCloudCluster.priority_class"
    raise InvalidJobSpec(
        f"{field}={chosen!r} is not a run:ai priority class: use one of "
        f"{', '.join(PRIORITY_CLASSES)} (run:ai's priority dictionary; the workload's "
        "spec.priorityClass)"
    )


def _handle(kind: str, workload_id: str) -> str:
    return f"dgx_cloud://{KINDS.get(kind, kind)}/{workload_id}"


def _parse(handle: str) -> tuple[str, str]:
    kind, _, workload_id = handle.removeprefix("dgx_cloud://").partition("/")
    return kind, workload_id


def _secret_ref(ref: str) -> dict[str, str]:
    name, _, key = ref.partition("/")
    return {"name": name, "key": key}


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
