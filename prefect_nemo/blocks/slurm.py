"""Block for a Slurm cluster reached over SSH, run through NeMo-Run's SlurmExecutor."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from pydantic import Field, SecretStr, ValidationInfo, field_validator, model_validator

from prefect_nemo.blocks.base import ClusterBlock
from prefect_nemo.names import is_slurm_name

if TYPE_CHECKING:
    from prefect_nemo.backends.nemo_run.slurm import SlurmBackend

_TIME = re.compile(r"^(\d+-)?\d{1,2}(:\d{2}){0,2}$|^\d+$")


class SlurmCluster(ClusterBlock):
    """A Slurm cluster's login node over SSH, and the sbatch defaults for its jobs."""

    _block_type_name = "Slurm Cluster"
    _block_type_slug = "slurm-cluster"
    _shape_fields = ("nodes", "gpus_per_node")
    _logo_url = "https://slurm.schedmd.com/favicon.ico"  # type: ignore[assignment]
    _description = (
        "A Slurm cluster reached over SSH (key only, never a password prompt): its login node, "
        "remote job dir and sbatch defaults (account, partition, time, GPUs, container). Jobs "
        "are submitted by NeMo-Run's SlurmExecutor; dependencies become sbatch afterok."
    )
    _code_example = """
```python
from prefect import flow
from prefect_nemo import JobSpec, run_job
from prefect_nemo.blocks.slurm import SlurmCluster

cluster = SlurmCluster.load("BLOCK_NAME")

@flow
def train():
    run_job(JobSpec(entrypoint="python train.py", working_dir="."), cluster=cluster)
```
"""

    host: str = Field(description="Login node host name or address that runs sbatch.")
    port: int = Field(default=22, ge=1, le=65535, description="SSH port of the login node.")
    user: str = Field(description="SSH user (the Slurm user jobs run as).")
    identity: str | None = Field(
        default=None,
        description="Path of the SSH private key on the machine that runs the flow (as "
        "NeMo-Run's SSHTunnel.identity). Set this or identity_key.",
    )
    identity_key: SecretStr | None = Field(
        default=None,
        description="The SSH private key itself (OpenSSH text), kept secret and only in memory. "
        "Set this or identity.",
    )
    known_hosts: str | None = Field(
        default=None,
        description="known_hosts lines for the login node (`ssh-keyscan -p PORT HOST`); when set, "
        "an unknown or changed host key is refused. Empty: ~/.ssh/known_hosts of the machine "
        "running the flow is used if it lists the host, else any host key is accepted.",
    )
    job_dir: str = Field(
        description="Remote directory (shared with the compute nodes) where job scripts, code "
        "and logs are written, as NeMo-Run's SSHTunnel.job_dir.",
    )
    account: str = Field(description="Slurm account charged for the jobs (sbatch --account).")
    partition: str | None = Field(
        default=None,
        description="Slurm partition (sbatch --partition), or a comma-separated list of them "
        "(Slurm starts the job in whichever frees up first); empty: the cluster's default. "
        "JobSpec.queue overrides it.",
    )
    time: str = Field(
        default="01:00:00",
        description="Wall-clock limit of each job (sbatch --time), e.g. 04:00:00 or 1-00:00:00.",
    )
    nodes: int = Field(default=1, ge=1, description="Default node count (placement overrides).")
    ntasks_per_node: int = Field(default=1, ge=1, description="Tasks per node (srun tasks).")
    gpus_per_node: int | None = Field(
        default=None,
        ge=0,
        description="Default GPUs per node; 0 or empty asks for none (CPU-only). A job's "
        "placement or resources override it.",
    )
    cpus_per_task: int | None = Field(default=None, ge=1, description="CPUs per task.")
    mem: str | None = Field(default=None, description="Memory per node (sbatch --mem), e.g. 64G.")
    qos: str | None = Field(
        default=None,
        description="Quality of service (sbatch --qos): the job's priority and limits. "
        "JobSpec.priority overrides it.",
    )
    constraint: str | None = Field(
        default=None, description="Node features (sbatch --constraint), e.g. 'h100'."
    )
    container_image: str | None = Field(
        default=None,
        description="Container image for srun (needs pyxis/enroot); empty runs on the host.",
    )
    container_mounts: list[str] = Field(
        default_factory=list,
        description="Container mounts, 'src:dst' each (with an image); "
        "'${auto_mount:git+<url>@<ref>,<dst>}' clones the repository at ref on the cluster "
        "(once, under job_dir) and bind-mounts it at dst.",
    )
    additional_parameters: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra sbatch options by name, e.g. {'gres': 'gpu:8', 'exclusive': True}; "
        "not 'comment', which prefect-nemo writes (the flow run that owns the job). "
        "{'no_requeue': True}: a failed node or a preemption ends the job (NODE_FAIL, "
        "PREEMPTED) and the recovery policy resubmits it as its next attempt; without it Slurm "
        "puts the job back in its queue itself (NeMo-Run submits with --requeue).",
    )
    setup_lines: str | None = Field(
        default=None,
        description="Shell lines the batch script runs before srun (module loads, ...).",
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Environment for every job (not secret: it is written into the batch "
        "script); put secrets in JobSpec.env as SecretStr.",
    )
    connect_timeout_s: float = Field(
        default=30.0, gt=0, description="Timeout to connect and authenticate over SSH, seconds."
    )
    command_timeout_s: float = Field(
        default=120.0, gt=0, description="Timeout of each remote command (sbatch, sacct), seconds."
    )

    @field_validator("identity_key")
    @classmethod
    def _key_ok(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None or not value.get_secret_value().strip():
            return None
        if "PRIVATE KEY" not in value.get_secret_value():
            raise ValueError(
                "is not an SSH private key (expected '-----BEGIN ... PRIVATE KEY-----'): paste "
                "the private key, not the .pub file"
            )
        return value

    @field_validator("time")
    @classmethod
    def _time_ok(cls, value: str) -> str:
        if not _TIME.match(value.strip()):
            raise ValueError(f"'{value}' is not a Slurm time: use minutes, HH:MM:SS or D-HH:MM:SS")
        return value.strip()

    @field_validator("partition", "qos")
    @classmethod
    def _slurm_names_ok(cls, value: str | None, info: ValidationInfo) -> str | None:
        if not value or not value.strip():
            return None
        many = info.field_name == "partition"
        if not is_slurm_name(value.strip(), many=many):
            listed = " (several partitions: a comma-separated list)" if many else ""
            raise ValueError(
                f"{value!r} is not a Slurm {'partition' if many else 'QOS'} name: use letters, "
                f"digits, '_', '-' or '.'{listed}"
            )
        return value.strip()

    @field_validator("job_dir")
    @classmethod
    def _job_dir_ok(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError(
                f"'{value}' must be an absolute path on the cluster, e.g. /lustre/me/jobs"
            )
        return value.rstrip("/") or "/"

    @model_validator(mode="after")
    def _one_key(self) -> SlurmCluster:
        if self.identity and self.identity_key is not None:
            raise ValueError(
                "set identity (a key file path) or identity_key (the key itself), not both"
            )
        if not self.identity and self.identity_key is None:
            raise ValueError(
                "no SSH key: set identity (a private key file path) or identity_key (the key "
                "text, kept secret); prefect-nemo never falls back to a password prompt"
            )
        return self

    def backend(self) -> SlurmBackend:
        """The NeMo-Run Slurm backend for this cluster (imports nemo_run on first use)."""
        from prefect_nemo.backends.nemo_run.base import config_from
        from prefect_nemo.backends.nemo_run.slurm import SlurmBackend, SlurmConfig

        return SlurmBackend(config_from(SlurmConfig, dict(self)))
