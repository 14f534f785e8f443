"""The real control plane (kube-apiserver, kube-controller-manager, etcd, the KubeRay operator,
built from Go modules): our blocks under real RBAC. The Kubernetes behaviour tests that also
run here are in test_kube_api.py (REAL_TOO); the operator running our RayJobs on the node
agent's pods, in test_real_kuberay.py."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from kubernetes import client

from prefect_nemo.testing.control_plane.run import OPERATOR_NAMESPACE

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("control-plane")]

# What the KubeRay block needs in its namespace (docs/guides/kuberay.md, "Permissions"): its
# RayJobs (and their RayClusters to read), the Secret of secret env values, the pods and
# their logs, and the head Service's proxy (Ray's Jobs API, existing-cluster mode).
KUBERAY_RULES = [
    {"apiGroups": ["ray.io"], "resources": ["rayjobs"],
     "verbs": ["get", "list", "watch", "create", "delete", "patch"]},
    {"apiGroups": ["ray.io"], "resources": ["rayclusters"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "create", "delete", "patch"]},
    {"apiGroups": [""], "resources": ["configmaps"],
     "verbs": ["get", "create", "delete", "patch"]},
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]},
    {"apiGroups": [""], "resources": ["services/proxy"], "verbs": ["get", "create"]},
]  # fmt: skip


def service_account_token(plane: Any, namespace: str, rules: list[dict[str, Any]]) -> str:
    """A ServiceAccount in `namespace` bound to a Role of `rules`; a short-lived token of it."""
    api = plane.api_client()
    core, rbac = client.CoreV1Api(api), client.RbacAuthorizationV1Api(api)
    name = f"prefect-nemo-{uuid.uuid4().hex[:6]}"  # a plane left running may be reused
    if (
        namespace != OPERATOR_NAMESPACE
        or not core.list_namespace(field_selector=f"metadata.name={namespace}").items
    ):
        core.create_namespace({"metadata": {"name": namespace}})
    core.create_namespaced_service_account(namespace, {"metadata": {"name": name}})
    rbac.create_namespaced_role(namespace, {"metadata": {"name": name}, "rules": rules})
    rbac.create_namespaced_role_binding(namespace, {
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                    "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
    })  # fmt: skip
    request = core.create_namespaced_service_account_token(
        name, namespace, {"spec": {"expirationSeconds": 3600}}
    )
    return request.status.token


def kuberay_block(plane: Any, namespace: str, token: str) -> Any:
    """A KubeRayCluster block (each job brings its RayCluster) on a ServiceAccount's token."""
    from prefect_nemo.blocks import KubeRayCluster, KubernetesCluster
    from tests.test_kuberay import cluster_spec

    kube = KubernetesCluster(kubeconfig=plane.kubeconfig(namespace, "real", token=token),
                             namespace=namespace)  # fmt: skip
    return KubeRayCluster(kubernetes=kube, ray_cluster_spec=cluster_spec(),
                          ttl_seconds_after_finished=0)  # fmt: skip


def test_a_service_account_with_the_documented_role_is_enough(control_plane: Any) -> None:
    """Kubernetes docs, "Using RBAC Authorization": "Permissions are purely additive (there are
    no "deny" rules)." A ServiceAccount with only the documented Role passes the block's access
    check (a list of its RayJobs) on the real API server."""
    namespace = f"rbac-{uuid.uuid4().hex[:6]}"
    token = service_account_token(control_plane, namespace, KUBERAY_RULES)
    backend = kuberay_block(control_plane, namespace, token).backend()
    backend.check_access()
    assert backend.owned_jobs() == []


def test_a_missing_permission_names_the_verb_and_the_resource(control_plane: Any) -> None:
    """Kubernetes docs, "Authorization": "Kubernetes authorizes API requests using the API
    server. It evaluates all of the request attributes against all policies ... and allows or
    denies the request", a denied request answering 403 Forbidden. With `list` on RayJobs left
    out of the Role, the block's access check fails with our AuthenticationFailed naming the
    verb, the resource and what to fix, not a generic error or an outage to wait out."""
    from prefect_nemo import AuthenticationFailed

    rules = [dict(rule) for rule in KUBERAY_RULES]
    rules[0] = {**rules[0], "verbs": [v for v in rules[0]["verbs"] if v != "list"]}
    namespace = f"rbac-{uuid.uuid4().hex[:6]}"
    token = service_account_token(control_plane, namespace, rules)
    backend = kuberay_block(control_plane, namespace, token).backend()
    with pytest.raises(AuthenticationFailed) as info:
        backend.check_access()
    message = str(info.value)
    assert "not allowed to list" in message and "rayjobs" in message.lower()
    assert f'"system:serviceaccount:{namespace}:prefect-nemo-' in message
    assert 'cannot list resource "rayjobs" in API group "ray.io"' in message
    assert "RBAC" in message and token not in message


# -- Dynamo DGDs and the real garbage collector (the DGD simulator is not needed for GC) ---------


def test_the_real_garbage_collector_on_dgds_owned_by_a_raycluster(control_plane: Any) -> None:
    """Kubernetes docs, "Owners and dependents": "Cross-namespace owner references are
    disallowed by design. ... A namespaced owner must exist in the same namespace as the
    dependent. If it does not, the owner reference is treated as absent, and the dependent is
    subject to deletion once all owners are verified absent." On the real API server and
    garbage collector: a DGD that own_by gives a RayCluster owner in its namespace lives until
    that RayCluster is deleted, then goes; a DGD in another namespace with the same owner
    reference (written raw: own_by refuses it) is deleted at once: what own_by's check
    prevents."""
    from prefect_nemo import InvalidJobSpec
    from prefect_nemo.backends.dynamo import apply_dgd, dgd_kind, own_by, render_dgd
    from prefect_nemo.blocks.kubernetes import KubernetesCluster
    from prefect_nemo.kube import RAY_CLUSTER
    from tests.conftest import wait_until
    from tests.test_dynamo import agg

    here, there = f"gc-{uuid.uuid4().hex[:6]}", f"gc-{uuid.uuid4().hex[:6]}"
    core = client.CoreV1Api(control_plane.api_client())
    for ns in (here, there):
        core.create_namespace({"metadata": {"name": ns}})
    api = KubernetesCluster(kubeconfig=control_plane.kubeconfig(here), namespace=here).api()
    head = {"containers": [{"name": "ray-head", "image": "rayproject/ray:2.60.0"}]}
    owner = api.create(RAY_CLUSTER, {
        "apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": "trainer"},
        "spec": {"headGroupSpec": {"rayStartParams": {}, "template": {"spec": head}}},
    })  # fmt: skip
    for ns in (here, there):
        apply_dgd(api, render_dgd(agg(), name="served", namespace=ns, flow_run_id="run-1"))
    own_by(api, "served", here, owner)
    with pytest.raises(InvalidJobSpec, match="namespace"):
        own_by(api, "served", there, owner)
    ref = {"apiVersion": "ray.io/v1", "kind": "RayCluster", "name": "trainer",
           "uid": owner["metadata"]["uid"], "controller": False}  # fmt: skip
    api.patch(dgd_kind(), "served", {"metadata": {"ownerReferences": [ref]}}, there)
    assert wait_until(lambda: api.get(dgd_kind(), "served", there) is None, 30), (
        "the real garbage collector kept a DGD whose owner is in another namespace"
    )
    assert api.get(dgd_kind(), "served", here) is not None, "a same-namespace owner keeps it"
    api.delete(RAY_CLUSTER, "trainer", here)
    assert wait_until(lambda: api.get(dgd_kind(), "served", here) is None, 30)


def test_an_unknown_field_is_refused_not_pruned(control_plane: Any) -> None:
    """Kubernetes API concepts, "Field validation": with `fieldValidation=Warn` ("the default
    ... when fieldValidation is not set") an unknown field is dropped and only a warning comes
    back; "Strict: This will fail the request with a BadRequest error if any unknown fields
    would be dropped". A typo in ray_cluster_spec must not vanish silently: our writes ask for
    Strict, so the real API server refuses the RayJob naming the field, and the Secret made for
    the job's secret env is removed again."""
    from pydantic import SecretStr

    from prefect_nemo import InvalidJobSpec, JobSpec
    from tests.test_kuberay import META, cluster_spec

    namespace = f"strict-{uuid.uuid4().hex[:6]}"
    token = service_account_token(control_plane, namespace, KUBERAY_RULES)
    bad = cluster_spec()
    bad["headGroupSpec"]["bogusField"] = 1
    block = kuberay_block(control_plane, namespace, token).model_copy(
        update={"ray_cluster_spec": bad}
    )
    backend = block.backend()
    spec = JobSpec(entrypoint="true", env={"TOKEN": SecretStr("s3cret-value")})
    with pytest.raises(InvalidJobSpec, match="bogusField"):
        backend.submit(spec, "rejected-job", META)
    assert control_plane.get("secrets", namespace, "rejected-job-env") is None
    assert control_plane.get("rayjobs", namespace, "rejected-job", group="ray.io") is None


# Names a new user tried (issue 27): not DNS labels, one too long, and good ones beside them.
NAMESPACES = ["Bad_NS!", "n" * 64, "UPPER", "-lead", "trail-", "a.b", "", "ok", "a-1", "n" * 63]


@pytest.mark.parametrize("name", NAMESPACES)
def test_our_namespace_check_agrees_with_kube_apiserver(control_plane: Any, name: str) -> None:
    """Kubernetes docs, "Namespaces": a namespace name "must be a valid RFC 1123 DNS label";
    kube-apiserver 1.37 says why it refuses one ("a lowercase RFC 1123 label must consist of
    lower case alphanumeric characters or '-', and must start and end with an alphanumeric
    character"). `check_namespace` (what blocks, renders, dry runs and every request of ours go
    through) accepts exactly the names the real server accepts, so a bad one is refused before
    anything is sent rather than answered with a 404 for a namespace that cannot exist."""
    from prefect_nemo import InvalidJobSpec
    from prefect_nemo.names import check_namespace

    core = client.CoreV1Api(control_plane.api_client())
    try:
        core.create_namespace({"metadata": {"name": name}}, dry_run="All")
        server_accepts = True
    except client.ApiException as exc:
        assert exc.status == 422, exc.body
        server_accepts = False
    try:
        check_namespace(name)
        we_accept = True
    except InvalidJobSpec as exc:
        assert repr(name) in str(exc) and "RFC 1123 label" in str(exc)
        we_accept = False
    assert we_accept == server_accepts


def test_a_negative_replica_count_is_what_kubernetes_refuses(control_plane: Any) -> None:
    """The Dynamo operator turns a DGD service's `replicas` into its Deployment's; Kubernetes
    refuses a Deployment with `spec.replicas: Invalid value: -1: must be greater than or equal
    to 0`. Our DGD check refuses replicas=-1 before the DGD (which would be stored, and never
    become ready) is sent."""
    from prefect_nemo import InvalidJobSpec
    from prefect_nemo.backends.dynamo import render_dgd

    apps = client.AppsV1Api(control_plane.api_client())
    pod = {"metadata": {"labels": {"a": "b"}},
           "spec": {"containers": [{"name": "c", "image": "i"}]}}  # fmt: skip
    deployment = {"metadata": {"name": "negative"},
                  "spec": {"replicas": -1, "selector": {"matchLabels": {"a": "b"}},
                           "template": pod}}  # fmt: skip
    with pytest.raises(client.ApiException) as refused:
        apps.create_namespaced_deployment("default", deployment, dry_run="All")
    assert refused.value.status == 422
    assert "must be greater than or equal to 0" in refused.value.body
    dgd = {"apiVersion": "nvidia.com/v1alpha1", "kind": "DynamoGraphDeployment",
           "metadata": {"name": "neg"},
           "spec": {"services": {"Frontend": {"componentType": "frontend", "replicas": 1},
                                 "Worker": {"replicas": -1}}}}  # fmt: skip
    with pytest.raises(InvalidJobSpec, match=r"service 'Worker': replicas is -1: .* >= 0"):
        render_dgd(dgd, namespace="default")
