"""A RayCluster's lifecycle on KubeRay (create or attach, wait until ready, delete) and the Ray
Jobs API of a RayCluster through the API server's service proxy. No Prefect import.

KubeRay serves a RayCluster's dashboard (the Ray Jobs API) on its head Service,
``<cluster>-head-svc:8265``; we reach it through the API server's service proxy, which strips
``Authorization``, so Ray's token travels in ``X-Ray-Authorization``.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from prefect_nemo.backends.ray_jobs import RayJobsBackend
from prefect_nemo.errors import InvalidJobSpec, PrefectNemoError
from prefect_nemo.kube import (
    RAY_CLUSTER,
    RAY_JOB,
    Applied,
    KubeApi,
    apply_or_attach,
    managed_labels,
    wait_for,
)
from prefect_nemo.names import check_namespace, is_dns1123_subdomain

DASHBOARD_PORT = 8265
RAY_TOKEN_HEADER = "X-Ray-Authorization"


def check_cluster_spec(spec: Any) -> None:
    """The parts of a RayCluster spec (a block's ray_cluster_spec) we rely on; the API server
    checks the rest."""
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
        _replica_counts(group, f"{where}.workerGroupSpecs[{i}]")
    try:
        json.dumps(spec, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidJobSpec(f"{where}: must be JSON-serializable ({exc})") from None


def _replica_counts(group: dict[str, Any], where: str) -> None:
    """KubeRay refuses a negative minReplicas or maxReplicas, or min > max; a replicas outside
    [minReplicas, maxReplicas] it clamps without a word (GetWorkerGroupDesiredReplicas), so a
    negative one would quietly run minReplicas workers: all refused here."""
    counts: dict[str, int] = {}
    for key in ("replicas", "minReplicas", "maxReplicas"):
        if key not in group:
            continue
        value = group[key]
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidJobSpec(f"{where}.{key}: {value!r} is not a whole number of worker pods")
        if value < 0:
            raise InvalidJobSpec(
                f"{where}.{key}: {value} is negative: give a count of worker pods >= 0"
            )
        counts[key] = value
    low, high = counts.get("minReplicas", 0), counts.get("maxReplicas")
    if high is not None and low > high:
        raise InvalidJobSpec(
            f"{where}: minReplicas {low} is greater than maxReplicas {high}: lower minReplicas "
            "or raise maxReplicas"
        )
    replicas = counts.get("replicas")
    if replicas is not None and (replicas < low or (high is not None and replicas > high)):
        raise InvalidJobSpec(
            f"{where}.replicas: {replicas} is outside [minReplicas {low}, maxReplicas "
            f"{high}]; KubeRay would run {low if replicas < low else high} worker pods "
            "instead: make replicas fit the range"
        )


def _containers(group: dict[str, Any], where: str) -> list[dict[str, Any]]:
    containers = (group.get("template") or {}).get("spec", {}).get("containers")
    if not isinstance(containers, list) or not containers:
        raise InvalidJobSpec(
            f"{where}.template.spec.containers: required, with the Ray container first"
        )
    if not all(isinstance(c, dict) for c in containers):
        raise InvalidJobSpec(f"{where}.template.spec.containers: every entry must be a mapping")
    return containers


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
    check_cluster_spec(spec)
    check_namespace(namespace)
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
