"""Test helpers: real engines on one machine, and loopback servers where none can run here.

`prefect_nemo.local_ray.start_local_ray()` gives a real Ray cluster on free ports;
`TcpProxy` sits in front of it to count connections or make it unreachable for a while;
`LoopbackKubeServer` is a real HTTP Kubernetes API server on 127.0.0.1 for the `kubernetes` client
(operator simulators in `prefect_nemo.testing.operators`);
`prefect_nemo.testing.slurm.LocalSlurm` is a real Slurm (munge, MariaDB, slurmdbd, slurmctld,
slurmd) plus an sshd on loopback, run as root from Debian's packages;
`prefect_nemo.testing.runai.RunaiServer` and `prefect_nemo.testing.lepton.LeptonServer` answer the
run:ai (DGX Cloud) and Lepton APIs as NeMo-Run and leptonai call them.
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
