"""The Kubernetes checks of `prefect-nemo doctor`, asked of the API server with the official
client: the credentials (SelfSubjectReview), the namespace, each CRD the backend's kinds need
and the versions it serves (ApiextensionsV1Api, else API discovery), and every verb of the
backend's `access()` (SelfSubjectAccessReview, the API server's own RBAC answer). No Prefect.

The order is the order of trouble: a row needs the ones above it. A block with a Kueue queue
gets CRD rows for Kueue's kinds and RBAC rows for them (its `access()`), then, after those, a
row for its LocalQueue itself (`job_checks`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from prefect_nemo.backends._kueue import KUEUE_FIX, LOCAL_QUEUE, WORKLOAD
from prefect_nemo.backends.dynamo import VERSIONS, dgd_access, dgd_kind
from prefect_nemo.doctor.checks import Check, Status, ok
from prefect_nemo.doctor.ray import ray_checks
from prefect_nemo.errors import PrefectNemoError
from prefect_nemo.kube import NAMESPACE, RAY_CLUSTER, Access, Kind, KubeApi

_TRANSPORT = (urllib3.exceptions.HTTPError, OSError)


@dataclass(frozen=True)
class _Who:
    """The credentials row, and the user the API server knows us as (None: not told)."""

    check: Check
    user: str | None = None


def job_checks(backend: Any) -> list[Check]:
    """A Kubernetes job backend (KubeRay, Kubeflow Trainer): the kube checks of its kinds and
    verbs; for KubeRay on an existing RayCluster, that cluster and its Ray dashboard."""
    rows = kube_checks(backend.api, backend.namespace, backend.access(), crd_fix=backend.crd_fix)
    name = getattr(backend.config, "ray_cluster_name", None)
    if name and not any(r.status is Status.FAIL for r in rows):
        rows += _ray_cluster(backend, name)
    queue = getattr(backend.config, "queue_name", None)
    if queue and not any(r.status is Status.FAIL for r in rows):
        rows.append(_local_queue(backend, queue))
    return rows


def cluster_checks(api: KubeApi, namespace: str) -> list[Check]:
    """A KubernetesCluster block alone: its credentials and namespace, and Dynamo's
    DynamoGraphDeployments for deploy_dgd (a warning only: the block serves other kinds too)."""
    who = _credentials(api)
    if who.check.status is Status.FAIL:
        return [who.check]
    rows = [who.check, *_namespace(api, namespace)]
    dynamo = "deploy_dgd (Dynamo inference graphs)"
    fix = "install the Dynamo platform (dynamo-crds and dynamo-platform Helm charts)"
    crd, served = _crd(api, dgd_kind(VERSIONS[0]), fix, accept=VERSIONS, optional=dynamo)
    rows.append(crd)
    # the verbs at the version the operator serves (deploy_dgd's version=)
    if version := next((v for v in VERSIONS if v in served), None):
        rows += _rbac(api, namespace, dgd_access(version), who.user, optional=dynamo)
    return rows


def kube_checks(
    api: KubeApi, namespace: str, access: Sequence[Access], *, crd_fix: str
) -> list[Check]:
    """Credentials, namespace, CRDs and RBAC for a backend's `access()`."""
    who = _credentials(api)
    if who.check.status is Status.FAIL:
        return [who.check]
    rows = [who.check, *_namespace(api, namespace)]
    seen: set[str] = set()
    for kind in (a.kind for a in access):
        if kind.crd and kind.crd not in seen:
            seen.add(kind.crd)
            rows.append(_crd(api, kind, KUEUE_FIX if kind.group == WORKLOAD.group else crd_fix)[0])
    return rows + _rbac(api, namespace, access, who.user)


def _local_queue(backend: Any, name: str) -> Check:
    """The block's Kueue LocalQueue exists in its namespace (jobs sent to a missing one wait
    for ever: Kueue never admits them)."""
    row = f"kueue localqueue {name}"
    try:
        found = backend.api.get(LOCAL_QUEUE, name, backend.namespace)
    except PrefectNemoError as exc:
        return Check(row, Status.FAIL, f"reading it failed: {exc}", "check the RBAC rows above")
    if found is None:
        return Check(
            row, Status.FAIL,
            f"no LocalQueue '{name}' in namespace '{backend.namespace}': Kueue would never "
            "admit the block's jobs",
            "create the LocalQueue (spec.clusterQueue: a ClusterQueue with quota) or fix "
            "queue_name",
        )  # fmt: skip
    cluster_queue = (found.get("spec") or {}).get("clusterQueue", "?")
    return ok(row, f"in namespace '{backend.namespace}', ClusterQueue '{cluster_queue}'")


# -- credentials and namespace --------------------------------------------------------------------


def _credentials(api: KubeApi) -> _Who:
    """Reach the API server and learn who it takes us for (SelfSubjectReview, Kubernetes
    1.28+; an older server still proves the credentials in the RBAC rows)."""
    name, timeout = "kubernetes credentials", api.request_timeout_s
    try:
        version = client.VersionApi(api.api_client).get_code(_request_timeout=timeout).git_version
        review = client.AuthenticationV1Api(api.api_client).create_self_subject_review(
            {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"},
            _request_timeout=timeout,
        )
    except ApiException as exc:
        if exc.status == 401:
            return _Who(
                Check(
                    name,
                    Status.FAIL,
                    f"the API server at {api.host} rejected the credentials (401)",
                    f"fix the token or client certificate in {api.credentials}",
                )
            )
        if exc.status not in (403, 404):  # 404: no SelfSubjectReview; 403: not allowed it
            return _Who(
                Check(
                    name,
                    Status.FAIL,
                    f"{api.host} answered {exc.status} {exc.reason}",
                    "check the API server's health",
                )
            )
        return _Who(
            ok(
                name,
                f"the API server at {api.host} takes the credentials (it does not "
                "say as whom: no SelfSubjectReview)",
            )
        )
    except _TRANSPORT as exc:
        return _Who(
            Check(
                name,
                Status.FAIL,
                f"cannot reach the Kubernetes API at {api.host}: {exc}",
                f"check the server address in {api.credentials} and that this machine reaches it",
            )
        )
    user = review.status.user_info.username if review.status and review.status.user_info else None
    return _Who(ok(name, f"kube-apiserver {version} at {api.host}, as {user}"), user)


def _namespace(api: KubeApi, namespace: str) -> list[Check]:
    """The namespace exists (no row when the account may not read Namespace objects, as a
    namespaced account may not)."""
    try:
        found = api.get(NAMESPACE, namespace)
    except PrefectNemoError:  # 403 for most namespaced accounts
        return []
    if found is None:
        return [
            Check(
                f"namespace {namespace}",
                Status.FAIL,
                f"namespace '{namespace}' does not exist",
                f"create it (kubectl create namespace {namespace}) or fix the block's namespace",
            )
        ]
    return [ok(f"namespace {namespace}", "exists")]


# -- CRDs -----------------------------------------------------------------------------------------


def _crd(
    api: KubeApi,
    kind: Kind,
    fix: str,
    *,
    accept: Sequence[str] = (),
    optional: str = "",
) -> tuple[Check, list[str]]:
    """The CRD of `kind`: installed, Established, serving kind.version (or one of `accept`).
    Read from the CRD itself, else (no right to read CRDs, as most namespaced accounts) from
    API discovery, which every authenticated user may read. Returns the row and the versions
    served."""
    assert kind.crd is not None
    name, versions = f"crd {kind.crd}", list(accept or (kind.version,))
    missing = Status.WARN if optional else Status.FAIL
    needed = f" (needed only by {optional})" if optional else ""
    try:
        served, storage, established = _read_crd(api, kind.crd)
        source = ""
    except ApiException as exc:
        if exc.status != 403:
            return Check(
                name,
                Status.FAIL,
                f"reading the CRD answered {exc.status} {exc.reason}",
                "check the API server's health",
            ), []
        served, storage, established = _discovered(api, kind), None, True
        source = " (from API discovery: this account may not read CRDs)"
    except _TRANSPORT as exc:
        return Check(name, Status.FAIL, f"cannot reach {api.host}: {exc}", "check the network"), []
    if not served:
        return Check(
            name,
            missing,
            f"not installed: the API server does not serve {kind.plural}.{kind.group}{needed}",
            fix,
        ), []
    if not any(v in served for v in versions):
        return Check(
            name,
            missing,
            f"served at {', '.join(served)} only; prefect-nemo uses {kind.group}/"
            f"{' or '.join(versions)}{needed}{source}",
            f"{fix}: a release that serves {kind.group}/{versions[0]}",
        ), served
    if not established:
        return Check(
            name,
            Status.FAIL,
            "installed but not Established",
            f"kubectl describe crd {kind.crd} says why (a name conflict?)",
        ), served
    where = f"; storage {storage}" if storage else ""
    return ok(name, f"served: {', '.join(served)}{where}{source}"), served


def _read_crd(api: KubeApi, crd: str) -> tuple[list[str], str | None, bool]:
    """(served versions, storage version, Established) of a CRD; a missing one serves none."""
    ext = client.ApiextensionsV1Api(api.api_client)
    try:
        # raw: the client would build model objects for every node of a large schema
        response = ext.read_custom_resource_definition(
            crd, _preload_content=False, _request_timeout=api.request_timeout_s
        )
    except ApiException as exc:
        if exc.status == 404:
            return [], None, False
        raise
    body = json.loads(response.data)
    versions = (body.get("spec") or {}).get("versions") or []
    served = [v["name"] for v in versions if v.get("served")]
    storage = next((v["name"] for v in versions if v.get("storage")), None)
    conditions = (body.get("status") or {}).get("conditions") or []
    established = any(
        c.get("type") == "Established" and c.get("status") == "True" for c in conditions
    )
    return served, storage, established


def _discovered(api: KubeApi, kind: Kind) -> list[str]:
    """The versions of kind's group whose discovery lists kind's plural."""
    timeout = api.request_timeout_s
    groups = client.ApisApi(api.api_client).get_api_versions(_request_timeout=timeout).groups
    group = next((g for g in groups or [] if g.name == kind.group), None)
    served = []
    for version in group.versions if group else []:
        resources = client.CustomObjectsApi(api.api_client).get_api_resources(
            kind.group, version.version, _request_timeout=timeout
        )
        if any(r.name == kind.plural for r in resources.resources or []):
            served.append(version.version)
    return served


# -- RBAC -----------------------------------------------------------------------------------------


def _rbac(
    api: KubeApi,
    namespace: str,
    access: Sequence[Access],
    user: str | None,
    *,
    optional: str = "",
) -> list[Check]:
    """One row per resource: every verb asked with a SelfSubjectAccessReview; a denied one
    names the verbs, the resource and the rule to add."""
    authz = client.AuthorizationV1Api(api.api_client)
    account = user or f"the account of {api.credentials}"
    rows: list[Check] = []
    for need in access:
        group = need.kind.group
        name = f"rbac {need.resource}" + (f".{group}" if group else "")
        name += " (all namespaces)" if need.all_namespaces else ""
        denied = []
        for verb in need.verbs:
            attributes = {
                "namespace": "" if need.cluster_wide else namespace,
                "verb": verb,
                "group": group,
                "resource": need.kind.plural,
                "subresource": need.subresource,
            }
            try:
                review = authz.create_self_subject_access_review(
                    {
                        "apiVersion": "authorization.k8s.io/v1",
                        "kind": "SelfSubjectAccessReview",
                        "spec": {"resourceAttributes": attributes},
                    },
                    _request_timeout=api.request_timeout_s,
                )
            except ApiException as exc:
                return [
                    *rows,
                    Check(
                        "rbac",
                        Status.WARN,
                        f"not checked: the API server answered "
                        f"{exc.status} to a SelfSubjectAccessReview",
                        "the job's own requests will tell (403 names the verb)",
                    ),
                ]
            except _TRANSPORT as exc:
                return [
                    *rows,
                    Check(
                        "rbac", Status.FAIL, f"cannot reach {api.host}: {exc}", "check the network"
                    ),
                ]
            if not (review.status and review.status.allowed):
                denied.append(verb)
        where = (
            "in every namespace"
            if need.all_namespaces
            else "cluster-wide"
            if not need.kind.namespaced
            else f"in namespace {namespace}"
        )
        if not denied:
            rows.append(ok(name, f"{', '.join(need.verbs)} {where}"))
            continue
        why = need.optional or optional
        role = "ClusterRole" if need.cluster_wide else f"Role in namespace {namespace}"
        rule = json.dumps(need.rule(tuple(denied)), separators=(", ", ": "))
        rows.append(
            Check(
                name,
                Status.WARN if why else Status.FAIL,
                f"{account} may not {', '.join(denied)} {need.resource} (API group "
                f"'{group}') {where}" + (f"; needed by {why}" if why else ""),
                f"add to a {role} bound to {account} the rule {rule}",
            )
        )
    return rows


# -- KubeRay on an existing RayCluster ------------------------------------------------------------


def _ray_cluster(backend: Any, name: str) -> list[Check]:
    """The RayCluster jobs run on exists, and its Ray dashboard answers through the service
    proxy (logs, stop and code upload go that way)."""
    row = f"raycluster {name}"
    try:
        obj = backend.api.get(RAY_CLUSTER, name, backend.namespace)
    except PrefectNemoError as exc:
        return [Check(row, Status.FAIL, str(exc), "see the rbac rows above")]
    if obj is None:
        return [
            Check(
                row,
                Status.FAIL,
                f"no RayCluster '{name}' in namespace '{backend.namespace}'",
                "create it (ensure_ray_cluster) or fix KubeRayCluster.ray_cluster_name",
            )
        ]
    state = (obj.get("status") or {}).get("state") or "no state yet"
    rows = [ok(row, f"exists ({state})")]
    return rows + ray_checks(
        backend.ray_api(name),
        token_field="KubeRayCluster.ray_token",
        address_fix=f"the head Service {name}-head-svc must answer on the dashboard port "
        "through the API server's service proxy",
    )
