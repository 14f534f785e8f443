"""What every Kubernetes job kind writes and reads the same way (pure, no API call): label
checks, the job object's metadata and size limits, the Secret that carries secret env values,
the ConfigMaps that carry working_dir, API timestamps; and what a backend remembers in this
process beyond what the API server keeps. No Prefect import."""

from __future__ import annotations

import copy
import json
import threading
from collections import OrderedDict
from collections.abc import Collection, Mapping
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import SecretStr

from prefect_nemo.errors import InvalidJobSpec
from prefect_nemo.jobs import RESERVED_PREFIX, Failure, FailureClass, JobSpec
from prefect_nemo.kube import FLOW_RUN_LABEL, MANAGED_BY, Kind, managed_labels
from prefect_nemo.names import is_label_key, label_value

if TYPE_CHECKING:
    from prefect_nemo.packaging import TransportPlan

ANNOTATION_PREFIX = "prefect-nemo.io/"  # prefect_nemo.<key> job metadata is kept as these
MAX_OBJECT_BYTES = 1_000_000  # etcd's request limit is ~1.5 MiB; leave room for status
MAX_ANNOTATION_BYTES = 256 * 1024  # Kubernetes' total annotation size limit
ENV_SECRET_SUFFIX = "-env"
OWNED_ANNOTATION = "prefect-nemo.io/owned-objects"  # the Secret/ConfigMaps a job's object owns


# -------------------------------------------------------------------------------------------
# What every job object carries (pure)


def check_labels(labels: Mapping[str, str]) -> None:
    """Raise InvalidJobSpec for a JobSpec label key Kubernetes refuses or that we set."""
    for key in labels:
        if not is_label_key(key):
            raise InvalidJobSpec(
                f"JobSpec.labels: '{key}' is not a Kubernetes label key: use [prefix/]name, name "
                "at most 63 letters, digits, '-', '_', '.', starting and ending alphanumeric"
            )
        if key in (MANAGED_BY, FLOW_RUN_LABEL):
            raise InvalidJobSpec(f"JobSpec.labels: '{key}' is set by prefect-nemo: pick another")


def flow_run_of(metadata: Mapping[str, str]) -> str | None:
    """The flow run id the lifecycle put in a job's metadata, if any."""
    return metadata.get(f"{RESERVED_PREFIX}flow_run_id") or None


def job_object(
    kind: Kind,
    job_id: str,
    spec: JobSpec,
    metadata: Mapping[str, str],
    body: dict[str, Any],
    *,
    namespace: str,
    annotations: Mapping[str, str] | None = None,
    owned: Mapping[str, list[str]] | None = None,
    shrink: str,
) -> dict[str, Any]:
    """The job's object: `body` as its spec, the JobSpec's labels and ours, the reserved job
    metadata as annotations, and the names of the objects it will own (by plural: "secrets",
    "configmaps"), to adopt them even after a crash. InvalidJobSpec past Kubernetes' annotation
    limit, or (saying what to `shrink`) past ~1 MB."""
    labels = {k: label_value(v) for k, v in spec.labels.items()}
    labels.update(managed_labels(flow_run_of(metadata)))
    reserved = {
        f"{ANNOTATION_PREFIX}{k.removeprefix(RESERVED_PREFIX)}": v
        for k, v in metadata.items()
        if k.startswith(RESERVED_PREFIX)
    }
    if owned:
        reserved[OWNED_ANNOTATION] = json.dumps(dict(owned))
    manifest: dict[str, Any] = {
        "apiVersion": kind.api_version,
        "kind": kind.kind,
        "metadata": {
            "name": job_id,
            "namespace": namespace,
            "labels": labels,
            "annotations": {**reserved, **(annotations or {})},
        },
        "spec": body,
    }
    if len(json.dumps(manifest["metadata"]["annotations"])) > MAX_ANNOTATION_BYTES:
        raise InvalidJobSpec("JobSpec.metadata: too large for Kubernetes annotations (256 KiB)")
    size = len(json.dumps(manifest))
    if size > MAX_OBJECT_BYTES:
        raise InvalidJobSpec(
            f"the {kind.kind} for this job would be {size} bytes; Kubernetes objects must stay "
            f"under ~1 MB: shrink {shrink}"
        )
    return manifest


def reserved_metadata(annotations: Mapping[str, str], skip: Collection[str] = ()) -> dict[str, str]:
    """The reserved job metadata (prefect_nemo.*) back from a job object's annotations."""
    return {
        RESERVED_PREFIX + key.removeprefix(ANNOTATION_PREFIX): value
        for key, value in annotations.items()
        if key.startswith(ANNOTATION_PREFIX) and key != OWNED_ANNOTATION and key not in skip
    }


def secret_name(job_id: str) -> str:
    """The Secret holding a job's secret env values (owned by the job's object)."""
    return f"{job_id}{ENV_SECRET_SUFFIX}"


def secret_manifest(
    spec: JobSpec, job_id: str, *, namespace: str, flow_run_id: str | None
) -> dict[str, Any] | None:
    """The Secret with the job's secret env values, or None when it has none. The values never
    go into the job object itself (etcd keeps it readable to anyone who may read that kind)."""
    secrets = {k: v.get_secret_value() for k, v in spec.env.items() if isinstance(v, SecretStr)}
    if not secrets:
        return None
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": secret_name(job_id),
            "namespace": namespace,
            "labels": managed_labels(flow_run_id),
        },
        "type": "Opaque",
        "stringData": secrets,
    }


def code_plan(
    spec: JobSpec, name: str, *, chunk_bytes: int | None = None, max_bytes: int | None = None
) -> TransportPlan:
    """The ConfigMap transport of `spec.working_dir`, its parts named after `name` (the job
    id); TransportTooLarge past `max_bytes`. build_archive reuses an unchanged tree's archive
    (by content hash), so planning again at submit costs only the file walk."""
    from prefect_nemo.packaging import build_archive, plan_for

    assert spec.working_dir is not None
    archive = build_archive(Path(spec.working_dir), exclude=tuple(spec.exclude))
    return plan_for("kubernetes", archive, name=name, chunk_bytes=chunk_bytes, max_bytes=max_bytes)


def code_configmaps(
    plan: TransportPlan, *, namespace: str, flow_run_id: str | None
) -> list[dict[str, Any]]:
    """The plan's ConfigMaps as a job creates them before its object (which then owns them):
    in its namespace, labelled as ours."""
    out = []
    for cm in plan.configmaps:
        cm = copy.deepcopy(cm)
        meta = cm.setdefault("metadata", {})
        meta["namespace"] = namespace
        meta["labels"] = {**(meta.get("labels") or {}), **managed_labels(flow_run_id)}
        meta.pop("ownerReferences", None)
        out.append(cm)
    return out


def parse_time(value: Any) -> datetime | None:
    """An API timestamp ("2026-11-21T16:00:00Z"), or None when absent or malformed."""
    if not value:
        return None
    try:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        return None


# -------------------------------------------------------------------------------------------
# Why a job's pods failed (pure): what Kubernetes says, in its own words

# DisruptionTarget reasons (k8s.io/api core/v1 and the controllers that write them): the pod was
# taken away from outside, not ended by its code
_DISRUPTED_BY_NODE = {
    "DeletionByTaintManager",  # taint-eviction-controller: a NoExecute taint (unreachable node)
    "DeletionByPodGC",  # podgc: "node no longer exists" / out-of-service node
    "TerminationByKubelet",  # the kubelet: node shutdown or node-pressure eviction
    "EvictionByEvictionAPI",  # a drain (kubectl drain, a cluster autoscaler's scale-down)
}
_PREEMPTED = {"PreemptionByScheduler"}
# pod status.reason written when its node went away: "NodeLost" (controller_utils
# MarkPodsNotReady, pkg/util/node), "Evicted" (kubelet eviction manager), "Terminated" (kubelet
# node shutdown manager: "Pod was terminated in response to imminent node shutdown.")
_NODE_POD_REASONS = {"NodeLost", "Evicted", "Terminated", "Shutdown", "NodeShutdown"}
# a container waiting for what can never come: the image or its configuration is wrong
_SPEC_WAITING = {
    "ImagePullBackOff", "ErrImagePull", "InvalidImageName", "ErrImageNeverPull",
    "CreateContainerConfigError",
}  # fmt: skip


def pod_nodes(pods: Collection[Mapping[str, Any]]) -> set[str]:
    """The nodes the pods that did not succeed were bound to: the nodes worth looking at."""
    return {
        str(node)
        for pod in pods
        if (pod.get("status") or {}).get("phase") != "Succeeded"
        and (node := (pod.get("spec") or {}).get("nodeName"))
    }


def node_lost(node: Mapping[str, Any] | None) -> str | None:
    """Why a Node is lost ("node gone", its Ready condition's reason), None while Ready True."""
    if node is None:
        return "node gone"
    for cond in (node.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            if cond.get("status") == "True":
                return None
            return f"node NotReady: {cond.get('reason') or cond.get('status')}"
    return None  # no Ready condition reported yet: say nothing


def pod_failure(
    pods: Collection[Mapping[str, Any]], nodes: Mapping[str, Mapping[str, Any] | None]
) -> Failure | None:
    """The failure a FAILED job's pods show, most telling first: a node lost (a DisruptionTarget
    by the taint manager, the pod GC or the kubelet, a node-loss pod reason, or the pod's Node
    NotReady or gone: `nodes` maps the names asked to their Node, None for gone) is
    infrastructure; a preemption by the scheduler, preempted; a container waiting on its image
    or configuration, spec; OOMKilled, application. None when the pods say nothing more than an
    exit code: the lifecycle reads the log tail then (an NCCL error exits 1 too)."""
    live = [p for p in pods if (p.get("status") or {}).get("phase") != "Succeeded"]
    for pod in live:
        status, node = pod.get("status") or {}, (pod.get("spec") or {}).get("nodeName")
        for cond in status.get("conditions") or []:
            if cond.get("type") != "DisruptionTarget" or cond.get("status") != "True":
                continue
            reason = str(cond.get("reason") or "DisruptionTarget")
            if reason in _PREEMPTED:
                return Failure(kind=FailureClass.PREEMPTED, reason=reason, node=node)
            if reason in _DISRUPTED_BY_NODE:
                return Failure(kind=FailureClass.INFRASTRUCTURE, reason=reason, node=node)
        if status.get("reason") in _NODE_POD_REASONS:
            return Failure(kind=FailureClass.INFRASTRUCTURE, reason=status["reason"], node=node)
    for pod in live:  # no controller said it yet: the Node itself
        node = (pod.get("spec") or {}).get("nodeName")
        if node and node in nodes and (why := node_lost(nodes[node])):
            return Failure(kind=FailureClass.INFRASTRUCTURE, reason=why, node=node)
    for pod in live:
        status = pod.get("status") or {}
        containers = [*(status.get("initContainerStatuses") or []),
                      *(status.get("containerStatuses") or [])]  # fmt: skip
        for cs in containers:
            state = cs.get("state") or {}
            waiting = (state.get("waiting") or {}).get("reason")
            if waiting in _SPEC_WAITING:
                return Failure(kind=FailureClass.SPEC, reason=f"{cs.get('name')}: {waiting}")
        for cs in containers:
            for state in (cs.get("state") or {}, cs.get("lastState") or {}):
                if ((state.get("terminated") or {}).get("reason")) == "OOMKilled":
                    reason = f"{cs.get('name')}: OOMKilled"
                    return Failure(kind=FailureClass.APPLICATION, reason=reason)
    return None


# -------------------------------------------------------------------------------------------
# What a backend remembers in this process beyond what the API server keeps


class StreamedLog:
    """A log as it streams from its start, kept as its chunks and joined only when read (a
    join per chunk would copy the whole log again for every chunk)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._chunks: list[str] = []
        self.size = 0  # characters so far

    def add(self, chunk: str) -> None:
        with self._lock:
            self._chunks.append(chunk)
            self.size += len(chunk)

    def text(self) -> str:
        with self._lock:
            if len(self._chunks) > 1:
                self._chunks = ["".join(self._chunks)]
            return self._chunks[0] if self._chunks else ""


class JobMemory:
    """Per (cluster, job id): whether we deleted the job to stop it (so it reads STOPPED once
    it is gone, not "missing"), and the longest log we read or streamed (still readable after
    teardown took the pods or the Ray head away). One per job kind, shared by its backend
    instances."""

    def __init__(self, max_logs: int = 256) -> None:
        self._lock = threading.Lock()
        self._deleted: set[tuple[str, str]] = set()
        self._logs: OrderedDict[tuple[str, str], str] = OrderedDict()  # whole reads
        self._streams: OrderedDict[tuple[str, str], StreamedLog] = OrderedDict()
        self._max_logs = max_logs

    def mark_deleted(self, key: tuple[str, str]) -> None:
        """Remember that we deleted this job to stop it."""
        with self._lock:
            self._deleted.add(key)

    def forget_deleted(self, key: tuple[str, str]) -> None:
        """Forget it (the id is being submitted anew)."""
        with self._lock:
            self._deleted.discard(key)

    def was_deleted(self, key: tuple[str, str]) -> bool:
        """True when we deleted this job to stop it."""
        with self._lock:
            return key in self._deleted

    def remember_log(self, key: tuple[str, str], text: str) -> str:
        """Keep the longest whole read so far; returns the longest log known (read or
        streamed)."""
        with self._lock:
            if len(text) >= len(self._logs.get(key, "")):
                _keep(self._logs, key, text, self._max_logs)
            return self._longest(key) or text

    def stream_log(self, key: tuple[str, str]) -> StreamedLog:
        """A new record of the key's log streamed from its start (a stream that broke is
        tailed again from the top: what the last one gathered stays, as a read)."""
        with self._lock:
            old = self._streams.get(key)
            if old is not None and old.size > len(self._logs.get(key, "")):
                _keep(self._logs, key, old.text(), self._max_logs)
            stream = StreamedLog()
            _keep(self._streams, key, stream, self._max_logs)
            return stream

    def last_log(self, key: tuple[str, str]) -> str | None:
        """The longest log read or streamed so far, or None."""
        with self._lock:
            return self._longest(key)

    def _longest(self, key: tuple[str, str]) -> str | None:
        text, stream = self._logs.get(key), self._streams.get(key)
        if stream is not None and stream.size > len(text or ""):
            return stream.text()
        return text


def _keep(memory: OrderedDict[tuple[str, str], Any], key: tuple[str, str], value: Any,
          most: int) -> None:  # fmt: skip
    """Set the newest entry of a bounded memory, dropping the oldest past `most`."""
    memory[key] = value
    memory.move_to_end(key)
    while len(memory) > most:
        memory.popitem(last=False)
