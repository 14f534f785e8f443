"""Shared Kubernetes helpers for every Kubernetes backend (KubeRay, Dynamo, Kubeflow Trainer).

`KubeApi` is the one way we talk to the API server (plain dicts, typed errors); `apply_or_attach`
the one way we create objects; `wait_for` and `Informer` the one way we wait (watches, not
sleep loops). No Prefect import here.
"""

from prefect_nemo.kube.api import (
    AlreadyExists,
    Conflict,
    Expired,
    Forbidden,
    Invalid,
    KubeApi,
    KubeError,
    NotFound,
)
from prefect_nemo.kube.apply import (
    FLOW_RUN_LABEL,
    GONE_TIMEOUT_S,
    LAST_USED,
    MANAGED_BY,
    SPEC_HASH,
    Applied,
    add_owner_reference,
    apply_or_attach,
    check_same_namespace,
    managed_labels,
    owner_reference,
    spec_hash,
    wait_gone,
)
from prefect_nemo.kube.kinds import (
    CLUSTER_TRAINING_RUNTIME,
    CONFIGMAP,
    EVENT,
    NAMESPACE,
    NODE,
    POD,
    PVC,
    RAY_CLUSTER,
    RAY_JOB,
    SECRET,
    SERVICE,
    TRAIN_JOB,
    TRAINING_RUNTIME,
    Access,
    Kind,
    dgd_kind,
    kind_for,
)
from prefect_nemo.kube.watch import Informer, KubeTimeout, wait_for

__all__ = [
    "CLUSTER_TRAINING_RUNTIME", "CONFIGMAP", "EVENT", "FLOW_RUN_LABEL", "GONE_TIMEOUT_S",
    "LAST_USED", "MANAGED_BY", "NAMESPACE", "NODE", "POD", "PVC", "RAY_CLUSTER", "RAY_JOB",
    "SECRET", "SERVICE", "SPEC_HASH", "TRAINING_RUNTIME", "TRAIN_JOB", "Access", "AlreadyExists",
    "Applied", "Conflict", "Expired", "Forbidden", "Informer", "Invalid", "Kind", "KubeApi",
    "KubeError", "KubeTimeout", "NotFound", "add_owner_reference", "apply_or_attach",
    "check_same_namespace", "dgd_kind", "kind_for", "managed_labels", "owner_reference",
    "spec_hash", "wait_for", "wait_gone",
]  # fmt: skip
