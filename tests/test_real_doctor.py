"""`prefect-nemo doctor` against the real control plane (kube-apiserver 1.37 with RBAC only):
ServiceAccount tokens whose Roles lack a verb the block needs, and one with every verb; the
CRDs as the real API server serves them; the command end to end, its token never printed.

The missing and the too-old CRD are in test_doctor.py, on the loopback API server: deleting a
CRD here would delete every object of its kind that the other ONE_CONTROL_PLANE files of this
process rely on (and KubeRay's operator stops when its CRDs go)."""

from __future__ import annotations

import subprocess
import sys
import uuid
from typing import Any

import pytest

from prefect_nemo.doctor import Check, Status, check_backend, cluster_checks, failed
from tests.conftest import subprocess_env
from tests.test_real_control_plane import KUBERAY_RULES, kuberay_block, service_account_token

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("control-plane")]


def rows_of(checks: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in checks}


def test_a_token_that_lacks_a_verb_fails_that_row_with_the_rule_to_add(control_plane: Any) -> None:
    """Kubernetes docs, "Authorization", checking API access: "SelfSubjectAccessReview ... lets
    any user check whether they can perform a given action". A ServiceAccount whose Role lacks
    `create` on RayJobs: the rayjobs row fails naming the verb, the resource, the account and
    the Role rule to add; the other rows pass, so the doctor says exactly what to grant."""
    rules = [dict(rule) for rule in KUBERAY_RULES]
    rules[0] = {**rules[0], "verbs": [v for v in rules[0]["verbs"] if v != "create"]}
    namespace = f"doctor-{uuid.uuid4().hex[:6]}"
    token = service_account_token(control_plane, namespace, rules)
    rows = rows_of(check_backend("kube-ray-cluster/t", kuberay_block(control_plane, namespace,
                                                                     token).backend()))
    bad = rows["rbac rayjobs.ray.io"]
    assert bad.status is Status.FAIL, bad
    assert f"system:serviceaccount:{namespace}:prefect-nemo-" in bad.detail
    assert "may not create rayjobs (API group 'ray.io') in namespace " + namespace in bad.detail
    assert f"add to a Role in namespace {namespace} bound to system:serviceaccount:" in bad.fix
    assert '{"apiGroups": ["ray.io"], "resources": ["rayjobs"], "verbs": ["create"]}' in bad.fix
    others = [c for c in rows.values() if c is not bad]
    assert all(c.status is Status.OK for c in others), others
    assert f"as system:serviceaccount:{namespace}:prefect-nemo-" in rows[
        "kubernetes credentials"
    ].detail
    # a namespaced account may not read CRDs: the versions come from API discovery
    crd = rows["crd rayjobs.ray.io"]
    assert "served: v1, v1alpha1" in crd.detail and "API discovery" in crd.detail
    assert all(token not in c.detail + c.fix for c in rows.values())


def test_a_token_with_every_verb_passes_every_row(control_plane: Any) -> None:
    """The documented Role (KUBERAY_RULES): every row passes, and the doctor's verdict (no
    failure: exit 0) agrees with the block's own access check."""
    namespace = f"doctor-{uuid.uuid4().hex[:6]}"
    token = service_account_token(control_plane, namespace, KUBERAY_RULES)
    backend = kuberay_block(control_plane, namespace, token).backend()
    checks = check_backend("kube-ray-cluster/t", backend)
    assert [c.status for c in checks] == [Status.OK] * len(checks), checks
    names = [c.name for c in checks]
    assert names[:3] == ["kubernetes credentials", "crd rayjobs.ray.io", "crd rayclusters.ray.io"]
    assert {n for n in names if n.startswith("rbac ")} == {
        "rbac rayjobs.ray.io", "rbac rayclusters.ray.io", "rbac secrets", "rbac pods",
        "rbac pods/log", "rbac services/proxy",
    }  # fmt: skip
    assert not failed(checks)
    backend.check_access()


def test_a_cluster_scoped_runtime_needs_a_cluster_role(control_plane: Any) -> None:
    """Kubernetes docs, "Using RBAC Authorization": "a Role always sets permissions within a
    particular namespace"; for cluster-scoped resources use a ClusterRole. A Kubeflow block
    whose account has every verb in a Role: the ClusterTrainingRuntime row fails and names a
    ClusterRole; listing TrainJobs in every namespace (for removing unused runtimes only) is a
    warning, not a failure."""
    from prefect_nemo.blocks import KubeflowTrainerCluster, KubernetesCluster

    namespace = f"doctor-{uuid.uuid4().hex[:6]}"
    every = ["get", "list", "watch", "create", "delete", "patch"]
    rules = [
        {"apiGroups": ["trainer.kubeflow.org"], "resources": ["*"], "verbs": every},
        {"apiGroups": [""], "resources": ["secrets", "configmaps", "pods", "pods/log"],
         "verbs": every},
    ]  # fmt: skip
    token = service_account_token(control_plane, namespace, rules)
    kube = KubernetesCluster(
        kubeconfig=control_plane.kubeconfig(namespace, "real", token=token), namespace=namespace
    )
    block = KubeflowTrainerCluster(kubernetes=kube, image="python:3.11-slim")
    rows = rows_of(check_backend("kubeflow-trainer-cluster/t", block.backend()))
    runtime = rows["rbac clustertrainingruntimes.trainer.kubeflow.org"]
    assert runtime.status is Status.FAIL
    assert "cluster-wide" in runtime.detail and "add to a ClusterRole bound to" in runtime.fix
    assert '"verbs": ["get", "list", "create", "patch", "delete"]' in runtime.fix
    assert rows["rbac trainjobs.trainer.kubeflow.org"].status is Status.OK  # in the namespace
    everywhere = rows["rbac trainjobs.trainer.kubeflow.org (all namespaces)"]
    assert everywhere.status is Status.WARN and "in every namespace" in everywhere.detail
    assert "needed by removing ClusterTrainingRuntimes no TrainJob uses" in everywhere.detail
    assert not failed([c for c in rows.values() if c is not runtime])
    for crd in ("trainjobs", "clustertrainingruntimes"):
        assert rows[f"crd {crd}.trainer.kubeflow.org"].status is Status.OK


def test_a_kubernetes_block_reports_dynamo_at_the_version_served(control_plane: Any) -> None:
    """The real API server serves the kit's Dynamo CRD at v1alpha1 only: the DGD row says so
    (deploy_dgd's version=), and the admin's verbs on DGDs pass."""
    from prefect_nemo.blocks import KubernetesCluster

    block = KubernetesCluster(kubeconfig=control_plane.kubeconfig("default", "real"))
    rows = rows_of(cluster_checks(block.api(), "default"))
    crd = rows["crd dynamographdeployments.nvidia.com"]
    assert crd.status is Status.OK and crd.detail == "served: v1alpha1; storage v1alpha1"
    assert rows["namespace default"].status is Status.OK
    assert rows["rbac dynamographdeployments.nvidia.com"].status is Status.OK
    # built from Go modules without version stamping: the server says v0.0.0-master
    assert rows["kubernetes credentials"].detail.startswith("kube-apiserver v")
    assert rows["kubernetes credentials"].detail.endswith(", as prefect-nemo-admin")


def test_the_command_exits_1_on_a_missing_verb_and_never_prints_the_token(
    control_plane: Any, prefect_api: str
) -> None:
    """`prefect-nemo doctor NAME` as users run it, on saved blocks in the Prefect API: the
    table with the failing row and its fix, exit 1; with the full Role, exit 0. The
    ServiceAccount token (in the saved kubeconfig) is in neither output."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    rules = [  # pods: no watch
        {**rule, "verbs": ["get", "list"]} if rule["resources"] == ["pods"] else rule
        for rule in KUBERAY_RULES
    ]
    outcomes = {}
    for label, role in (("lacking", rules), ("full", KUBERAY_RULES)):
        namespace = f"doctor-{uuid.uuid4().hex[:6]}"
        token = service_account_token(control_plane, namespace, role)
        name = f"doctor-{label}-{uuid.uuid4().hex[:6]}"
        with temporary_settings({PREFECT_API_URL: prefect_api}):
            kuberay_block(control_plane, namespace, token).save(name)
        done = subprocess.run(
            [sys.executable, "-m", "prefect_nemo.cli", "doctor", f"kube-ray-cluster/{name}"],
            env=subprocess_env(prefect_api, COLUMNS="400"), capture_output=True, text=True,
            timeout=180,
        )  # fmt: skip
        assert token not in done.stdout + done.stderr
        assert token[:40] not in done.stdout + done.stderr
        outcomes[label] = done
    lacking, full = outcomes["lacking"], outcomes["full"]
    assert lacking.returncode == 1, lacking.stdout + lacking.stderr
    assert "BLOCK" in lacking.stdout and "FIX" in lacking.stdout
    line = next(ln for ln in lacking.stdout.splitlines() if "rbac pods " in ln)
    assert "FAIL" in line and "may not watch pods" in line, lacking.stdout
    assert '"verbs": ["watch"]' in lacking.stdout
    assert full.returncode == 0, full.stdout + full.stderr
    assert "FAIL" not in full.stdout and "clock vs Prefect" in full.stdout
