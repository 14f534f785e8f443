"""The real Kubernetes control plane for tests, built from Go modules on this machine.

from prefect_nemo.testing.control_plane import ControlPlane, build

build.build()  # once: kube-apiserver, kube-controller-manager, etcd, the KubeRay operator
with ControlPlane() as plane:
    api = kubernetes.client.CoreV1Api(plane.api_client())

`python -m prefect_nemo.testing.control_plane build|up|down` does the same from a shell.
"""

from __future__ import annotations

from prefect_nemo.testing.control_plane import build
from prefect_nemo.testing.control_plane.run import ControlPlane

__all__ = ["ControlPlane", "build"]
