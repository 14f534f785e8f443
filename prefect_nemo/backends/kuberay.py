"""The KubeRay backend: one RayJob per job, through the Kubernetes API (no Prefect import).

A job becomes a RayJob named after the job id (KubeRay caps RayJob names at 47 characters,
DNS-1035). The RayJob either brings its own cluster (an inline ``rayClusterSpec``, torn down by
KubeRay when the job ends: ``shutdownAfterJobFinishes``) or runs on an existing RayCluster
(``clusterSelector``). We set ``spec.jobId`` to the job id, so the Ray submission id is ours too.

Status comes from the RayJob's ``status`` (``jobDeploymentStatus`` for KubeRay's side,
``jobStatus`` for Ray's), read from one watch-fed cache (`Informer`) per namespace, so waiting
on many jobs costs no request per job. Logs and stop go to the Ray Jobs API of the job's
cluster through the API server's service proxy (`<cluster>-head-svc:8265`); the proxy strips
``Authorization``, so Ray's token travels in ``X-Ray-Authorization``.

State mapping (``jobDeploymentStatus`` first, then ``jobStatus``):

=====================  ==============================  ===========================================
jobDeploymentStatus    jobStatus                       JobState (message)
=====================  ==============================  ===========================================
ValidationFailed       any                             FAILED ("KubeRay rejected RayJob <name>:
                                                       <message>")
Failed                 STOPPED                         STOPPED ("<reason>: <message>")
Failed                 anything else                   FAILED ("<reason>: <message>", e.g.
                                                       DeadlineExceeded, AppFailed)
Complete               SUCCEEDED / FAILED / STOPPED    the same
Complete               not terminal                    FAILED (KubeRay ended it unfinished)
Suspended, Suspending  any                             STOPPED
Running                SUCCEEDED / FAILED / STOPPED    the same (the Ray job ended; KubeRay will
                                                       say Complete next, maybe after the logs
                                                       are gone)
Running                RUNNING                         RUNNING
Running                "", PENDING                     PENDING
Retrying               any                             PENDING (a new attempt is coming)
Initializing, Waiting  any                             PENDING
"" (not yet seen)      any                             PENDING
(RayJob gone)          -                               STOPPED if we deleted it, else absent
=====================  ==============================  ===========================================

Secret env values (SecretStr in JobSpec.env) never go into the RayJob (etcd keeps it readable to
anyone who may read RayJobs): with an inline cluster they go into a Secret we own and the head
and worker containers read it with ``envFrom``; with an existing cluster they are refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import re
import threading
import time
from collections.abc import AsyncGenerator, Callable, Collection
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import yaml
from pydantic import SecretStr

from prefect_nemo.backends.ray_jobs import OVERRIDE_RUNTIME_ENV, RayJobsBackend
from prefect_nemo.errors import (
    AuthenticationFailed,
    BackendClosed,
    BackendUnavailable,
    InvalidJobSpec,
    JobAlreadyExists,
    PrefectNemoError,
)
from prefect_nemo.jobs import RESERVED_PREFIX, JobHandle, JobSpec, JobState, JobStatus
from prefect_nemo.kube import (
    MANAGED_BY,
    RAY_CLUSTER,
    RAY_JOB,
    SECRET,
    AlreadyExists,
    Applied,
    Informer,
    Invalid,
    KubeApi,
    NotFound,
    apply_or_attach,
    managed_labels,
    owner_reference,
    wait_for,
)
from prefect_nemo.kube.jobspec import check_labels, parse_time, secret_manifest, secret_name
from prefect_nemo.kube.memory import JobMemory, Subscribers
from prefect_nemo.names import is_dns1035_label, is_dns1123_subdomain, label_value
from prefect_nemo.packaging import collect_source, stage_source
from prefect_nemo.placement.spec import to_ray_entrypoint

SubmissionMode = Literal["K8sJobMode", "HTTPMode", "SidecarMode"]
SUBMISSION_MODES: tuple[str, ...] = ("K8sJobMode", "HTTPMode", "SidecarMode")
MAX_RAYJOB_NAME = 47  # KubeRay's MaxRayJobNameLength
DASHBOARD_PORT = 8265
RAY_TOKEN_HEADER = "X-Ray-Authorization"
ANNOTATION_PREFIX = "prefect-nemo.io/"
MAX_OBJECT_BYTES = 1_000_000  # etcd's request limit is ~1.5 MiB; leave room for status
MAX_ANNOTATION_BYTES = 256 * 1024  # Kubernetes' total annotation size limit
STOP_ESCALATE_S = 10.0  # a Ray stop not confirmed by then is escalated to deleting the RayJob

_EXIT_CODE = re.compile(r"exit code (-?\d+)")


# -------------------------------------------------------------------------------------------
# Configuration and validation (pure: no API calls)


@dataclass(frozen=True)
class RayJobConfig:
    """Where and how RayJobs run: the cluster (existing name XOR inline spec) and KubeRay knobs."""

    ray_cluster_name: str | None = None
    ray_cluster_spec: dict[str, Any] | None = None
    shutdown_after_job_finishes: bool = True
    ttl_seconds_after_finished: int = 60
    submission_mode: str = "K8sJobMode"
    active_deadline_seconds: int | None = None

    def __post_init__(self) -> None:
        check_config(self)

    @property
    def inline(self) -> bool:
        """True when each RayJob brings its own cluster (rayClusterSpec)."""
        return self.ray_cluster_spec is not None


def check_config(config: RayJobConfig) -> None:
    """Raise InvalidJobSpec naming the field and the fix for a config KubeRay would reject."""
    if (config.ray_cluster_name is None) == (config.ray_cluster_spec is None):
        raise InvalidJobSpec(
            "KubeRayCluster: set exactly one of ray_cluster_name (run on an existing RayCluster) "
            "or ray_cluster_spec (each RayJob brings its own cluster)"
        )
    if config.ray_cluster_name is not None and not (
        is_dns1123_subdomain(config.ray_cluster_name, 63)
    ):
        raise InvalidJobSpec(
            f"KubeRayCluster.ray_cluster_name: '{config.ray_cluster_name}' is not a Kubernetes "
            "object name: use lowercase letters, digits and '-', at most 63 characters"
        )
    if config.submission_mode not in SUBMISSION_MODES:
        raise InvalidJobSpec(
            f"KubeRayCluster.submission_mode: '{config.submission_mode}' is not one of "
            f"{', '.join(SUBMISSION_MODES)} (InteractiveMode needs a person to submit the job)"
        )
    if config.ray_cluster_name is not None and config.submission_mode == "SidecarMode":
        raise InvalidJobSpec(
            "KubeRayCluster.submission_mode: KubeRay does not support SidecarMode with an "
            "existing cluster (ray_cluster_name): use K8sJobMode or HTTPMode"
        )
    if config.ttl_seconds_after_finished < 0:
        raise InvalidJobSpec(
            "KubeRayCluster.ttl_seconds_after_finished: must be >= 0 (seconds the finished "
            "cluster stays up, for its logs)"
        )
    if config.active_deadline_seconds is not None and config.active_deadline_seconds <= 0:
        raise InvalidJobSpec(
            "KubeRayCluster.active_deadline_seconds: must be a positive number of seconds, or "
            "unset (JobSpec.timeout_s already stops the job)"
        )
    if config.ray_cluster_spec is not None:
        _check_cluster_spec(config.ray_cluster_spec)


def _check_cluster_spec(spec: Any) -> None:
    """The parts of a rayClusterSpec we rely on (the API server checks the rest)."""
    where = "KubeRayCluster.ray_cluster_spec"
    if not isinstance(spec, dict):
        raise InvalidJobSpec(
            f"{where}: must be a mapping (a RayCluster's spec), got {type(spec).__name__}"
        )
    if "kind" in spec or "apiVersion" in spec:
        raise InvalidJobSpec(
            f"{where}: looks like a whole RayCluster manifest: give its `spec` only"
        )
    head = spec.get("headGroupSpec")
    if not isinstance(head, dict):
        raise InvalidJobSpec(f"{where}.headGroupSpec: required (the head pod's template)")
    _containers(head, f"{where}.headGroupSpec")
    workers = spec.get("workerGroupSpecs", [])
    if not isinstance(workers, list):
        raise InvalidJobSpec(f"{where}.workerGroupSpecs: must be a list of worker groups")
    for i, group in enumerate(workers):
        if not isinstance(group, dict):
            raise InvalidJobSpec(f"{where}.workerGroupSpecs[{i}]: must be a mapping")
        _containers(group, f"{where}.workerGroupSpecs[{i}]")
    try:
        json.dumps(spec, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidJobSpec(f"{where}: must be JSON-serializable ({exc})") from None


def _containers(group: dict[str, Any], where: str) -> list[dict[str, Any]]:
    containers = (group.get("template") or {}).get("spec", {}).get("containers")
    if not isinstance(containers, list) or not containers:
        raise InvalidJobSpec(
            f"{where}.template.spec.containers: required, with the Ray container first"
        )
    if not all(isinstance(c, dict) for c in containers):
        raise InvalidJobSpec(f"{where}.template.spec.containers: every entry must be a mapping")
    return containers


def check_spec(spec: JobSpec, config: RayJobConfig) -> None:
    """Raise InvalidJobSpec for what a RayJob cannot carry; sends nothing."""
    res = spec.resources
    if res.memory_bytes is not None:
        raise InvalidJobSpec(
            "JobSpec.resources.memory_bytes: a RayJob has no entrypoint memory field: drop it, "
            "or run through the Ray Jobs backend (ray_jobs_block) against the cluster"
        )
    if spec.label_selector:
        raise InvalidJobSpec(
            "JobSpec.label_selector: a RayJob has no entrypoint label selector: drop it, or use "
            "entrypoint resources (JobSpec.resources.custom) to steer the driver"
        )
    placement = spec.placement
    if placement is not None:
        if placement.nodes != 1:
            raise InvalidJobSpec(
                f"JobSpec.placement.nodes: {placement.nodes}, but a RayJob's entrypoint runs on "
                "one node: use nodes=1 (strategy='pack') and put multi-node work in the "
                "RayCluster spec (its worker groups), where the job's own Ray tasks spread"
            )
        if placement.node_labels:
            raise InvalidJobSpec(
                "JobSpec.placement.node_labels: a RayJob has no entrypoint label selector: drop "
                "them, or steer the driver with entrypoint resources (JobSpec.resources.custom)"
            )
        if placement.exclude_head:
            raise InvalidJobSpec(
                "JobSpec.placement.exclude_head: a RayJob cannot keep its entrypoint off the "
                "head (that needs a label selector): drop it, or give the head no CPUs in the "
                "RayCluster spec (rayStartParams num-cpus: '0') so the driver lands on a worker"
            )
    if spec.secret_values() and not config.inline:
        names = ", ".join(k for k, v in spec.env.items() if isinstance(v, SecretStr))
        raise InvalidJobSpec(
            f"JobSpec.env: {names} are secrets, and with an existing cluster (ray_cluster_name) "
            "they could only travel inside the RayJob object, which anyone who may read RayJobs "
            "can read. Put them in a Kubernetes Secret mounted in the RayCluster's pods, or use "
            "an inline ray_cluster_spec (prefect-nemo then creates and mounts the Secret)"
        )
    if spec.working_dir is not None and config.inline:
        raise InvalidJobSpec(
            "JobSpec.working_dir: working_dir with an inline rayClusterSpec needs the ConfigMap "
            "transport (issue 4); use ray_cluster_name or bake the code into the image"
        )
    try:
        yaml.safe_dump(spec.runtime_env)
        json.dumps(spec.runtime_env, allow_nan=False)
    except (TypeError, ValueError, yaml.YAMLError) as exc:
        raise InvalidJobSpec(
            f"JobSpec.runtime_env: must be plain data (it travels as YAML in the RayJob): {exc}"
        ) from None
    check_labels(spec.labels)


def check_job_id(job_id: str) -> None:
    """KubeRay refuses RayJob names over 47 characters or not DNS-1035."""
    if not is_dns1035_label(job_id, MAX_RAYJOB_NAME):
        raise InvalidJobSpec(
            f"job id '{job_id}' cannot name a RayJob: KubeRay wants a DNS-1035 label of at most "
            f"{MAX_RAYJOB_NAME} characters: use a shorter JobSpec.name or experiment name"
        )


# -------------------------------------------------------------------------------------------
# Manifests (pure)


def rayjob_manifest(
    spec: JobSpec,
    job_id: str,
    metadata: dict[str, str],
    config: RayJobConfig,
    *,
    namespace: str,
    working_dir_uri: str | None = None,
) -> dict[str, Any]:
    """The RayJob for a job: everything but secret env values, which go to `secret_manifest`."""
    flow_run_id = metadata.get(f"{RESERVED_PREFIX}flow_run_id") or None
    labels = {k: label_value(v) for k, v in spec.labels.items()}
    labels.update(managed_labels(flow_run_id))
    ray_metadata = {**spec.metadata, **metadata}
    annotations = {
        f"{ANNOTATION_PREFIX}{k.removeprefix(RESERVED_PREFIX)}": v
        for k, v in metadata.items()
        if k.startswith(RESERVED_PREFIX)
    }
    runtime_env: dict[str, Any] = dict(spec.runtime_env)
    plain = {k: v for k, v in spec.env.items() if isinstance(v, str)}
    runtime_env["env_vars"] = {**plain, **OVERRIDE_RUNTIME_ENV}
    if working_dir_uri is not None:
        runtime_env["working_dir"] = working_dir_uri
    body: dict[str, Any] = {
        "entrypoint": spec.entrypoint,
        "jobId": job_id,
        "metadata": ray_metadata,
        "runtimeEnvYAML": yaml.safe_dump(runtime_env, sort_keys=True),
        "submissionMode": config.submission_mode,
    }
    res = spec.resources
    if res.cpus is not None:
        body["entrypointNumCpus"] = res.cpus
    if res.gpus is not None:
        body["entrypointNumGpus"] = res.gpus
    if spec.placement is not None:  # check_spec refused what a RayJob cannot say
        placed, _ = to_ray_entrypoint(spec.placement)
        if "entrypoint_num_cpus" in placed:
            body["entrypointNumCpus"] = placed["entrypoint_num_cpus"]
        if "entrypoint_num_gpus" in placed:
            body["entrypointNumGpus"] = placed["entrypoint_num_gpus"]
    if res.custom:
        body["entrypointResources"] = json.dumps(dict(res.custom), sort_keys=True)
    if config.active_deadline_seconds is not None:
        body["activeDeadlineSeconds"] = config.active_deadline_seconds
    if config.ray_cluster_spec is not None:
        cluster_spec = copy.deepcopy(config.ray_cluster_spec)
        if spec.secret_values():
            _mount_secret(cluster_spec, secret_name(job_id))
        body["rayClusterSpec"] = cluster_spec
        body["shutdownAfterJobFinishes"] = config.shutdown_after_job_finishes
        if config.shutdown_after_job_finishes:
            body["ttlSecondsAfterFinished"] = config.ttl_seconds_after_finished
    else:
        body["clusterSelector"] = {"ray.io/cluster": str(config.ray_cluster_name)}
    manifest = {
        "apiVersion": RAY_JOB.api_version,
        "kind": RAY_JOB.kind,
        "metadata": {
            "name": job_id,
            "namespace": namespace,
            "labels": labels,
            "annotations": annotations,
        },
        "spec": body,
    }
    if len(json.dumps(annotations)) > MAX_ANNOTATION_BYTES:
        raise InvalidJobSpec("JobSpec.metadata: too large for Kubernetes annotations (256 KiB)")
    size = len(json.dumps(manifest))
    if size > MAX_OBJECT_BYTES:
        raise InvalidJobSpec(
            f"the RayJob for this job would be {size} bytes; Kubernetes objects must stay under "
            "~1 MB: shrink JobSpec.entrypoint/env/runtime_env/metadata or ray_cluster_spec"
        )
    return manifest


def _mount_secret(cluster_spec: dict[str, Any], name: str) -> None:
    """Add `envFrom: secretRef` to every container of the head and worker groups."""
    groups = [cluster_spec["headGroupSpec"], *cluster_spec.get("workerGroupSpecs", [])]
    for group in groups:
        for container in group["template"]["spec"]["containers"]:
            container.setdefault("envFrom", []).append({"secretRef": {"name": name}})


# -------------------------------------------------------------------------------------------
# Status mapping (pure)


def _terminal(job_status: str) -> JobState | None:
    try:
        state = JobState(job_status)
    except ValueError:
        return None
    return state if state.is_terminal() else None


def status_from_rayjob(obj: dict[str, Any]) -> JobStatus:
    """Our JobStatus from a RayJob object (the table in the module docstring)."""
    meta = obj.get("metadata") or {}
    status = obj.get("status") or {}
    name = meta.get("name", "")
    deployment = status.get("jobDeploymentStatus") or ""
    job_status = status.get("jobStatus") or ""
    message = status.get("message") or ""
    reason = status.get("reason") or ""
    if deployment == "ValidationFailed":
        state = JobState.FAILED
        message = f"KubeRay rejected RayJob {name}: {message or reason or 'invalid spec'}"
    elif deployment == "Failed":
        state = JobState.STOPPED if job_status == "STOPPED" else JobState.FAILED
        message = ": ".join(p for p in (reason, message) if p) or "KubeRay marked it Failed"
    elif deployment == "Complete":
        state = _terminal(job_status) or JobState.FAILED
        if state is JobState.FAILED and not message:
            message = f"KubeRay completed the RayJob with Ray job status '{job_status}'"
    elif deployment in ("Suspended", "Suspending"):
        state = JobState.STOPPED
        message = message or f"RayJob {name} is {deployment.lower()}"
    elif deployment == "Running":
        state = _terminal(job_status) or (
            JobState.RUNNING if job_status == "RUNNING" else JobState.PENDING
        )
    else:  # "", Initializing, Waiting, Retrying
        state = JobState.PENDING
    exit_code = None
    if state is JobState.FAILED and (match := _EXIT_CODE.search(message)):
        exit_code = int(match.group(1))
    spec_meta = (obj.get("spec") or {}).get("metadata") or {}
    metadata = {str(k): str(v) for k, v in spec_meta.items()}
    for key, value in (meta.get("annotations") or {}).items():
        if key.startswith(ANNOTATION_PREFIX):
            metadata.setdefault(RESERVED_PREFIX + key.removeprefix(ANNOTATION_PREFIX), value)
    return JobStatus(
        job_id=name,
        state=state,
        message=message,
        start_time=parse_time(status.get("startTime")),
        end_time=parse_time(status.get("endTime")),
        exit_code=exit_code,
        metadata=metadata,
    )


# -------------------------------------------------------------------------------------------
# Process-wide bookkeeping shared by the backend instances of one namespace

_memory = JobMemory()  # RayJobs we deleted to stop them; last logs read
_stops: dict[tuple[str, str], float] = {}  # (cluster, job id) -> when we first asked it to stop
_stops_lock = threading.Lock()


# -------------------------------------------------------------------------------------------
# The backend


class KubeRayBackend:
    """Run jobs as KubeRay RayJobs: submit, watch (one informer per namespace), stop, logs."""

    kind: ClassVar[str] = "kuberay"
    max_job_id_len: ClassVar[int] = MAX_RAYJOB_NAME

    def __init__(
        self,
        api: KubeApi,
        config: RayJobConfig,
        *,
        namespace: str | None = None,
        ray_token: str | None = None,
    ) -> None:
        self.api = api
        self.config = config
        self.namespace = namespace or api.namespace
        self._ray_token = ray_token
        self._informer: Informer | None = None
        self._subscribers = Subscribers()
        self._lock = threading.Lock()
        self._closed = False

    # -- identity ------------------------------------------------------------------------------

    @property
    def cluster(self) -> str:
        """API server and namespace: one watcher (and one informer) per namespace."""
        return f"{self.api.host}/namespaces/{self.namespace}/rayjobs"

    @property
    def secrets(self) -> list[str]:
        """The API credentials and the Ray token, for redaction."""
        return [s for s in [*self.api.secrets, self._ray_token] if s]

    def rayjob_url(self, job_id: str) -> str:
        """The RayJob's path on the API server."""
        return (
            f"{self.api.host}/apis/{RAY_JOB.group}/{RAY_JOB.version}/namespaces/"
            f"{self.namespace}/{RAY_JOB.plural}/{job_id}"
        )

    def handle(self, job_id: str) -> JobHandle:
        """The handle with the RayJob's API path and, on an existing cluster, its dashboard.

        An inline cluster's name gets a random suffix from KubeRay, so its dashboard link is
        known only later (resolve_ray_cluster_name).
        """
        links = {"rayjob": self.rayjob_url(job_id)}
        if self.config.ray_cluster_name:
            base = self.api.proxy_url(
                self.namespace, head_service(self.config.ray_cluster_name), DASHBOARD_PORT
            )
            links["dashboard"] = f"{base}/#/jobs/{job_id}"
        return JobHandle(backend=self.kind, cluster=self.cluster, job_id=job_id, links=links)

    # -- Backend protocol -----------------------------------------------------------------------

    def validate(self, spec: JobSpec) -> None:
        """Everything we can check without the API server (names, sizes, secrets, code)."""
        check_spec(spec, self.config)
        # a dry build with the longest name catches sizes (annotations, the ~1 MB object limit)
        rayjob_manifest(spec, "j" * MAX_RAYJOB_NAME, {}, self.config, namespace=self.namespace)

    def check_access(self) -> None:
        """Reach the API server, prove we may list RayJobs (KubeRay installed), and that the
        target RayCluster exists when we run on an existing one."""
        try:
            self.api.list(
                RAY_JOB, self.namespace, label_selector=f"{MANAGED_BY}=prefect-nemo", limit=1
            )
        except NotFound:
            raise BackendUnavailable(
                f"the API server at {self.api.host} does not serve {RAY_JOB.plural}."
                f"{RAY_JOB.group}/{RAY_JOB.version}: install the KubeRay operator (its CRDs) "
                "in the cluster"
            ) from None
        name = self.config.ray_cluster_name
        if name and self.api.get(RAY_CLUSTER, name, self.namespace) is None:
            raise InvalidJobSpec(
                f"KubeRayCluster.ray_cluster_name: no RayCluster '{name}' in namespace "
                f"'{self.namespace}': create it (ensure_ray_cluster) or fix the name"
            )

    def find(self, job_id: str) -> JobStatus | None:
        """The RayJob's status (one GET), STOPPED if we deleted it, None if there is none."""
        obj = self.api.get(RAY_JOB, job_id, self.namespace)
        if obj is None:
            return self._deleted_status(job_id)
        return status_from_rayjob(obj)

    def submit(self, spec: JobSpec, job_id: str, metadata: dict[str, str]) -> JobHandle:
        """Create the RayJob (and its Secret); JobAlreadyExists if the name is taken."""
        check_job_id(job_id)
        check_spec(spec, self.config)
        flow_run_id = metadata.get(f"{RESERVED_PREFIX}flow_run_id") or None
        uri = self._upload_working_dir(spec) if spec.working_dir is not None else None
        manifest = rayjob_manifest(
            spec, job_id, metadata, self.config, namespace=self.namespace, working_dir_uri=uri
        )
        secret = secret_manifest(spec, job_id, namespace=self.namespace, flow_run_id=flow_run_id)
        if secret is not None:
            self._create_secret(secret, job_id)
        try:
            created = self.api.create(RAY_JOB, manifest, self.namespace)
        except AlreadyExists:
            if secret is not None:  # a Secret we just re-made belongs to the RayJob that won
                self._own_secret(job_id, self.api.get(RAY_JOB, job_id, self.namespace))
            raise JobAlreadyExists(f"RayJob '{job_id}' already exists") from None
        except Exception as exc:
            if secret is not None:  # nothing will own it: do not leave the secret behind
                with contextlib.suppress(Exception):
                    self.api.delete(SECRET, secret_name(job_id), self.namespace)
            if isinstance(exc, Invalid):
                raise InvalidJobSpec(
                    f"{exc}. Check KubeRayCluster.ray_cluster_spec and the JobSpec fields it names"
                ) from None
            raise
        self._own_secret(job_id, created if secret is not None else None)
        return self.handle(job_id)

    def statuses(self, job_ids: Collection[str]) -> dict[str, JobStatus]:
        """From the informer's cache; one GET only for ids the cache has not seen yet."""
        if self._closed:
            raise BackendClosed(f"the KubeRay backend of {self.cluster} was closed")
        informer = self._ensure_informer()
        error = informer.error
        if isinstance(error, AuthenticationFailed):  # not transient: the watcher fails at once
            raise AuthenticationFailed(str(error))
        if error is not None:  # the watcher retries within its unreachable budget
            raise BackendUnavailable(
                f"watch of RayJobs in {self.namespace} on {self.api.host} broke: {error}"
            )
        synced = informer.synced.is_set()
        out: dict[str, JobStatus] = {}
        for job_id in job_ids:
            obj = informer.get(job_id) if synced else None
            if obj is None:
                obj = self.api.get(RAY_JOB, job_id, self.namespace)
            if obj is not None:
                out[job_id] = status_from_rayjob(obj)
            elif (gone := self._deleted_status(job_id)) is not None:
                out[job_id] = gone
        return out

    def subscribe(self, wake: Callable[[], None]) -> Callable[[], None]:
        """Wake the watcher on every change of a managed RayJob in the namespace."""
        self._subscribers.add(wake)
        self._ensure_informer(fresh=True)

        def unsubscribe() -> None:
            if self._subscribers.remove(wake):
                with self._lock:
                    informer, self._informer = self._informer, None
                if informer is not None:
                    informer.stop()

        return unsubscribe

    def close(self) -> None:
        """Stop the informer (its watch is cut at once) and wake the subscribed watchers, whose
        next poll then raises BackendClosed."""
        with self._lock:
            self._closed = True
            informer, self._informer = self._informer, None
        if informer is not None:
            informer.stop()
        self._subscribers.wake_all()

    def request_stop(self, job_id: str) -> None:
        """Stop the Ray job if it was submitted, else delete the RayJob (and its cluster).

        A submitted job is stopped through Ray, so its RayJob keeps its final status and logs
        (and KubeRay tears an inline cluster down after the TTL). Before submission there is
        nothing to stop in Ray: deleting the RayJob (foreground) takes its cluster with it. So
        does a Ray stop that has not taken within STOP_ESCALATE_S (Ray holds a stop of a job
        still PENDING for resources) or cannot reach the head.
        """
        obj = self.api.get(RAY_JOB, job_id, self.namespace)
        if obj is None:
            return
        status = obj.get("status") or {}
        ray_job_id, cluster = status.get("jobId"), status.get("rayClusterName")
        submitted = bool(ray_job_id and cluster and status.get("jobStatus"))
        key = (self.cluster, job_id)
        with _stops_lock:
            first_stop = _stops.setdefault(key, time.monotonic())
        patient = time.monotonic() - first_stop < STOP_ESCALATE_S
        if submitted and patient and not (obj.get("metadata") or {}).get("deletionTimestamp"):
            try:
                self._ray(str(cluster)).request_stop(str(ray_job_id))
                return
            except BackendUnavailable:
                pass  # the head is unreachable: deleting the RayJob is the sure way
        _memory.mark_deleted(key)
        self.api.delete(RAY_JOB, job_id, self.namespace, propagation="Foreground")

    def logs(self, job_id: str) -> str:
        """The job's whole log from Ray (through the proxy); the last read once it is gone."""
        key = (self.cluster, job_id)
        try:
            target = self._ray_target(job_id)
            if target is None:
                return _memory.last_log(key) or ""
            text = self._ray(target[0]).logs(target[1])
        except (BackendUnavailable, RuntimeError):
            cached = _memory.last_log(key)
            if cached is not None:
                return cached
            raise
        _memory.remember_log(key, text)
        return text

    async def tail_logs(self, job_id: str) -> AsyncGenerator[str, None]:
        """Stream the log through the proxy once the job runs; ends when the job ends."""
        while True:
            status = await asyncio.to_thread(self.find, job_id)
            if status is None or status.state.is_terminal():
                return
            if status.state is JobState.RUNNING:
                target = await asyncio.to_thread(self._ray_target, job_id)
                if target is not None:
                    break
            await asyncio.sleep(0.5)
        key, seen = (self.cluster, job_id), ""
        async for chunk in self._ray(target[0]).tail_logs(target[1]):
            seen += chunk
            _memory.remember_log(key, seen)
            yield chunk

    # -- helpers ----------------------------------------------------------------------------------

    def _deleted_status(self, job_id: str) -> JobStatus | None:
        return _memory.stopped_status(
            self.cluster,
            job_id,
            "stopped by deleting its RayJob (and the RayCluster it brought up)",
        )

    def _ensure_informer(self, *, fresh: bool = False) -> Informer:
        """The namespace's informer, started on first use; `fresh` replaces one that failed
        (e.g. on credentials since fixed) when a watcher starts anew."""
        with self._lock:
            if fresh and self._informer is not None and self._informer.error is not None:
                self._informer.stop()
                self._informer = None
            if self._informer is None:
                self._informer = Informer(
                    self.api,
                    RAY_JOB,
                    self.namespace,
                    label_selector=f"{MANAGED_BY}=prefect-nemo",
                    on_change=self._subscribers.wake_all,
                )
                self._informer.start()
            return self._informer

    def _ray_target(self, job_id: str) -> tuple[str, str] | None:
        """(RayCluster name, Ray submission id) once KubeRay has submitted the job."""
        obj = self.api.get(RAY_JOB, job_id, self.namespace)
        status = (obj or {}).get("status") or {}
        cluster, ray_job_id = status.get("rayClusterName"), status.get("jobId")
        if not cluster or not ray_job_id:
            return None
        return str(cluster), str(ray_job_id)

    def _ray(self, cluster_name: str) -> RayJobsBackend:
        """The Ray Jobs API of a RayCluster, through the API server's service proxy."""
        return ray_jobs_backend(self.api, cluster_name, self.namespace, ray_token=self._ray_token)

    def _own_secret(self, job_id: str, owner: dict[str, Any] | None) -> None:
        """Make the RayJob own its Secret, so deleting the RayJob deletes the Secret."""
        if owner is not None:
            self.api.patch(
                SECRET,
                secret_name(job_id),
                {"metadata": {"ownerReferences": [owner_reference(owner)]}},
                self.namespace,
            )

    def _create_secret(self, secret: dict[str, Any], job_id: str) -> None:
        """Create the job's Secret before the RayJob, so its pods find it when they start.

        A Secret left over from a submit that died before creating the RayJob is refreshed; if
        the RayJob exists, this is an attach and the Secret is left alone.
        """
        try:
            self.api.create(SECRET, secret, self.namespace)
        except AlreadyExists:
            if self.api.get(RAY_JOB, job_id, self.namespace) is not None:
                raise JobAlreadyExists(f"RayJob '{job_id}' already exists") from None
            self.api.delete(SECRET, secret["metadata"]["name"], self.namespace)
            self.api.create(SECRET, secret, self.namespace)

    def _upload_working_dir(self, spec: JobSpec) -> str:
        """Package working_dir and upload it to the target cluster's GCS with Ray's own
        uploader (through the proxy); returns the gcs:// URI for runtimeEnvYAML."""
        assert spec.working_dir is not None and self.config.ray_cluster_name
        tree = collect_source(spec.working_dir, exclude=spec.exclude)
        runtime_env: dict[str, Any] = {"working_dir": str(stage_source(tree))}
        ray = self._ray(self.config.ray_cluster_name)
        ray._call(lambda: ray.client._upload_working_dir_if_needed(runtime_env))
        return str(runtime_env["working_dir"])


# -------------------------------------------------------------------------------------------
# The Ray Jobs API of a RayCluster through the API server, and the RayCluster lifecycle


def head_service(cluster_name: str) -> str:
    """KubeRay's head Service of a RayCluster."""
    return f"{cluster_name}-head-svc"


def ray_jobs_backend(
    api: KubeApi, cluster_name: str, namespace: str | None = None, *, ray_token: str | None = None
) -> RayJobsBackend:
    """A Ray Jobs backend for a RayCluster's dashboard through the API server's service proxy:
    the Kubernetes bearer in Authorization, Ray's token in X-Ray-Authorization."""
    ns = namespace or api.namespace
    return RayJobsBackend(
        api.proxy_url(ns, head_service(cluster_name), DASHBOARD_PORT),
        headers=api.auth_headers(),
        token=ray_token,
        token_header=RAY_TOKEN_HEADER,
        verify=tls_verify(api),
    )


def tls_verify(api: KubeApi) -> bool | str:
    """The API client's TLS verification as `requests` takes it (CA path, or on/off)."""
    cfg = api.api_client.configuration
    if not getattr(cfg, "verify_ssl", True):
        return False
    return getattr(cfg, "ssl_ca_cert", None) or True


def ray_cluster_manifest(
    spec: dict[str, Any], name: str, namespace: str, *, flow_run_id: str | None = None
) -> dict[str, Any]:
    """A RayCluster manifest around a spec, labelled as ours."""
    _check_cluster_spec(spec)
    return {
        "apiVersion": RAY_CLUSTER.api_version,
        "kind": RAY_CLUSTER.kind,
        "metadata": {"name": name, "namespace": namespace, "labels": managed_labels(flow_run_id)},
        "spec": copy.deepcopy(spec),
    }


def ensure_ray_cluster(
    api: KubeApi,
    manifest_or_spec: dict[str, Any],
    name: str | None = None,
    namespace: str | None = None,
    *,
    flow_run_id: str | None = None,
    recreate: bool = False,
) -> Applied:
    """Create the RayCluster or attach to the one already there (drift is reported, not fixed,
    unless recreate=True). Takes a whole manifest or just its spec (then `name` is required)."""
    ns = namespace or api.namespace
    if manifest_or_spec.get("kind") == RAY_CLUSTER.kind:
        manifest = copy.deepcopy(manifest_or_spec)
        meta = manifest.setdefault("metadata", {})
        if name:
            meta["name"] = name
        meta["namespace"] = ns
        meta["labels"] = {**managed_labels(flow_run_id), **(meta.get("labels") or {})}
    else:
        if not name:
            raise InvalidJobSpec("ensure_ray_cluster: name is required when given a spec")
        manifest = ray_cluster_manifest(manifest_or_spec, name, ns, flow_run_id=flow_run_id)
    cluster_name = manifest["metadata"].get("name", "")
    if not is_dns1123_subdomain(cluster_name, 63):
        raise InvalidJobSpec(
            f"RayCluster name '{cluster_name}' is not a Kubernetes object name: use lowercase "
            "letters, digits and '-', at most 63 characters"
        )
    return apply_or_attach(api, manifest, namespace=ns, recreate=recreate)


def wait_ray_cluster_ready(
    api: KubeApi, name: str, namespace: str | None = None, *, timeout_s: float = 600.0
) -> dict[str, Any]:
    """Block (on a watch) until the RayCluster's state is ready; raise if it fails or goes."""

    def ready(obj: dict[str, Any] | None) -> bool:
        if obj is None:
            raise PrefectNemoError(
                f"RayCluster '{name}' does not exist (or was deleted): create it with "
                "ensure_ray_cluster first"
            )
        status = obj.get("status") or {}
        state = status.get("state")
        if state == "failed":
            why = status.get("reason") or status.get("message") or "see its events"
            raise PrefectNemoError(f"RayCluster '{name}' failed: {why}")
        return state == "ready"

    obj = wait_for(
        api,
        RAY_CLUSTER,
        name,
        ready,
        namespace=namespace,
        timeout_s=timeout_s,
        what=f"RayCluster {name} ready",
    )
    assert obj is not None
    return obj


def delete_ray_cluster(
    api: KubeApi, name: str, namespace: str | None = None, *, wait_s: float | None = 60.0
) -> bool:
    """Delete the RayCluster (foreground: its pods go first); wait until gone unless wait_s is
    None. False when it was already gone."""
    deleted = api.delete(RAY_CLUSTER, name, namespace, propagation="Foreground")
    if deleted and wait_s is not None:
        wait_for(
            api,
            RAY_CLUSTER,
            name,
            lambda obj: obj is None,
            namespace=namespace,
            timeout_s=wait_s,
            what=f"RayCluster {name} deleted",
        )
    return deleted


def resolve_ray_cluster_name(
    api: KubeApi, rayjob_name: str, namespace: str | None = None, *, timeout_s: float = 120.0
) -> str:
    """The RayCluster a RayJob runs on (KubeRay names an inline one `<rayjob>-xxxxx`): waits
    until KubeRay has written status.rayClusterName."""

    def named(obj: dict[str, Any] | None) -> bool:
        if obj is None:
            raise PrefectNemoError(f"RayJob '{rayjob_name}' does not exist (or was deleted)")
        status = obj.get("status") or {}
        if status.get("jobDeploymentStatus") == "ValidationFailed":
            raise PrefectNemoError(
                f"KubeRay rejected RayJob {rayjob_name}: {status.get('message', '')}"
            )
        return bool(status.get("rayClusterName"))

    obj = wait_for(
        api,
        RAY_JOB,
        rayjob_name,
        named,
        namespace=namespace,
        timeout_s=timeout_s,
        what=f"RayJob {rayjob_name} cluster name",
    )
    assert obj is not None
    return str(obj["status"]["rayClusterName"])


__all__ = [
    "KubeRayBackend",
    "RayJobConfig",
    "delete_ray_cluster",
    "ensure_ray_cluster",
    "head_service",
    "ray_cluster_manifest",
    "ray_jobs_backend",
    "rayjob_manifest",
    "resolve_ray_cluster_name",
    "secret_manifest",
    "status_from_rayjob",
    "wait_ray_cluster_ready",
]
