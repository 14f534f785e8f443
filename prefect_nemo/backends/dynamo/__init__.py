"""NVIDIA Dynamo inference graphs (DynamoGraphDeployment, "DGD") on Kubernetes.

DGDs are long-lived inference graphs managed next to training jobs (e.g. the policy server an
RL job samples from), not a Backend: there is no job to submit, wait for and stop, only a graph
to render (`manifests`), apply, wait until it serves, tie to a RayCluster's lifetime and delete
(`graphs`). Built on the shared `kube` helpers; no Prefect import.
"""

from prefect_nemo.backends.dynamo.graphs import (
    FRONTEND_PROBE_PATH,
    GRAPH_LABEL,
    STATE_FAILED,
    STATE_READY,
    DgdCrdMissing,
    DgdFailed,
    DgdNotReady,
    DgdReadiness,
    apply_dgd,
    check_crd_installed,
    delete_dgd,
    dgd_access,
    own_by,
    pod_ready,
    wait_dgd_ready,
    wait_for_dgd_gone,
)
from prefect_nemo.backends.dynamo.manifests import (
    DGD_GROUP,
    DGD_KIND,
    FRONTEND_PORT,
    FRONTEND_TYPE,
    MAIN_CONTAINER,
    VERSIONS,
    check_dgd_name,
    check_frontend_port,
    deep_merge,
    dgd_kind,
    frontend_service,
    frontend_url,
    load_dgd,
    render_dgd,
    resolve_frontend_url,
    validate_dgd,
)

__all__ = [
    "DGD_GROUP", "DGD_KIND", "FRONTEND_PORT", "FRONTEND_PROBE_PATH", "FRONTEND_TYPE",
    "GRAPH_LABEL", "MAIN_CONTAINER", "STATE_FAILED", "STATE_READY", "VERSIONS", "DgdCrdMissing",
    "DgdFailed", "DgdNotReady", "DgdReadiness", "apply_dgd", "check_crd_installed",
    "check_dgd_name", "check_frontend_port", "deep_merge", "delete_dgd", "dgd_access", "dgd_kind",
    "frontend_service", "frontend_url", "load_dgd", "own_by", "pod_ready", "render_dgd",
    "resolve_frontend_url", "validate_dgd", "wait_dgd_ready", "wait_for_dgd_gone",
]  # fmt: skip
