"""The Kubernetes kinds prefect-nemo works with, known statically (no discovery round trips)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prefect_nemo.errors import InvalidJobSpec


@dataclass(frozen=True)
class Kind:
    """Where a kind lives in the API: group/version, plural, scope, and whether it has /status."""

    group: str
    version: str
    kind: str
    plural: str
    namespaced: bool = True
    status_subresource: bool = True
    aggregated: bool = False  # served by an aggregated API server (an APIService), not a CRD

    @property
    def api_version(self) -> str:
        """The manifest's apiVersion: "v1" for the core group, else "group/version"."""
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def crd(self) -> str | None:
        """The name of the CustomResourceDefinition that serves this kind ("rayjobs.ray.io");
        None for the core group, which every API server serves."""
        return f"{self.plural}.{self.group}" if self.group and not self.aggregated else None

    def describe(self, name: str = "", namespace: str | None = None) -> str:
        """A human-readable reference for messages: "rayjobs.ray.io default/train-1"."""
        what = f"{self.plural}.{self.group}" if self.group else self.plural
        where = f"{namespace}/{name}" if namespace and name else name
        return f"{what} {where}".strip()


@dataclass(frozen=True)
class Access:
    """Verbs a backend needs on a kind (or a subresource of it): what RBAC must grant the
    block's account, declared by the backend itself (`access()`) and asked of the API server,
    verb by verb, by `prefect-nemo doctor`."""

    kind: Kind
    verbs: tuple[str, ...]
    subresource: str = ""
    all_namespaces: bool = False  # across every namespace: a ClusterRole's rule
    optional: str = ""  # what stops working without it while jobs still run (a warning)

    @property
    def resource(self) -> str:
        """The RBAC resource: the plural, or "plural/subresource" ("pods/log")."""
        return f"{self.kind.plural}/{self.subresource}" if self.subresource else self.kind.plural

    @property
    def cluster_wide(self) -> bool:
        """Granted by a ClusterRole (a cluster-scoped kind, or a list across namespaces)."""
        return self.all_namespaces or not self.kind.namespaced

    def rule(self, verbs: tuple[str, ...] | None = None) -> dict[str, list[str]]:
        """The (Cluster)Role rule that grants `verbs` (default: all of them)."""
        return {
            "apiGroups": [self.kind.group],
            "resources": [self.resource],
            "verbs": list(self.verbs if verbs is None else verbs),
        }


NAMESPACE = Kind("", "v1", "Namespace", "namespaces", namespaced=False)
NODE = Kind("", "v1", "Node", "nodes", namespaced=False)
POD = Kind("", "v1", "Pod", "pods")
SERVICE = Kind("", "v1", "Service", "services")
CONFIGMAP = Kind("", "v1", "ConfigMap", "configmaps", status_subresource=False)
SECRET = Kind("", "v1", "Secret", "secrets", status_subresource=False)
PVC = Kind("", "v1", "PersistentVolumeClaim", "persistentvolumeclaims")
EVENT = Kind("", "v1", "Event", "events", status_subresource=False)
RAY_CLUSTER = Kind("ray.io", "v1", "RayCluster", "rayclusters")
RAY_JOB = Kind("ray.io", "v1", "RayJob", "rayjobs")
TRAIN_JOB = Kind("trainer.kubeflow.org", "v1alpha1", "TrainJob", "trainjobs")
TRAINING_RUNTIME = Kind("trainer.kubeflow.org", "v1alpha1", "TrainingRuntime", "trainingruntimes")
CLUSTER_TRAINING_RUNTIME = Kind(
    "trainer.kubeflow.org",
    "v1alpha1",
    "ClusterTrainingRuntime",
    "clustertrainingruntimes",
    namespaced=False,
)

DGD_VERSIONS = ("v1alpha1", "v1beta1")


def dgd_kind(version: str = "v1alpha1") -> Kind:
    """Dynamo's DynamoGraphDeployment at an API version (v1alpha1 or v1beta1)."""
    if version not in DGD_VERSIONS:
        raise InvalidJobSpec(
            f"dgd_version: unknown DynamoGraphDeployment version {version!r}; "
            f"use one of {', '.join(DGD_VERSIONS)}"
        )
    return Kind("nvidia.com", version, "DynamoGraphDeployment", "dynamographdeployments")


KNOWN_KINDS: tuple[Kind, ...] = (
    NAMESPACE, POD, SERVICE, CONFIGMAP, SECRET, PVC, EVENT, RAY_CLUSTER, RAY_JOB,
    TRAIN_JOB, TRAINING_RUNTIME, CLUSTER_TRAINING_RUNTIME, *(dgd_kind(v) for v in DGD_VERSIONS),
)  # fmt: skip
# keyed for lookups with whatever a manifest holds there (None when absent)
_BY_TYPE: dict[tuple[object, object], Kind] = {(k.api_version, k.kind): k for k in KNOWN_KINDS}


def kind_for(manifest: dict[str, Any]) -> Kind:
    """The Kind of a manifest, from its apiVersion and kind."""
    key = (manifest.get("apiVersion"), manifest.get("kind"))
    try:
        return _BY_TYPE[key]
    except KeyError:
        known = ", ".join(sorted(f"{k.api_version} {k.kind}" for k in KNOWN_KINDS))
        raise InvalidJobSpec(
            f"manifest apiVersion/kind: {key[0]!r} {key[1]!r} is not a kind prefect-nemo "
            f"manages; known: {known}"
        ) from None
