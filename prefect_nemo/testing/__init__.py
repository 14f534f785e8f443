"""Test helpers: a local Ray head, a flaky-network proxy, a loopback Kubernetes API server.

`prefect_nemo.local_ray.start_local_ray()` gives a real Ray cluster on free ports;
`TcpProxy` sits in front of it to count connections or make it unreachable for a while;
`LoopbackKubeServer` is a real HTTP Kubernetes API server on 127.0.0.1 for the `kubernetes` client.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prefect_nemo.testing.proxy import TcpProxy

if TYPE_CHECKING:
    from prefect_nemo.testing.kube_api import LoopbackKubeServer

__all__ = ["LoopbackKubeServer", "TcpProxy"]


def __getattr__(name: str) -> Any:
    # imported lazily: aiohttp and jsonschema are not needed by users of TcpProxy alone
    if name == "LoopbackKubeServer":
        from prefect_nemo.testing.kube_api import LoopbackKubeServer

        return LoopbackKubeServer
    raise AttributeError(name)
