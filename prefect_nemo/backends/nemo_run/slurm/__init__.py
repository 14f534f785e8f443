"""Slurm over SSH through NeMo-Run's SlurmExecutor: the backend (`executor`), its job registry
on the cluster (`registry`), the SSH connection that never prompts (`ssh`), what squeue, sacct
and sbatch answer (`accounting`), and Ray clusters in an allocation (`ray_cluster`).
"""

from prefect_nemo.backends.nemo_run.base import STALE_CLAIM_S
from prefect_nemo.backends.nemo_run.slurm.accounting import slurm_seconds as _slurm_seconds
from prefect_nemo.backends.nemo_run.slurm.executor import (
    SECRET_ENV_FILE,
    SlurmBackend,
    SlurmConfig,
)
from prefect_nemo.backends.nemo_run.slurm.registry import SCHEDULER
from prefect_nemo.backends.nemo_run.slurm.registry import _slurm_ids as _slurm_ids
from prefect_nemo.backends.nemo_run.slurm.ssh import SafeSSH

__all__ = [
    "SCHEDULER",
    "SECRET_ENV_FILE",
    "STALE_CLAIM_S",
    "SafeSSH",
    "SlurmBackend",
    "SlurmConfig",
    "_slurm_ids",
    "_slurm_seconds",
]
