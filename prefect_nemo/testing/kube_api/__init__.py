"""A loopback Kubernetes API server for tests: real HTTP, the `kubernetes` client unchanged.

from prefect_nemo.testing.kube_api import LoopbackKubeServer, crd_dir

with LoopbackKubeServer([crd_dir()]) as server:
    api = kubernetes.client.CoreV1Api(server.api_client())
"""

from __future__ import annotations

import os
from pathlib import Path

from prefect_nemo.testing.kube_api.server import LoopbackKubeServer, RequestEntry, RequestLog

__all__ = ["LoopbackKubeServer", "RequestEntry", "RequestLog", "crd_dir"]


def crd_dir() -> Path:
    """Folder of real CRD manifests: `$PREFECT_NEMO_CRDS`, else `<repo root>/../shared/crds`."""
    env = os.environ.get("PREFECT_NEMO_CRDS")
    path = Path(env) if env else Path(__file__).resolve().parents[3].parent / "shared" / "crds"
    if not path.is_dir():
        raise FileNotFoundError(
            f"CRD directory {path} not found: set PREFECT_NEMO_CRDS to a folder of "
            "CustomResourceDefinition YAML files"
        )
    return path
