"""Kubeflow Trainer TrainJobs: spec checks, the TrainJob manifest, status mapping, and the
backend. No Prefect import here.

What the NeMo-Run KubeflowExecutor does, made crash-safe:

- A ClusterTrainingRuntime (or, with `namespaced_runtime`, a TrainingRuntime in the job's
  namespace, for accounts without cluster-scoped RBAC) built from the block's config (image,
  nodes, GPUs, CPU/memory, PVC mounts, anti-affinity) and named by a hash of that config: equal
  configs share one runtime, a changed config gets a new name; a runtime is never changed in
  place (`apply_or_attach`). Unlike the executor, the runtime does not carry the code: the
  code travels per job, so one runtime serves every job of a config.
- A TrainJob named after the job id, created once: a taken name is `JobAlreadyExists`, so the
  lifecycle attaches to the running job (never delete-and-recreate).
- The local code (``JobSpec.working_dir``) goes through the packaging plan's ConfigMaps, mounted
  into the ``node`` container with a ``runtimePatches`` entry (the v2.3 TrainJob field); the
  trainer command reassembles it, ``cd``s into it and runs the entrypoint under torchrun with the
  rendezvous the Torch plugin hands every node in ``PET_*`` env vars.
- ``JobSpec.placement``: the block stays the one source of the shape (nodes, GPUs, CPUs per
  node: the runtime), so a placement must agree with it (`check_placement`); its node labels
  (and, for several nodes, its one-pod-per-host anti-affinity) reach the node pods through a
  second ``runtimePatches`` entry, per job, without a new runtime.
- Secret env values (SecretStr in JobSpec.env) go into a Secret we own, read through
  ``valueFrom.secretKeyRef``; nothing we write (TrainJob, ConfigMap, log line) holds them.
- Secret and ConfigMaps exist before the TrainJob (its pods need them at start) and are owned
  by it afterwards, so deleting the TrainJob deletes them. PVCs are created if missing and never
  deleted by us.

Status, from one watch-fed cache of TrainJobs and one of their pods per namespace:

===================================  =======================================================
TrainJob / pods                      JobState (message)
===================================  =======================================================
condition Complete=True              SUCCEEDED
condition Failed=True                FAILED ("<reason>: <message> (node <i> exited with code
                                     <c>)"; exit code of the node that failed first)
condition Suspended=True             STOPPED while spec.suspend; QUEUED while Kueue holds it
                                     (a queue-name label or its Workload); PENDING once
                                     unsuspended (Kueue admitted it: Trainer resumes it)
no condition, a pod Running          RUNNING (Trainer has no Running condition)
no condition, pods ended             RUNNING (the JobSet is about to say how it ended)
no condition, no pod read,           RUNNING (the TrainJob alone, as `owned_jobs` reads it:
  jobsStatus counts a ready Job        Trainer copies JobSet's per-Job counts there)
no condition, no pod running yet     PENDING
(TrainJob gone)                      STOPPED if we deleted it and its pods are gone
                                     (RUNNING "stopping" until then), else absent
===================================  =======================================================

`status.trainerStatus` (what the job posted to the Trainer's status server: report.py does, when
the TrainJobStatus feature gives it the server's address) becomes JobStatus.progress.

A FAILED TrainJob says why (JobStatus.failure): its pods (the watched ones, with those the pod
GC deleted on the way, as the informer saw them) and their Nodes (a lost node: infrastructure,
naming it; a bad image: spec; OOMKilled: application), else its Failed reason (a child object
not created: spec; DeadlineExceeded: application), else nothing (the log tail tells).

The job id is at most 50 characters, not 63: JobSet gives every pod the hostname
``<trainjob>-node-0-<index>``, which must be a DNS label (≤ 63) too.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from prefect_nemo.backends._kube_job import KubeJobBackend
from prefect_nemo.backends._kube_objects import (
    check_labels,
    code_configmaps,
    code_plan,
    flow_run_of,
    job_object,
    parse_time,
    reserved_metadata,
    secret_manifest,
    secret_name,
)
from prefect_nemo.backends._kueue import kueue_target, queue_for_kueue
from prefect_nemo.backends.kubeflow.cleanup import IDLE_S, remove_unused_runtimes, touch_runtime
from prefect_nemo.backends.kubeflow.nodes import (
    PET_ENV,
    code_patch,
    placement_patch,
    trainer_command,
    trainer_env,
)
from prefect_nemo.backends.kubeflow.runtimes import (
    GPU_RESOURCE,
    JOBSET_NAME,
    NODE,
    TrainerConfig,
    check_placement,
    node_resources,
    pip_env,
    pvc_manifest,
    runtime_manifest,
    runtime_name,
)
from prefect_nemo.errors import AuthenticationFailed, InvalidJobSpec
from prefect_nemo.jobs import (
    EngineProgress,
    Failure,
    FailureClass,
    JobHandle,
    JobSpec,
    JobState,
    JobStatus,
)
from prefect_nemo.kube import (
    CONFIGMAP,
    POD,
    PVC,
    SECRET,
    TRAIN_JOB,
    Access,
    AlreadyExists,
    Invalid,
    Kind,
    KubeApi,
    KubeError,
    apply_or_attach,
)
from prefect_nemo.names import is_dns1035_label
from prefect_nemo.usage import JobShape

if TYPE_CHECKING:
    from prefect_nemo.packaging import TransportPlan

# JobSet names each pod's hostname <trainjob>-node-0-<index>: keep it a DNS label up to 10^4 nodes
MAX_TRAINJOB_NAME = 50
BLOCK = "KubeflowTrainerCluster"
METADATA_ANNOTATION = "prefect-nemo.io/metadata"
REPLICATED_JOB = "jobset.sigs.k8s.io/replicatedjob-name"
JOB_INDEX = "jobset.sigs.k8s.io/job-index"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
log = logging.getLogger("prefect_nemo.kubeflow")


# -------------------------------------------------------------------------------------------
# Checks (pure: no API calls)


def check_job_id(job_id: str) -> None:
    """TrainJob names are DNS-1035 labels; ours stay short enough for JobSet's pod hostnames."""
    if not is_dns1035_label(job_id, MAX_TRAINJOB_NAME):
        raise InvalidJobSpec(
            f"job id '{job_id}' cannot name a TrainJob: use a DNS-1035 label of at most "
            f"{MAX_TRAINJOB_NAME} characters (JobSet's pod hostnames add '-node-0-<index>'): "
            "use a shorter JobSpec.name or experiment name"
        )


def check_spec(spec: JobSpec, config: TrainerConfig) -> None:
    """Raise InvalidJobSpec for what a TrainJob cannot carry; sends nothing."""
    res = spec.resources
    if res.cpus is not None or res.gpus is not None or res.memory_bytes is not None or res.custom:
        raise InvalidJobSpec(
            "JobSpec.resources: a TrainJob's resources are per node: set gpus_per_node, "
            "cpus_per_node and memory_per_node on the KubeflowTrainerCluster block instead"
        )
    if spec.label_selector:
        raise InvalidJobSpec(
            "JobSpec.label_selector: Ray label selectors do not apply to TrainJobs: drop it"
        )
    if spec.placement is not None:
        check_placement(spec.placement, config)
    if spec.launcher == "torchrun" and not config.torchrun:
        raise InvalidJobSpec(
            "JobSpec.launcher='torchrun', but KubeflowTrainerCluster.torchrun is off: turn it on "
            "(each node then runs num_nodes x gpus_per_node processes under torchrun) or drop "
            "the launcher"
        )
    if spec.runtime_env:
        raise InvalidJobSpec(
            "JobSpec.runtime_env: a Ray runtime_env does not apply to TrainJobs: ship code with "
            "working_dir and packages with KubeflowTrainerCluster.extra_packages"
        )
    reserved = sorted(set(spec.env) & set(PET_ENV))
    if reserved:
        raise InvalidJobSpec(
            f"JobSpec.env: {', '.join(reserved)} are set by Kubeflow Trainer's torch plugin "
            "(its webhook rejects them): drop them"
        )
    check_labels(spec.labels)
    kueue_target(spec, config.queue_name, config.priority_class, BLOCK)
    if spec.working_dir is not None and not Path(spec.working_dir).is_dir():
        raise InvalidJobSpec(
            f"JobSpec.working_dir: {spec.working_dir} is not a directory on this machine"
        )


# -------------------------------------------------------------------------------------------
# The TrainJob (pure)


def trainjob_manifest(
    spec: JobSpec,
    job_id: str,
    metadata: dict[str, str],
    config: TrainerConfig,
    *,
    namespace: str,
    plan: TransportPlan | None = None,
) -> dict[str, Any]:
    """The TrainJob for a job: everything but secret env values, which go to `secret_manifest`."""
    annotations: dict[str, str] = {}
    if spec.metadata:
        annotations[METADATA_ANNOTATION] = json.dumps(spec.metadata, sort_keys=True)
    setup = None
    if plan is not None:
        setup = plan.setup_command(config.code_dir, shared=config.code_on_shared_volume)
    trainer: dict[str, Any] = {
        "image": config.image,
        "command": trainer_command(spec, config, setup),
        "numNodes": config.num_nodes,
        "numProcPerNode": config.nproc_per_node,
    }
    env = trainer_env(spec, job_id)
    if env:
        trainer["env"] = env
    resources = node_resources(config)
    if resources:
        trainer["resourcesPerNode"] = resources
    body: dict[str, Any] = {
        "runtimeRef": {
            "apiGroup": TRAIN_JOB.group,
            "kind": config.runtime_kind.kind,
            "name": runtime_name(config),
        },
        "trainer": trainer,
    }
    patches = [code_patch(plan)] if plan is not None else []
    placed = placement_patch(spec.placement, job_id) if spec.placement is not None else None
    if placed is not None:
        patches.append(placed)
    if patches:
        body["runtimePatches"] = patches
    manifest = job_object(
        TRAIN_JOB, job_id, spec, metadata, body, namespace=namespace, annotations=annotations,
        owned=owned_objects(spec, job_id, plan), shrink="JobSpec.entrypoint/env/metadata",
    )  # fmt: skip
    return queue_for_kueue(
        manifest, kueue_target(spec, config.queue_name, config.priority_class, BLOCK)
    )


def owned_objects(spec: JobSpec, job_id: str, plan: TransportPlan | None) -> dict[str, list[str]]:
    """Names of the Secret and ConfigMaps a TrainJob owns (kept on it, to adopt after a crash)."""
    out: dict[str, list[str]] = {}
    if spec.secret_values():
        out["secrets"] = [secret_name(job_id)]
    if plan is not None:
        out["configmaps"] = [cm["metadata"]["name"] for cm in plan.configmaps]
    return out


# -------------------------------------------------------------------------------------------
# Status mapping (pure)


def _condition(obj: dict[str, Any], type_: str) -> dict[str, Any] | None:
    conditions: list[dict[str, Any]] = (obj.get("status") or {}).get("conditions") or []
    for cond in conditions:
        if cond.get("type") == type_ and cond.get("status") == "True":
            return cond
    return None


# The Failed condition's reasons that alone say the class: JobSet v0.12.0's (constants.go:
# creating a child object failed) and Trainer v2.3.0's (trainjob_types.go); FailedJobs,
# ReachedMaxRestarts and the failure policy's actions do not: the pods, then the log, tell
_REASON_CLASS = {
    "JobCreationFailed": FailureClass.SPEC,
    "HeadlessServiceCreationFailed": FailureClass.SPEC,
    "PVCCreationFailed": FailureClass.SPEC,
    "TrainingRuntimeNotSupported": FailureClass.SPEC,
    "DeadlineExceeded": FailureClass.APPLICATION,  # ran past activeDeadlineSeconds
}


def trainjob_failure(obj: dict[str, Any]) -> Failure | None:
    """The class a FAILED TrainJob's Failed condition reason alone says, else None."""
    reason = (_condition(obj, "Failed") or {}).get("reason") or ""
    kind = _REASON_CLASS.get(reason)
    return None if kind is None else Failure(kind=kind, reason=reason)


def _failed_node(pods: list[dict[str, Any]]) -> tuple[int, int] | None:
    """(node index, exit code) of the node that failed first: a code other than 137/143 (the
    SIGKILL/SIGTERM a node gets when a sibling fails) wins, then the earliest, then node-0."""
    failed = []
    for pod in pods:
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            term = (cs.get("state") or {}).get("terminated") or {}
            if cs.get("name") == NODE and term.get("exitCode"):
                code = int(term["exitCode"])
                when = str(term.get("finishedAt") or "")
                failed.append((code in (137, 143), when, _pod_index(pod), code))
    if not failed:
        return None
    _, _, index, code = min(failed)
    return index, code


def _pod_index(pod: dict[str, Any]) -> int:
    try:
        return int((pod["metadata"].get("labels") or {}).get(COMPLETION_INDEX, 0))
    except ValueError:
        return 0


def _shape(obj: dict[str, Any]) -> JobShape | None:
    """Nodes x GPUs the TrainJob asks for (its numNodes and nvidia.com/gpu per node: the
    runtime's resources, which check_placement made agree with the spec's placement)."""
    trainer = (obj.get("spec") or {}).get("trainer") or {}
    if "numNodes" not in trainer:
        return None
    limits = (trainer.get("resourcesPerNode") or {}).get("limits") or {}
    try:
        gpus = float(limits.get(GPU_RESOURCE, 0))
        return JobShape(nodes=int(trainer["numNodes"]), gpus_per_node=gpus)
    except (TypeError, ValueError):  # not numbers: the spec's count stands in
        return None


def status_from_trainjob(obj: dict[str, Any], pods: list[dict[str, Any]]) -> JobStatus:
    """Our JobStatus from a TrainJob and its pods (the table in the module docstring)."""
    meta = obj.get("metadata") or {}
    name = meta.get("name", "")
    phases = [(p.get("status") or {}).get("phase") for p in pods]
    child_jobs = (obj.get("status") or {}).get("jobsStatus") or []
    exit_code: int | None = None
    end: datetime | None = None
    if cond := _condition(obj, "Complete"):
        state, message = JobState.SUCCEEDED, cond.get("message") or ""
        end = parse_time(cond.get("lastTransitionTime"))
    elif cond := _condition(obj, "Failed"):
        state = JobState.FAILED
        reason, text = cond.get("reason") or "", cond.get("message") or ""
        message = ": ".join(p for p in (reason, text) if p) or f"TrainJob {name} failed"
        if (failed := _failed_node(pods)) is not None:
            exit_code = failed[1]
            message += f" (node {failed[0]} exited with code {failed[1]})"
        end = parse_time(cond.get("lastTransitionTime"))
    elif (cond := _condition(obj, "Suspended")) and (obj.get("spec") or {}).get("suspend"):
        state = JobState.STOPPED
        message = cond.get("message") or f"TrainJob {name} is suspended"
        end = parse_time(cond.get("lastTransitionTime"))
    elif cond:  # unsuspended (Kueue admitted it) and the Trainer has not caught up: starting
        state, message = JobState.PENDING, ""
    elif "Running" in phases or any(ph in ("Succeeded", "Failed") for ph in phases):
        state, message = JobState.RUNNING, ""
    elif not pods and any(j.get("ready") for j in child_jobs):
        state, message = JobState.RUNNING, ""
    else:
        state, message = JobState.PENDING, ""
    if meta.get("deletionTimestamp") and not state.is_terminal():
        message = f"TrainJob {name} is being deleted"
    starts = [t for p in pods if (t := parse_time((p.get("status") or {}).get("startTime")))]
    metadata: dict[str, str] = {}
    annotations = meta.get("annotations") or {}
    try:
        metadata.update(json.loads(annotations.get(METADATA_ANNOTATION) or "{}"))
    except ValueError:
        pass
    metadata.update(reserved_metadata(annotations, skip=(METADATA_ANNOTATION,)))
    return JobStatus(
        job_id=name,
        state=state,
        message=message,
        start_time=min(starts) if starts else None,
        end_time=end,
        exit_code=exit_code,
        metadata=metadata,
        shape=_shape(obj),
        progress=trainer_progress(obj),
    )


def trainer_progress(obj: dict[str, Any]) -> EngineProgress | None:
    """The TrainJob's `status.trainerStatus` (the Trainer's TrainJobStatus feature: the job posts
    it to the Trainer's status server), or None where it has none or it is malformed."""
    raw = (obj.get("status") or {}).get("trainerStatus")
    if not isinstance(raw, dict):
        return None
    metrics = {
        str(m["name"]): str(m["value"])
        for m in raw.get("metrics") or [] if isinstance(m, dict) and "name" in m and "value" in m
    }  # fmt: skip
    percent, eta = raw.get("progressPercentage"), raw.get("estimatedRemainingSeconds")
    return EngineProgress(
        percent=percent if isinstance(percent, int) else None,
        eta_s=eta if isinstance(eta, int) else None,
        metrics=metrics,
        updated=parse_time(raw.get("lastUpdatedTime")),
    )


# -------------------------------------------------------------------------------------------
# The backend


class KubeflowTrainerBackend(KubeJobBackend[TrainerConfig]):
    """Run jobs as Kubeflow Trainer TrainJobs: submit, watch (informers), stop, logs."""

    kind: ClassVar[str] = "kubeflow-trainer"
    max_job_id_len: ClassVar[int] = MAX_TRAINJOB_NAME
    job_kind = TRAIN_JOB
    crd_fix = "install Kubeflow Trainer (v2.3+) in the cluster"
    deleted_message = "stopped: the TrainJob and its pods were deleted"
    block = BLOCK
    pod_job_label = JOBSET_NAME
    # Background, not Foreground: Trainer v2.3.0's Reconcile does not look at a TrainJob's
    # deletionTimestamp and re-applies the JobSet of an unfinished TrainJob, so a TrainJob held
    # in foreground deletion got its JobSet (and pods) back and stayed for minutes on the real
    # controller. Gone at once, it is re-applied by nobody; the stop is confirmed by its pods.
    stop_propagation = "Background"

    def __init__(
        self,
        api: KubeApi,
        config: TrainerConfig,
        *,
        namespace: str | None = None,
        chunk_bytes: int | None = None,
        max_code_bytes: int | None = None,
        runtime_idle_s: float = IDLE_S,
    ) -> None:
        super().__init__(api, config, namespace=namespace)
        self.chunk_bytes = chunk_bytes
        self.max_code_bytes = max_code_bytes
        self.runtime_idle_s = runtime_idle_s  # how long a runtime taken for a job is kept

    @property
    def secrets(self) -> list[str]:
        """The API credentials and pip's index URLs, for redaction."""
        urls = [self.config.pip_index_url, *self.config.pip_extra_index_urls]
        return [*self.api.secrets, *(u for u in urls if u)]

    def access(self) -> tuple[Access, ...]:
        """In the jobs' namespace: the TrainJobs, the runtime (created, stamped, removed when
        unused), the Secret and code ConfigMaps each job owns, the PVCs of the mounts, the
        pods and their logs. Removing an unused ClusterTrainingRuntime reads the TrainJobs of
        every namespace (a submit goes on without it; `cleanup` needs it)."""
        runtime = self.config.runtime_kind
        needs = [
            Access(TRAIN_JOB, ("get", "list", "watch", "create", "delete")),
            Access(runtime, ("get", "list", "create", "patch", "delete")),
            Access(SECRET, ("get", "create", "delete", "patch")),
            Access(CONFIGMAP, ("get", "create", "delete", "patch")),
            Access(POD, ("get", "list", "watch")),
            Access(POD, ("get",), subresource="log"),
        ]
        if self.config.pvc_mounts:
            needs.append(Access(PVC, ("get", "create")))
        if not runtime.namespaced:
            needs.append(Access(
                TRAIN_JOB, ("list",), all_namespaces=True,
                optional="removing ClusterTrainingRuntimes no TrainJob uses (cleanup)",
            ))  # fmt: skip
        return (*needs, *self.kueue_access())

    def job_status(self, obj: dict[str, Any], pods: list[dict[str, Any]]) -> JobStatus:
        """The TrainJob's status from it and its pods (the table in the module docstring)."""
        return status_from_trainjob(obj, pods)

    def object_failure(self, obj: dict[str, Any]) -> Failure | None:
        """The class its Failed condition's reason says (a child object not created, the
        runtime refused, the deadline), else None."""
        return trainjob_failure(obj)

    # -- Backend protocol -----------------------------------------------------------------------

    def validate(self, spec: JobSpec) -> None:
        """Everything we can check without the API server: names, sizes, env, the code's size."""
        check_spec(spec, self.config)
        plan = self._plan(spec, "j" * MAX_TRAINJOB_NAME) if spec.working_dir else None
        trainjob_manifest(
            spec, "j" * MAX_TRAINJOB_NAME, {}, self.config, namespace=self.namespace, plan=plan
        )

    def submit(self, spec: JobSpec, job_id: str, metadata: dict[str, str]) -> JobHandle:
        """Create PVCs, runtime, Secret, ConfigMaps, then the TrainJob (which then owns the
        Secret and ConfigMaps); JobAlreadyExists if a TrainJob has the name."""
        check_job_id(job_id)
        check_spec(spec, self.config)
        manifest, owned = self._documents(spec, job_id, metadata)
        if self.kueue_target(spec) is not None:
            self.use_kueue()
        fix = "Check the KubeflowTrainerCluster fields and the JobSpec fields it names"
        self.create_job(manifest, owned, fix=fix, prepare=self._prepare)
        return self.handle(job_id)

    def render(self, spec: JobSpec, job_id: str, metadata: dict[str, str]) -> list[dict[str, Any]]:
        """What `submit` sends, in its order, without a request: the PVCs (created only where
        missing), the runtime, the Secret, the code ConfigMaps, then the TrainJob."""
        check_job_id(job_id)
        check_spec(spec, self.config)
        manifest, owned = self._documents(spec, job_id, metadata)
        return [*self._shared_objects(), *(obj for _, obj in owned), manifest]

    def request_stop(self, job_id: str) -> None:
        """Delete the TrainJob (its JobSet, pods, Secret and ConfigMaps then go by ownership);
        lifecycle.stop_and_confirm waits until it and its pods are gone."""
        self.delete_to_stop(job_id)

    def _deleted_status(self, job_id: str) -> JobStatus | None:
        """A TrainJob we deleted reads STOPPED once no pod of it is left (the garbage collector
        takes them after the TrainJob); until then RUNNING, 'stopping'."""
        status = super()._deleted_status(job_id)
        if status is None:
            return None
        pods, _ = self.api.list(POD, self.namespace, label_selector=f"{JOBSET_NAME}={job_id}")
        if pods:
            message = f"stopping: {len(pods)} pod(s) of the deleted TrainJob are still there"
            return JobStatus(job_id=job_id, state=JobState.RUNNING, message=message)
        return status

    def read_log(self, job_id: str) -> str | None:
        """The node-0 pod's whole log; None while there is no such pod."""
        pod = self._node0(job_id)
        if pod is None:
            return None
        return self.api.pod_log(pod["metadata"]["name"], self.namespace, container=NODE)

    async def tail_logs(self, job_id: str) -> AsyncGenerator[str, None]:
        """Poll node-0's log with a growing offset; ends when the job ends."""
        sent = 0
        while True:
            status = await asyncio.to_thread(self.current_status, job_id)
            done = status is None or status.state.is_terminal()
            try:
                text = await asyncio.to_thread(self.logs, job_id)
            except self.log_errors:
                text = ""
            if len(text) > sent:
                yield text[sent:]
                sent = len(text)
            if done:
                return
            await asyncio.sleep(0.5)

    # -- helpers ----------------------------------------------------------------------------------

    def _plan(self, spec: JobSpec, job_id: str) -> TransportPlan:
        """The ConfigMap transport of working_dir, within this block's sizes."""
        return code_plan(spec, job_id, chunk_bytes=self.chunk_bytes, max_bytes=self.max_code_bytes)

    def _documents(
        self, spec: JobSpec, job_id: str, metadata: dict[str, str]
    ) -> tuple[dict[str, Any], list[tuple[Kind, dict[str, Any]]]]:
        """The TrainJob and what it owns (Secret, code ConfigMaps), created before it; built
        once for `submit` and `render` alike."""
        flow_run_id = flow_run_of(metadata)
        plan = self._plan(spec, job_id) if spec.working_dir is not None else None
        if extra := pip_env(self.config):  # pip's options reach the pods as env (URLs: Secret)
            spec = spec.model_copy(update={"env": {**extra, **spec.env}})
        manifest = trainjob_manifest(
            spec, job_id, metadata, self.config, namespace=self.namespace, plan=plan
        )
        secret = secret_manifest(spec, job_id, namespace=self.namespace, flow_run_id=flow_run_id)
        owned: list[tuple[Kind, dict[str, Any]]] = []
        if secret is not None:
            owned.append((SECRET, secret))
        if plan is not None:
            cms = code_configmaps(plan, namespace=self.namespace, flow_run_id=flow_run_id)
            owned += [(CONFIGMAP, cm) for cm in cms]
        return manifest, owned

    def _shared_objects(self) -> list[dict[str, Any]]:
        """What outlives each job: the PVCs of the mounts, then the config's runtime."""
        pvcs = [pvc_manifest(mount, self.namespace) for mount in self.config.pvc_mounts]
        return [*pvcs, runtime_manifest(self.config, self.namespace)]

    def _prepare(self) -> None:
        """The PVCs (created if missing, never deleted) and the config's runtime (created, or
        the one of its name reused: never changed in place)."""
        *pvcs, runtime = self._shared_objects()
        for pvc in pvcs:
            name = pvc["metadata"]["name"]
            if self.api.get(PVC, name, self.namespace) is not None:
                continue
            try:
                self.api.create(PVC, pvc, self.namespace)
            except AlreadyExists:
                pass  # created meanwhile: fine, we only need it to exist
        name = runtime_name(self.config)
        try:
            applied = apply_or_attach(self.api, runtime, namespace=self.namespace)
        except Invalid as exc:
            raise InvalidJobSpec(
                f"the API server rejected {runtime['kind']} {name}: {exc}. Check the "
                "KubeflowTrainerCluster fields it names"
            ) from None
        if not applied.created:
            touch_runtime(self.api, self.config, self.namespace, name)
        try:  # housekeeping: a submit never fails for it (cleanup() reports its errors)
            remove_unused_runtimes(
                self.api, self.config, self.namespace, keep=name, idle_s=self.runtime_idle_s
            )
        except (KubeError, AuthenticationFailed) as exc:
            log.info("left unused runtimes alone: %s", exc)

    def cleanup(self, *, idle_s: float | None = None) -> list[str]:
        """Remove the runtimes of this config's prefix that no TrainJob uses and no submit took
        in the last `idle_s` (default: runtime_idle_s); returns them as 'Kind/name'."""
        idle = self.runtime_idle_s if idle_s is None else idle_s
        return remove_unused_runtimes(self.api, self.config, self.namespace, idle_s=idle)

    def _node0(self, job_id: str) -> dict[str, Any] | None:
        """The pod of replicatedJob `node`, job index 0, completion index 0 (torchrun rank 0)."""
        selector = ",".join(
            [f"{JOBSET_NAME}={job_id}", f"{REPLICATED_JOB}={NODE}", f"{JOB_INDEX}=0",
             f"{COMPLETION_INDEX}=0"]
        )  # fmt: skip
        pods, _ = self.api.list(POD, self.namespace, label_selector=selector)
        live = [p for p in pods if not p["metadata"].get("deletionTimestamp")] or pods
        if not live:
            return None
        return max(live, key=lambda p: p["metadata"].get("creationTimestamp") or "")
