"""Helpers for testing flows that use prefect-nemo: a local Ray head and a flaky-network proxy.

`prefect_nemo.local_ray.start_local_ray()` gives a real Ray cluster on free ports;
`TcpProxy` sits in front of it to count connections or make it unreachable for a while.
"""

from prefect_nemo.testing.proxy import TcpProxy

__all__ = ["TcpProxy"]
