"""What every cluster block shares: how to build its backend and how to watch and stop jobs."""

from __future__ import annotations

from abc import abstractmethod
from typing import ClassVar

from prefect.blocks.core import Block
from pydantic import ConfigDict, Field

from prefect_nemo.jobs import Backend, RecoveryPolicy
from prefect_nemo.names import dns_label
from prefect_nemo.usage import JobShape

DOCS_URL = "https://github.com/prefect-nemo/prefect-nemo#readme"
# Block logos ship in this repository (assets/block-logos), as Prefect ships its own: a file
# here can be checked offline against Prefect's logo rule, an icon on another site cannot.
LOGOS_URL = "https://raw.githubusercontent.com/prefect-nemo/prefect-nemo/main/assets/block-logos"


class ClusterBlock(Block):
    """Base of every block that says where jobs run; subclasses add credentials and config."""

    # a rejected value may be a secret (a key pasted wrong): errors name the field, not the value
    model_config = ConfigDict(hide_input_in_errors=True)

    # Block annotates _logo_url and _documentation_url as HttpUrl; a plain URL string works
    # the same (Prefect's API takes either), hence the ignores on them in every block
    _documentation_url = DOCS_URL  # type: ignore[assignment]
    # the block's (nodes, GPUs per node) fields, where its jobs get them by default
    _shape_fields: ClassVar[tuple[str, str] | None] = None

    max_concurrent_jobs: int | None = Field(
        default=None,
        ge=1,
        description="Cap on jobs running at once on this cluster across all flows, enforced "
        "with a Prefect global concurrency limit; empty for no cap.",
    )
    unreachable_budget_s: float = Field(
        default=120.0,
        gt=0,
        description="Seconds the cluster may stay unreachable while jobs are watched before "
        "the jobs are stopped and the task fails.",
    )
    stop_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="Seconds to wait for the cluster to confirm that a stopped job has ended.",
    )
    sweep_grace_s: float = Field(
        default=300.0,
        ge=0,
        description="Seconds the sweeper waits after a job's flow run died (crashed, failed, "
        "or stopped proving it is alive) before it stops the job: a retry of the run within "
        "this time attaches to the job instead.",
    )
    gpu_hour_price: float | None = Field(
        default=None,
        ge=0,
        allow_inf_nan=False,
        description="What one GPU-hour on this cluster costs, in the currency your team bills "
        "in (e.g. USD per GPU-hour): each job's cost is its GPU-hours times this price. Empty "
        "for no cost (GPU-hours are reported either way).",
    )
    log_storage: str | None = Field(
        default=None,
        pattern=r"^[a-z0-9-]+/[^/]+$",
        description="A Prefect storage block (a writable file system, as "
        "'local-file-system/job-logs' or 'remote-file-system/s3-logs') that every job's "
        "saved log is copied into when the job ends, as <flow run id>/<job id>.log; the job "
        "table links the copy. Empty: the local file under ./.prefect-nemo/logs is the link.",
    )
    recovery: RecoveryPolicy = Field(
        default_factory=RecoveryPolicy,
        description="How a failed job is tried again, by its cause, unless its spec says "
        "(JobSpec.recovery): the cluster's failures (preemption, a lost node) are resubmitted "
        "up to max_restarts_on_preemption times; the job's own errors fail at once unless "
        "max_restarts_on_errors or recover_on_exit_codes say otherwise.",
    )
    max_poll_interval_s: float = Field(
        default=2.0,
        gt=0,
        description="Longest pause between two status polls of the cluster (polls are faster "
        "while jobs are young).",
    )

    @abstractmethod
    def backend(self) -> Backend:
        """Build the backend that talks to this cluster."""

    def default_shape(self) -> JobShape | None:
        """The nodes x GPUs a job without placement gets on this cluster (Slurm, Lepton, DGX
        Cloud, Kubeflow Trainer: the block's nodes, and its GPUs per node unless the job's
        resources.gpus says), for its GPU-hours; None where the block sets none."""
        if self._shape_fields is None:
            return None
        nodes, gpus = (getattr(self, name) for name in self._shape_fields)
        return JobShape(nodes=nodes, gpus_per_node=gpus or 0)

    def cleanup(self) -> list[str]:
        """Remove what prefect-nemo created on this cluster that no run needs any more (shared
        runtimes no job uses, clusters a crashed run left behind); returns what was removed.
        Nothing by default. `prefect-nemo cleanup <block>` calls it."""
        return []

    def concurrency_limit_name(self, backend: Backend) -> str:
        """The Prefect global concurrency limit that caps this cluster's running jobs."""
        return f"prefect-nemo-{dns_label(backend.cluster, 50)}"
