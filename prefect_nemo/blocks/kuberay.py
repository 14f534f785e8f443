"""Block for running jobs as KubeRay RayJobs, on an existing RayCluster or on one per job."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator

from prefect_nemo.backends.kuberay import (
    DASHBOARD_PORT,
    KubeRayBackend,
    RayJobConfig,
    head_service,
    tls_verify,
)
from prefect_nemo.blocks.base import ClusterBlock
from prefect_nemo.blocks.kubernetes import (
    KubernetesCluster,
    KueuePriorityClass,
    KueueQueueName,
    Namespace,
)
from prefect_nemo.blocks.ray_jobs import RayJobsCluster
from prefect_nemo.errors import InvalidJobSpec


class KubeRayCluster(ClusterBlock):
    """Where RayJobs run: a Kubernetes cluster with KubeRay, and which Ray cluster to use."""

    _block_type_name = "KubeRay Cluster"
    _block_type_slug = "kube-ray-cluster"
    _logo_url = "https://docs.ray.io/en/latest/_static/favicon.ico"  # type: ignore[assignment]
    _description = (
        "Runs prefect-nemo jobs as KubeRay RayJobs: on an existing RayCluster (ray_cluster_name) "
        "or on a RayCluster each job brings and KubeRay tears down (ray_cluster_spec)."
    )
    _code_example = """
```python
from prefect import flow
from prefect_nemo import JobSpec, run_job
from prefect_nemo.blocks import KubeRayCluster

cluster = KubeRayCluster.load("BLOCK_NAME")

@flow
def train():
    run_job(JobSpec(entrypoint="python train.py"), cluster=cluster)
```
"""

    kubernetes: KubernetesCluster = Field(
        description="The Kubernetes cluster (credentials, context, namespace) KubeRay runs in.",
    )
    ray_cluster_name: str | None = Field(
        default=None,
        description="Name of an existing RayCluster to run jobs on (RayJob clusterSelector); "
        "set this or ray_cluster_spec.",
    )
    ray_cluster_spec: dict[str, Any] | None = Field(
        default=None,
        description="A RayCluster spec (headGroupSpec, workerGroupSpecs) that each job brings "
        "up for itself (RayJob rayClusterSpec); set this or ray_cluster_name.",
    )
    shutdown_after_job_finishes: bool = Field(
        default=True,
        description="Delete a job's own RayCluster when the job ends (inline ray_cluster_spec "
        "only; turn off to debug a failed cluster, then delete the RayJob yourself).",
    )
    ttl_seconds_after_finished: int = Field(
        default=60,
        ge=0,
        description="Seconds a job's own RayCluster stays up after the job ends (its logs stay "
        "readable meanwhile).",
    )
    submission_mode: Literal["K8sJobMode", "HTTPMode", "SidecarMode"] = Field(
        default="K8sJobMode",
        description="How KubeRay submits the job to Ray: a submitter Kubernetes Job, an HTTP "
        "call from the operator, or a sidecar in the head pod (inline clusters only).",
    )
    active_deadline_seconds: int | None = Field(
        default=None,
        gt=0,
        description="KubeRay's own deadline for the whole RayJob; empty to rely on "
        "JobSpec.timeout_s, which prefect-nemo enforces.",
    )
    keep_failed_head_s: int | None = Field(
        default=None,
        ge=0,
        description="Keep a failed job's Ray head (its logs, its dashboard) this many seconds "
        "while its workers are released at once (RayJob deletionStrategy.deletionRules, "
        "KubeRay >= 1.5); a succeeded job's cluster still goes after "
        "ttl_seconds_after_finished. Empty: every job's cluster goes after "
        "ttl_seconds_after_finished (shutdownAfterJobFinishes).",
    )
    queue_name: KueueQueueName = None
    priority_class: KueuePriorityClass = None
    ray_token: SecretStr | None = Field(
        default=None,
        description="The Ray cluster's auth token (Ray >= 2.59), sent in X-Ray-Authorization "
        "through the API server's service proxy for logs and stop.",
    )
    namespace: Namespace | None = Field(
        default=None,
        description="Namespace of the RayJobs; empty for the Kubernetes block's namespace.",
    )

    @field_validator("ray_token")
    @classmethod
    def _token_ok(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and not value.get_secret_value().strip():
            return None
        return value

    @model_validator(mode="after")
    def _one_cluster(self) -> KubeRayCluster:
        try:
            self._config()  # checks itself
        except InvalidJobSpec as exc:
            raise ValueError(str(exc)) from None
        return self

    def _config(self) -> RayJobConfig:
        return RayJobConfig(
            ray_cluster_name=self.ray_cluster_name,
            ray_cluster_spec=self.ray_cluster_spec,
            shutdown_after_job_finishes=self.shutdown_after_job_finishes,
            ttl_seconds_after_finished=self.ttl_seconds_after_finished,
            submission_mode=self.submission_mode,
            active_deadline_seconds=self.active_deadline_seconds,
            keep_failed_head_s=self.keep_failed_head_s,
            queue_name=self.queue_name,
            priority_class=self.priority_class,
        )

    def target_namespace(self) -> str:
        """Where this block puts everything it creates: `namespace`, else its Kubernetes block's
        (the one answer for every caller: its backend, flows that look its objects up)."""
        return self.namespace or self.kubernetes.namespace

    def backend(self) -> KubeRayBackend:
        """The KubeRay backend for this cluster."""
        api = self.kubernetes.api()
        return KubeRayBackend(
            api,
            self._config(),
            namespace=self.target_namespace(),
            ray_token=self.ray_token.get_secret_value() if self.ray_token else None,
        )


def ray_jobs_block(
    kube_block: KubernetesCluster,
    cluster_name: str,
    ray_token: str | SecretStr | None = None,
    *,
    namespace: str | None = None,
    **overrides: Any,
) -> RayJobsCluster:
    """A RayJobsCluster block for a RayCluster's dashboard through the API server's service
    proxy, so run_job runs plain Ray jobs on a KubeRay cluster unchanged.

    The Kubernetes bearer token travels in `headers` (a secret field) and Ray's token in
    X-Ray-Authorization (the proxy strips Authorization before it reaches Ray).
    """
    api = kube_block.api()
    token = ray_token.get_secret_value() if isinstance(ray_token, SecretStr) else ray_token
    url = api.proxy_url(namespace or api.namespace, head_service(cluster_name), DASHBOARD_PORT)
    headers = api.auth_headers()
    if not headers and getattr(api.api_client.configuration, "cert_file", None):
        raise InvalidJobSpec(
            "ray_jobs_block: this kubeconfig authenticates with a client certificate, which the "
            "Ray Jobs client cannot present: use a kubeconfig with a bearer token"
        )
    return RayJobsCluster(
        dashboard_url=url,
        auth_token=token,
        token_header="X-Ray-Authorization",
        headers=headers or None,
        verify_tls=tls_verify(api),
        **overrides,
    )
