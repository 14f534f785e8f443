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

__all__ = ["LoopbackKubeServer", "RequestEntry", "RequestLog", "WatchWindow", "crd_dir"]


def crd_dir() -> Path:
    """Folder of real CRD manifests: `$PREFECT_NEMO_CRDS`, else the nearest `shared/crds` beside
    the repository or one of its parent folders (the project keeps them outside the repo)."""
    env = os.environ.get("PREFECT_NEMO_CRDS")
    if env:
        candidates = [Path(env)]
    else:
        repo = Path(__file__).resolve().parents[3]
        candidates = [folder / "shared" / "crds" for folder in repo.parents]
    for path in candidates:
        if path.is_dir():
            return path
    raise FileNotFoundError(
        f"no CRD directory at {candidates[0]}: set PREFECT_NEMO_CRDS to a folder of "
        "CustomResourceDefinition YAML files (KubeRay, Kubeflow Trainer, Dynamo)"
    )
