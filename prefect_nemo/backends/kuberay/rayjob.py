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

The state mapping and a failed RayJob's class are `status.py`'s (pure).

Logs and stop go to the Ray Jobs API of the job's cluster through the API server's service
proxy (`raycluster.ray_jobs_backend`). Secret env values (SecretStr in JobSpec.env) never go into
the RayJob: with an inline cluster they go into a Secret we own and the head and worker
containers read it with ``envFrom``; with an existing cluster they are refused.

Local code (JobSpec.working_dir): on an existing cluster we upload it to the cluster's GCS with
Ray's own uploader (through the proxy) and the RayJob names the gcs:// package; an inline
cluster does not exist yet at submit, so the code goes into ConfigMaps we own, unpacked by an
init container of the K8sJobMode submitter pod, whose `ray job submit` uploads it
(`manifests.submitter_template`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import AsyncGenerator
from typing import Any, ClassVar

from prefect_nemo.backends._kube_job import KubeJobBackend
from prefect_nemo.backends._kube_objects import code_plan
from prefect_nemo.backends.kuberay.manifests import (
    MAX_RAYJOB_NAME,
    RayJobConfig,
    check_job_id,
    check_spec,
    rayjob_documents,
    rayjob_manifest,
)
from prefect_nemo.backends.kuberay.raycluster import DASHBOARD_PORT, head_service, ray_jobs_backend
from prefect_nemo.backends.kuberay.status import (
    SUBMISSION_FAILED,
    ray_target,
    rayjob_failure,
    status_from_rayjob,
    submission_failed_after_ray_took_it,
)
from prefect_nemo.backends.ray_jobs import RayJobsBackend
from prefect_nemo.errors import AuthenticationFailed, BackendUnavailable, InvalidJobSpec
from prefect_nemo.jobs import (
    Failure,
    JobHandle,
    JobSpec,
    JobState,
    JobStatus,
    refuse_launcher,
)
from prefect_nemo.kube import (
    CONFIGMAP,
    POD,
    RAY_CLUSTER,
    RAY_JOB,
    SECRET,
    SERVICE,
    Access,
    KubeApi,
    KubeError,
)
from prefect_nemo.packaging import TransportPlan, collect_source, stage_source

log = logging.getLogger(__name__)

STOP_ESCALATE_S = 10.0  # a Ray stop not confirmed by then is escalated to deleting the RayJob

# the Job controller's label on its pods (KubeRay names the K8sJobMode submitter Job after the
# RayJob: common.RayJobK8sJobNamespacedName)
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"


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
    block = "KubeRayCluster"
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
        """The RayJob's status (`status.status_from_rayjob`); pods are not read."""
        return status_from_rayjob(obj)

    def failure_pods(self, obj: dict[str, Any], pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """A FAILED RayJob's pods, listed once: its RayCluster's (head and workers) and its
        K8sJobMode submitter Job's (the informers do not watch pods for RayJobs)."""
        name = (obj.get("metadata") or {}).get("name", "")
        selectors = [f"{JOB_NAME_LABEL}={name}"]
        if cluster := (obj.get("status") or {}).get("rayClusterName"):
            selectors.append(f"ray.io/cluster={cluster}")
        found: list[dict[str, Any]] = []
        for selector in selectors:
            found += self.api.list(POD, self.namespace, label_selector=selector)[0]
        return found

    def object_failure(self, obj: dict[str, Any]) -> Failure | None:
        """The class its status.reason says (ValidationFailed, the deadlines, SubmissionFailed
        with its submitter's last log line), else None."""
        said = ""
        if (obj.get("status") or {}).get("reason") == SUBMISSION_FAILED:
            lines = self.submitter_log((obj.get("metadata") or {}).get("name", "")).splitlines()
            said = next((line.strip() for line in reversed(lines) if line.strip()), "")
        return rayjob_failure(
            obj, submitter_said=said, ends_with_it=self.config.cluster_ends_with_each_job
        )

    def stop_left_running(self, obj: dict[str, Any]) -> None:
        """Stop the Ray job of a submission that failed while Ray ran it, on a cluster that
        stays (an existing RayCluster, a kept failed head): KubeRay leaves it running, with
        nobody to stop it ("RayJob is using an existing RayCluster via clusterSelector;
        skipping resource deletion", rayjob_controller.go), and we report the job FAILED.
        Best effort, once: an unreachable head is logged, not raised (the status stands)."""
        target = ray_target(obj)
        stays = not self.config.cluster_ends_with_each_job
        if target is None or not (stays and submission_failed_after_ray_took_it(obj)):
            return
        try:
            self._ray(target[0]).request_stop(target[1])
        except (BackendUnavailable, AuthenticationFailed, RuntimeError) as exc:
            log.warning(
                "the RayJob %s failed its submission while Ray ran its job %s on %s; stopping "
                "that job failed (%s): stop it with `ray job stop %s`",
                obj["metadata"].get("name"), target[1], target[0], type(exc).__name__, target[1],
            )  # fmt: skip

    def submitter_log(self, job_id: str) -> str:
        """The log of the RayJob's newest K8sJobMode submitter pod ("" if none can be read):
        `ray job submit`, then `ray job logs --follow` (KubeRay's quick start reads a job's
        output there: `kubectl logs -l=job-name=<rayjob>`)."""
        try:
            pods, _ = self.api.list(
                POD, self.namespace, label_selector=f"{JOB_NAME_LABEL}={job_id}"
            )
            if not pods:
                return ""
            pod = max(pods, key=lambda p: p["metadata"].get("creationTimestamp") or "")
            containers = (pod.get("spec") or {}).get("containers") or [{}]
            return self.api.pod_log(
                pod["metadata"]["name"], self.namespace, container=containers[0].get("name")
            )
        except (KubeError, AuthenticationFailed, BackendUnavailable):
            return ""

    def access(self) -> tuple[Access, ...]:
        """In the RayJobs' namespace: the RayJobs, their RayClusters (read), the Secret of
        secret env values, the ConfigMaps of an inline cluster's working_dir, the pods and
        their logs, and the head Service's proxy (Ray's Jobs API: logs, stop, working_dir
        upload); with a Kueue queue, its Workloads and LocalQueue (read)."""
        return (*self._access(), *self.kueue_access())

    def _access(self) -> tuple[Access, ...]:
        return (
            Access(RAY_JOB, ("get", "list", "watch", "create", "delete", "patch")),
            Access(RAY_CLUSTER, ("get", "list", "watch")),
            Access(SECRET, ("get", "create", "delete", "patch")),
            Access(CONFIGMAP, ("get", "create", "delete", "patch")),
            Access(POD, ("get", "list", "watch")),
            Access(POD, ("get",), subresource="log"),
            Access(SERVICE, ("get", "create"), subresource="proxy"),
        )

    def ray_api(self, cluster_name: str) -> RayJobsBackend:
        """The Ray Jobs API of one of its RayClusters, through the API server's service proxy
        (logs and stop go this way; `prefect-nemo doctor` asks it for Ray's version)."""
        return self._ray(cluster_name)

    # -- Backend protocol -----------------------------------------------------------------------

    def validate(self, spec: JobSpec) -> None:
        """Everything we can check without the API server (names, sizes, secrets, code)."""
        refuse_launcher(spec, self.kind)
        check_spec(spec, self.config)
        # a dry build with the longest name catches sizes (annotations, the ~1 MB object limit,
        # the code archive over what ConfigMaps may carry)
        longest = "j" * MAX_RAYJOB_NAME
        rayjob_manifest(
            spec, longest, {}, self.config, namespace=self.namespace,
            plan=self._plan(spec, longest),
        )  # fmt: skip

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
        """Create the RayJob (and its Secret and code ConfigMaps, which it then owns);
        JobAlreadyExists if the name is taken."""
        check_job_id(job_id)
        check_spec(spec, self.config)
        plan = self._plan(spec, job_id)
        if self.kueue_target(spec) is not None:
            self.use_kueue()
        uri = self._working_dir_uri(spec, upload=True) if self._uploads(spec) else None
        manifest, owned = rayjob_documents(
            spec, job_id, metadata, self.config, namespace=self.namespace, working_dir_uri=uri,
            plan=plan,
        )  # fmt: skip
        fix = "Check KubeRayCluster.ray_cluster_spec and the JobSpec fields it names"
        try:
            self.create_job(manifest, owned, fix=fix)
        except InvalidJobSpec as exc:
            # an operator older than 1.5: its CRD has no deletionRules, and our strict write
            # is refused as an unknown field
            if "deletionStrategy" in manifest["spec"] and "deletion" in str(exc):
                raise InvalidJobSpec(
                    "KubeRayCluster.keep_failed_head_s needs KubeRay >= 1.5 (RayJob "
                    "spec.deletionStrategy.deletionRules), and this cluster's RayJob CRD does "
                    f"not have it ({exc}): upgrade the KubeRay operator, or unset "
                    "keep_failed_head_s"
                ) from None
            raise
        return self.handle(job_id)

    def render(self, spec: JobSpec, job_id: str, metadata: dict[str, str]) -> list[dict[str, Any]]:
        """What `submit` sends, in its order (the Secret, the code ConfigMaps, then the RayJob),
        without a request: on an existing cluster working_dir gets the gcs:// URI Ray's
        uploader would give the staged code."""
        check_job_id(job_id)
        check_spec(spec, self.config)
        plan = self._plan(spec, job_id)
        uri = self._working_dir_uri(spec, upload=False) if self._uploads(spec) else None
        manifest, owned = rayjob_documents(
            spec, job_id, metadata, self.config, namespace=self.namespace, working_dir_uri=uri,
            plan=plan,
        )  # fmt: skip
        return [obj for _, obj in owned] + [manifest]

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
        # a suspended job (queued in Kueue, or preempted) has no cluster to ask: delete it,
        # its Workload goes with it (owned), so nothing of it is left in the queue
        suspended = (obj.get("spec") or {}).get("suspend") is True
        submitted = bool(ray_job_id and cluster and status.get("jobStatus")) and not suspended
        # deletionRules match SUCCEEDED and FAILED only: a job stopped in Ray would keep its
        # cluster for good, so with keep_failed_head_s a stop deletes the RayJob
        submitted = submitted and self.config.keep_failed_head_s is None
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
        """The job's whole log from Ray (through the proxy); None before KubeRay submitted it.
        A failed submission that left Ray nothing to tell: its submitter pod's log."""
        obj = self.api.get(RAY_JOB, job_id, self.namespace)
        target = ray_target(obj)
        log = None if target is None else self._ray(target[0]).logs(target[1])
        if not log and ((obj or {}).get("status") or {}).get("reason") == SUBMISSION_FAILED:
            return self.submitter_log(job_id) or log
        return log

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
        streamed = self.memory.stream_log((self.cluster, job_id))
        async for chunk in self._ray(target[0]).tail_logs(target[1]):
            streamed.add(chunk)
            yield chunk

    # -- helpers ----------------------------------------------------------------------------------

    def _ray_target(self, job_id: str) -> tuple[str, str] | None:
        """(RayCluster name, Ray submission id) once KubeRay has submitted the job."""
        return ray_target(self.api.get(RAY_JOB, job_id, self.namespace))

    def _ray(self, cluster_name: str) -> RayJobsBackend:
        """The Ray Jobs API of a RayCluster, through the API server's service proxy."""
        return ray_jobs_backend(self.api, cluster_name, self.namespace, ray_token=self._ray_token)

    def _uploads(self, spec: JobSpec) -> bool:
        """working_dir goes to an existing cluster's GCS from here (not in ConfigMaps)."""
        return spec.working_dir is not None and not self.config.inline

    def _plan(self, spec: JobSpec, job_id: str) -> TransportPlan | None:
        """The ConfigMaps of working_dir for an inline cluster (None otherwise); sizes are
        checked here, before anything is sent (TransportTooLarge)."""
        if spec.working_dir is None or not self.config.inline:
            return None
        return code_plan(spec, job_id)

    def _working_dir_uri(self, spec: JobSpec, *, upload: bool) -> str:
        """Package working_dir; with `upload`, put it in the target cluster's GCS with Ray's own
        uploader (through the proxy). Returns the gcs:// URI (named by the package's content
        hash) for runtimeEnvYAML."""
        from ray._private.runtime_env.working_dir import upload_working_dir_if_needed

        assert spec.working_dir is not None and self.config.ray_cluster_name
        tree = collect_source(spec.working_dir, exclude=spec.exclude)
        runtime_env: dict[str, Any] = {"working_dir": str(stage_source(tree))}
        if upload:
            ray = self._ray(self.config.ray_cluster_name)
            ray._call(lambda: ray.client._upload_working_dir_if_needed(runtime_env))
        else:  # the same URI, computed without the cluster (Ray's gitignore rule included)
            gitignore = os.environ.get("RAY_RUNTIME_ENV_IGNORE_GITIGNORE", "0") != "1"
            upload_working_dir_if_needed(
                runtime_env, include_gitignore=gitignore, upload_fn=lambda *a, **k: None
            )
        return str(runtime_env["working_dir"])
