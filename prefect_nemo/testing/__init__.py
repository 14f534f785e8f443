"""Test helpers: real engines on one machine, and loopback servers where none can run here.

`prefect_nemo.local_ray.start_local_ray()` gives a real Ray cluster on free ports;
`TcpProxy` sits in front of it to count connections or make it unreachable for a while;
`LoopbackKubeServer` is a real HTTP Kubernetes API server on 127.0.0.1 for the `kubernetes` client
(operator simulators in `prefect_nemo.testing.operators`);
`prefect_nemo.testing.slurm.LocalSlurm` is a real Slurm (munge, MariaDB, slurmdbd, slurmctld,
slurmd) plus an sshd on loopback, run as root from Debian's packages;
`prefect_nemo.testing.runai.RunaiServer` and `prefect_nemo.testing.lepton.LeptonServer` answer the
run:ai (DGX Cloud) and Lepton APIs as NeMo-Run and leptonai call them;
`prefect_nemo.testing.prefect_server.PrefectServer` is `prefect server start` on a fixed port that
a test stops and starts again on the same database, and `prefect_nemo.testing.chaos` /
`chaos_server` are issue 17's reliability scenarios on it (tests/test_outages.py, `make chaos`).
"""

from __future__ import annotations

from importlib.util import find_spec
from typing import TYPE_CHECKING, Any

#: What the `testing` extra installs (distribution names).
REQUIRES = ("jsonschema", "jsonpatch", "cryptography", "common-expression-language")
# the module each one is imported as, where the names differ
_MODULES = {"common-expression-language": "cel"}

if _missing := [name for name in REQUIRES if find_spec(_MODULES.get(name, name)) is None]:
    raise ImportError(
        f"prefect_nemo.testing needs {', '.join(_missing)}: pip install 'prefect-nemo[testing]'",
        name=_missing[0],
    )

from prefect_nemo.testing.proxy import TcpProxy  # noqa: E402 (only once the extra is there)

if TYPE_CHECKING:
    from prefect_nemo.testing.kube_api import LoopbackKubeServer

__all__ = ["LoopbackKubeServer", "TcpProxy"]


def __getattr__(name: str) -> Any:
    # imported lazily: the Kubernetes API server's imports are not needed by TcpProxy alone
    if name == "LoopbackKubeServer":
        from prefect_nemo.testing.kube_api import LoopbackKubeServer

        return LoopbackKubeServer
    raise AttributeError(name)
