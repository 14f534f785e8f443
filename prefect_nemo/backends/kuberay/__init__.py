"""The KubeRay backend: jobs as RayJobs (`rayjob`, their status read by `status`), and
RayClusters with the Ray Jobs API behind their head Service (`raycluster`). No Prefect import."""

from prefect_nemo.backends._kube_objects import secret_manifest
from prefect_nemo.backends.kuberay.manifests import (
    MAX_RAYJOB_NAME,
    SUBMISSION_MODES,
    RayJobConfig,
    check_config,
    check_job_id,
    check_spec,
    rayjob_documents,
    rayjob_manifest,
)
from prefect_nemo.backends.kuberay.raycluster import (
    DASHBOARD_PORT,
    RAY_TOKEN_HEADER,
    delete_ray_cluster,
    ensure_ray_cluster,
    head_service,
    ray_cluster_manifest,
    ray_jobs_backend,
    resolve_ray_cluster_name,
    tls_verify,
    wait_ray_cluster_ready,
)
from prefect_nemo.backends.kuberay.rayjob import STOP_ESCALATE_S, KubeRayBackend
from prefect_nemo.backends.kuberay.status import status_from_rayjob
from prefect_nemo.names import label_value

__all__ = [
    "DASHBOARD_PORT", "MAX_RAYJOB_NAME", "RAY_TOKEN_HEADER", "STOP_ESCALATE_S", "SUBMISSION_MODES",
    "KubeRayBackend", "RayJobConfig", "check_config", "check_job_id", "check_spec",
    "delete_ray_cluster", "ensure_ray_cluster", "head_service", "label_value",
    "ray_cluster_manifest", "ray_jobs_backend", "rayjob_documents", "rayjob_manifest",
    "resolve_ray_cluster_name",
    "secret_manifest", "status_from_rayjob", "tls_verify", "wait_ray_cluster_ready",
]  # fmt: skip
