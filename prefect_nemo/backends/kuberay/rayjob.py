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

Logs and stop go to the Ray Jobs API of the job's cluster through the API server's service
proxy (`raycluster.ray_jobs_backend`). Secret env values (SecretStr in JobSpec.env) never go into
the RayJob: with an inline cluster they go into a Secret we own and the head and worker
containers read it with ``envFrom``; with an existing cluster they are refused.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
import threading
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import yaml
from pydantic import SecretStr

from prefect_nemo.backends._kube_job import KubeJobBackend
from prefect_nemo.backends._kube_objects import (
    check_labels,
    flow_run_of,
    job_object,
    parse_time,
    reserved_metadata,
    secret_manifest,
    secret_name,
)
from prefect_nemo.backends.kuberay.raycluster import (
    DASHBOARD_PORT,
    check_cluster_spec,
    head_service,
    ray_jobs_backend,
)
from prefect_nemo.backends.ray_jobs import OVERRIDE_RUNTIME_ENV, RayJobsBackend
from prefect_nemo.errors import BackendUnavailable, InvalidJobSpec
from prefect_nemo.jobs import JobHandle, JobSpec, JobState, JobStatus
from prefect_nemo.kube import RAY_CLUSTER, RAY_JOB, SECRET, KubeApi
from prefect_nemo.names import is_dns1035_label, is_dns1123_subdomain
from prefect_nemo.packaging import collect_source, stage_source
from prefect_nemo.placement.spec import to_ray_entrypoint

SubmissionMode = Literal["K8sJobMode", "HTTPMode", "SidecarMode"]
SUBMISSION_MODES: tuple[str, ...] = ("K8sJobMode", "HTTPMode", "SidecarMode")
MAX_RAYJOB_NAME = 47  # KubeRay's MaxRayJobNameLength
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
        check_cluster_spec(config.ray_cluster_spec)


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
    runtime_env: dict[str, Any] = dict(spec.runtime_env)
    plain = {k: v for k, v in spec.env.items() if isinstance(v, str)}  # secrets: the Secret
    runtime_env["env_vars"] = {**plain, **OVERRIDE_RUNTIME_ENV}
    if working_dir_uri is not None:
        runtime_env["working_dir"] = working_dir_uri
    body: dict[str, Any] = {
        "entrypoint": spec.entrypoint,
        "jobId": job_id,
        "metadata": {**spec.metadata, **metadata},
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
    return job_object(
        RAY_JOB, job_id, spec, metadata, body, namespace=namespace,
        owned={"secrets": [secret_name(job_id)]} if spec.secret_values() else None,
        shrink="JobSpec.entrypoint/env/runtime_env/metadata or ray_cluster_spec",
    )  # fmt: skip


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
    metadata = reserved_metadata(meta.get("annotations") or {})
    metadata.update({str(k): str(v) for k, v in spec_meta.items()})
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
# The backend

_stops: dict[tuple[str, str], float] = {}  # (cluster, job id) -> when we first asked it to stop
_stops_lock = threading.Lock()


class KubeRayBackend(KubeJobBackend[RayJobConfig]):
    """Run jobs as KubeRay RayJobs: submit, watch (informers), stop through Ray, logs."""

    kind: ClassVar[str] = "kuberay"
    max_job_id_len: ClassVar[int] = MAX_RAYJOB_NAME
    job_kind = RAY_JOB
    crd_fix = "install the KubeRay operator (its CRDs) in the cluster"
    deleted_message = "stopped by deleting its RayJob (and the RayCluster it brought up)"
    log_errors = (BackendUnavailable, RuntimeError)

    def __init__(
        self,
        api: KubeApi,
        config: RayJobConfig,
        *,
        namespace: str | None = None,
        ray_token: str | None = None,
    ) -> None:
        super().__init__(api, config, namespace=namespace)
        self._ray_token = ray_token

    @property
    def secrets(self) -> list[str]:
        """The API credentials and the Ray token, for redaction."""
        return [s for s in [*self.api.secrets, self._ray_token] if s]

    def links(self, job_id: str) -> dict[str, str]:
        """The RayJob's API path and, on an existing cluster, its dashboard.

        An inline cluster's name gets a random suffix from KubeRay, so its dashboard link is
        known only later (resolve_ray_cluster_name).
        """
        links = super().links(job_id)
        if self.config.ray_cluster_name:
            base = self.api.proxy_url(
                self.namespace, head_service(self.config.ray_cluster_name), DASHBOARD_PORT
            )
            links["dashboard"] = f"{base}/#/jobs/{job_id}"
        return links

    def job_status(self, obj: dict[str, Any], pods: list[dict[str, Any]]) -> JobStatus:
        """The RayJob's status (the table in the module docstring); pods are not read."""
        return status_from_rayjob(obj)

    # -- Backend protocol -----------------------------------------------------------------------

    def validate(self, spec: JobSpec) -> None:
        """Everything we can check without the API server (names, sizes, secrets, code)."""
        check_spec(spec, self.config)
        # a dry build with the longest name catches sizes (annotations, the ~1 MB object limit)
        rayjob_manifest(spec, "j" * MAX_RAYJOB_NAME, {}, self.config, namespace=self.namespace)

    def check_access(self) -> None:
        """Reach the API server, prove we may list RayJobs (KubeRay installed), and that the
        target RayCluster exists when we run on an existing one."""
        super().check_access()
        name = self.config.ray_cluster_name
        if name and self.api.get(RAY_CLUSTER, name, self.namespace) is None:
            raise InvalidJobSpec(
                f"KubeRayCluster.ray_cluster_name: no RayCluster '{name}' in namespace "
                f"'{self.namespace}': create it (ensure_ray_cluster) or fix the name"
            )

    def submit(self, spec: JobSpec, job_id: str, metadata: dict[str, str]) -> JobHandle:
        """Create the RayJob (and its Secret); JobAlreadyExists if the name is taken."""
        check_job_id(job_id)
        check_spec(spec, self.config)
        uri = self._upload_working_dir(spec) if spec.working_dir is not None else None
        manifest = rayjob_manifest(
            spec, job_id, metadata, self.config, namespace=self.namespace, working_dir_uri=uri
        )
        secret = secret_manifest(
            spec, job_id, namespace=self.namespace, flow_run_id=flow_run_of(metadata)
        )
        owned = [(SECRET, secret)] if secret is not None else []
        fix = "Check KubeRayCluster.ray_cluster_spec and the JobSpec fields it names"
        self.create_job(manifest, owned, fix=fix)
        return self.handle(job_id)

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
        with _stops_lock:
            first_stop = _stops.setdefault((self.cluster, job_id), time.monotonic())
        patient = time.monotonic() - first_stop < STOP_ESCALATE_S
        if submitted and patient and not (obj.get("metadata") or {}).get("deletionTimestamp"):
            try:
                self._ray(str(cluster)).request_stop(str(ray_job_id))
                return
            except BackendUnavailable:
                pass  # the head is unreachable: deleting the RayJob is the sure way
        self.delete_to_stop(job_id)

    def read_log(self, job_id: str) -> str | None:
        """The job's whole log from Ray (through the proxy); None before KubeRay submitted it."""
        target = self._ray_target(job_id)
        return None if target is None else self._ray(target[0]).logs(target[1])

    async def tail_logs(self, job_id: str) -> AsyncGenerator[str, None]:
        """Stream the log through the proxy once the job runs; ends when the job ends."""
        while True:
            status = await asyncio.to_thread(self.current_status, job_id)
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
            self.memory.remember_log(key, seen)
            yield chunk

    # -- helpers ----------------------------------------------------------------------------------

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

    def _upload_working_dir(self, spec: JobSpec) -> str:
        """Package working_dir and upload it to the target cluster's GCS with Ray's own
        uploader (through the proxy); returns the gcs:// URI for runtimeEnvYAML."""
        assert spec.working_dir is not None and self.config.ray_cluster_name
        tree = collect_source(spec.working_dir, exclude=spec.exclude)
        runtime_env: dict[str, Any] = {"working_dir": str(stage_source(tree))}
        ray = self._ray(self.config.ray_cluster_name)
        ray._call(lambda: ray.client._upload_working_dir_if_needed(runtime_env))
        return str(runtime_env["working_dir"])
