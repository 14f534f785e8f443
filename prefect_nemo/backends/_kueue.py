"""Kueue for the Kubernetes job kinds (RayJob, TrainJob): where a job queues, and how a job Kueue
holds reads. Pure apart from `Positions`, which asks the API server. No Prefect import.

Kueue docs, "Run A RayJob" / "Run A TrainJob": the LocalQueue is the job's
``kueue.x-k8s.io/queue-name`` label, its WorkloadPriorityClass the ``kueue.x-k8s.io/priority-class``
label; Kueue "controls the spec.suspend field": the job is created suspended and Kueue unsuspends
it once its Workload is admitted, and suspends it again when it evicts (preempts) it. So a
suspended job that Kueue holds is QUEUED, never STOPPED; the reason comes from its Workload's
conditions (QuotaReserved, Admitted, Evicted), the position from Kueue's visibility API
(``visibility.kueue.x-k8s.io`` pendingworkloads of the LocalQueue) where it is served, else the
LocalQueue's ``pendingWorkloads`` count goes into the reason.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass
from typing import Any

from prefect_nemo.errors import BackendUnavailable, InvalidJobSpec
from prefect_nemo.jobs import JobSpec, JobState, JobStatus, QueueInfo
from prefect_nemo.kube import Kind, KubeApi, KubeError

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"  # on each Workload: the uid of the job it stands for
GROUP, VERSION = "kueue.x-k8s.io", "v1beta2"
WORKLOAD = Kind(GROUP, VERSION, "Workload", "workloads")
LOCAL_QUEUE = Kind(GROUP, VERSION, "LocalQueue", "localqueues")
VISIBILITY = Kind(f"visibility.{GROUP}", VERSION, "LocalQueue", "localqueues",
                  status_subresource=False, aggregated=True)  # fmt: skip
KUEUE_FIX = "install Kueue (its CRDs and controller manager) in the cluster"
POSITIONS_TTL_S = 2.0  # a LocalQueue's positions are asked at most this often
# a label value: at most 63 characters of [A-Za-z0-9._-], alphanumeric at both ends
_LABEL_VALUE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?")


@dataclass(frozen=True)
class KueueTarget:
    """The LocalQueue (and WorkloadPriorityClass) a job goes to."""

    queue: str
    priority: str | None = None

    def labels(self) -> dict[str, str]:
        labels = {QUEUE_LABEL: self.queue}
        if self.priority:
            labels[PRIORITY_LABEL] = self.priority
        return labels


def _check_label_value(field: str, value: str, what: str) -> None:
    if not _LABEL_VALUE.fullmatch(value):
        raise InvalidJobSpec(
            f"{field}: '{value}' cannot be a Kubernetes label value (it becomes the "
            f"{what} label): use at most 63 letters, digits, '.', '_' or '-', starting and ending "
            "with a letter or digit"
        )


def kueue_target(
    spec: JobSpec, queue_name: str | None, priority_class: str | None, block: str
) -> KueueTarget | None:
    """Where the job queues: JobSpec.queue / JobSpec.priority over the block's `queue_name` /
    `priority_class`; None without a queue. InvalidJobSpec for a value no label can carry, or a
    priority without a queue (Kueue reads the priority only of a job it manages)."""
    queue = spec.queue or queue_name
    priority = spec.priority or priority_class
    queue_field = "JobSpec.queue" if spec.queue else f"{block}.queue_name"
    priority_field = "JobSpec.priority" if spec.priority else f"{block}.priority_class"
    if queue is not None:
        _check_label_value(queue_field, queue, f"Kueue LocalQueue ({QUEUE_LABEL})")
    if priority is not None:
        _check_label_value(priority_field, priority, f"WorkloadPriorityClass ({PRIORITY_LABEL})")
        if queue is None:
            raise InvalidJobSpec(
                f"{priority_field}: '{priority}' is a Kueue WorkloadPriorityClass, which Kueue "
                f"reads only on a job it queues: set {block}.queue_name or JobSpec.queue too"
            )
    return KueueTarget(queue, priority) if queue is not None else None


def check_block_labels(queue_name: str | None, priority_class: str | None, block: str) -> None:
    """The block's own fields, checked when it is built."""
    kueue_target(JobSpec(entrypoint="true"), queue_name, priority_class, block)


def queue_for_kueue(manifest: dict[str, Any], target: KueueTarget | None) -> dict[str, Any]:
    """The job's object with Kueue's labels and created suspended (Kueue docs: Kueue unsuspends
    it once admitted); unchanged without a target."""
    if target is not None:
        manifest["metadata"]["labels"].update(target.labels())
        manifest["spec"]["suspend"] = True
    return manifest


def kueue_holds(obj: dict[str, Any], workload: dict[str, Any] | None) -> bool:
    """The job is suspended by (or for) Kueue: suspended, not being deleted, and queued (its
    queue label, or a Workload of it exists: a cluster with manageJobsWithoutQueueName)."""
    meta = obj.get("metadata") or {}
    if meta.get("deletionTimestamp") or (obj.get("spec") or {}).get("suspend") is not True:
        return False
    return QUEUE_LABEL in (meta.get("labels") or {}) or workload is not None


def _condition(obj: dict[str, Any] | None, type_: str) -> dict[str, Any] | None:
    conditions: list[dict[str, Any]] = ((obj or {}).get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c.get("type") == type_), None)


def _is_true(obj: dict[str, Any] | None, type_: str) -> bool:
    return (_condition(obj, type_) or {}).get("status") == "True"


def _said(cond: dict[str, Any]) -> str:
    return ": ".join(str(p) for p in (cond.get("reason"), cond.get("message")) if p)


def queue_reason(workload: dict[str, Any] | None) -> tuple[str, bool]:
    """(Kueue's reason the job waits, whether it was preempted) from its Workload's conditions."""
    if workload is None:
        return "waiting for Kueue to create its Workload", False
    evicted = _condition(workload, "Evicted")
    preempted = _is_true(workload, "Preempted") or bool(
        evicted and evicted.get("status") == "True" and evicted.get("reason") == "Preempted"
    )
    reserved, admitted = _condition(workload, "QuotaReserved"), _condition(workload, "Admitted")
    if evicted and evicted.get("status") == "True":
        reason = f"Evicted: {_said(evicted)}"
    elif reserved and reserved.get("status") == "False":
        reason = _said(reserved)
    elif admitted and admitted.get("status") == "False":
        reason = _said(admitted)
    elif _is_true(workload, "Admitted"):
        reason = "admitted, starting"
    else:
        reason = "waiting for Kueue to reserve quota"
    return reason or "waiting for quota", preempted


def preemptions(workload: dict[str, Any] | None) -> int | None:
    """Times Kueue preempted the Workload, as it counts them: `status.schedulingStats.evictions`
    keeps a count per eviction reason, `Preempted` being a preemption's (Kueue v0.17's
    WorkloadEvictedByPreemption); None where the Workload or its count is not there (an older
    Kueue, or never evicted)."""
    stats = ((workload or {}).get("status") or {}).get("schedulingStats")
    if not stats:
        return None
    evictions = stats.get("evictions") or []
    return sum(int(e.get("count") or 0) for e in evictions if e.get("reason") == "Preempted")


def queued_status(
    status: JobStatus,
    obj: dict[str, Any],
    workload: dict[str, Any] | None,
    position: int | None,
    pending: int | None,
) -> JobStatus:
    """`status` as QUEUED (QueueInfo from the Workload and its place in the LocalQueue) when
    Kueue holds the job and it has not ended on its own (SUCCEEDED, FAILED)."""
    if status.state in (JobState.SUCCEEDED, JobState.FAILED) or not kueue_holds(obj, workload):
        return status
    labels = (obj.get("metadata") or {}).get("labels") or {}
    queue = labels.get(QUEUE_LABEL) or ((workload or {}).get("spec") or {}).get("queueName")
    reason, preempted = queue_reason(workload)
    if position is None and pending is not None:
        reason += f" ({pending} pending in the LocalQueue)"
    info = QueueInfo(queue=queue, reason=reason, position=position, preempted=preempted)
    return status.model_copy(update={
        "state": JobState.QUEUED, "queue": info, "message": f"queued {info.describe()}",
        "end_time": None, "exit_code": None, "requeues": preemptions(workload)})  # fmt: skip


def workload_owner(workload: dict[str, Any], kind: Kind) -> str | None:
    """The name of the job of `kind` a Workload stands for (its controller owner)."""
    for ref in (workload.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller") and ref.get("kind") == kind.kind:
            return str(ref.get("name") or "") or None
    return None


class Positions:
    """Places in LocalQueues, asked at most every POSITIONS_TTL_S per LocalQueue: the visibility
    API's pendingworkloads (positionInLocalQueue, 0 = next) where it is served, else the
    LocalQueue's pendingWorkloads count."""

    def __init__(self, api: KubeApi, namespace: str) -> None:
        self.api, self.namespace = api, namespace
        self._lock = threading.Lock()
        # LocalQueue -> (when asked, {workload name: position (1 = next)} or None, pending count)
        self._seen: dict[str, tuple[float, dict[str, int] | None, int | None]] = {}

    def of(self, queue: str, workload: str | None) -> tuple[int | None, int | None]:
        """(position of `workload`, 1 = next, or None; the LocalQueue's pending count or None)."""
        with self._lock:
            seen = self._seen.get(queue)
        if seen is None or time.monotonic() - seen[0] > POSITIONS_TTL_S:
            seen = (time.monotonic(), *self._ask(queue))
            with self._lock:
                self._seen[queue] = seen
        _, places, pending = seen
        position = places.get(workload) if places is not None and workload else None
        return position, None if places is not None else pending

    def _ask(self, queue: str) -> tuple[dict[str, int] | None, int | None]:
        path = (f"/apis/{VISIBILITY.api_version}/namespaces/{self.namespace}/localqueues/"
                f"{queue}/pendingworkloads")  # fmt: skip
        body = self.api.get_path(path)
        if body is not None:
            return {
                str(item["metadata"]["name"]): int(item.get("positionInLocalQueue", 0)) + 1
                for item in body.get("items") or []
            }, None
        try:  # not allowed or not reachable: the QUEUED state does not need the count
            local_queue = self.api.get(LOCAL_QUEUE, queue, self.namespace) or {}
        except (KubeError, BackendUnavailable):
            return None, None
        pending = (local_queue.get("status") or {}).get("pendingWorkloads")
        return None, int(pending) if pending is not None else None
