"""A loopback Kubernetes API server for tests: real HTTP, the `kubernetes` client unchanged.

from prefect_nemo.testing.kube_api import LoopbackKubeServer, crd_dir

with LoopbackKubeServer([crd_dir()]) as server:
    api = kubernetes.client.CoreV1Api(server.api_client())
"""

from __future__ import annotations

import os
from pathlib import Path

from prefect_nemo.testing.kube_api.server import LoopbackKubeServer, RequestEntry, RequestLog
from prefect_nemo.testing.kube_api.store import WatchWindow

#: The CRDs shipped with the kit (KubeRay, Kubeflow Trainer, JobSet, Dynamo; see SOURCES.md there).
PACKAGED_CRDS = Path(__file__).resolve().parents[1] / "crds"

__all__ = [
    "PACKAGED_CRDS",
    "LoopbackKubeServer",
    "RequestEntry",
    "RequestLog",
    "WatchWindow",
    "crd_dir",
]


def crd_dir() -> Path:
    """Folder of real CRD manifests: `$PREFECT_NEMO_CRDS` when set (every *.yaml in it), else
    the ones this package ships (`prefect_nemo/testing/crds`, their sources in its SOURCES.md)."""
    env = os.environ.get("PREFECT_NEMO_CRDS")
    path = Path(env) if env else PACKAGED_CRDS
    if not path.is_dir():
        raise FileNotFoundError(
            f"PREFECT_NEMO_CRDS={env!r} is not a folder: point it at a folder of "
            "CustomResourceDefinition YAML files, or unset it to use the packaged ones"
        )
    return path
