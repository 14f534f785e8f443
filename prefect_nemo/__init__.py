"""prefect-nemo: run NeMo-style ML jobs on GPU clusters from Prefect 3.

Three lines to run a job::

    from prefect_nemo import JobSpec, run_job
    result = run_job(JobSpec(entrypoint="python train.py", working_dir="."))   # inside a flow

With no cluster given, jobs run on the embedded default (a local Ray cluster).
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from prefect_nemo.errors import (
    AuthenticationFailed,
    BackendUnavailable,
    DependencyFailed,
    DependencyNotFound,
    InvalidJobSpec,
    JobAlreadyExists,
    JobFailed,
    JobStalled,
    JobStopped,
    JobTimedOut,
    PrefectNemoError,
    QueueTimedOut,
    StopNotConfirmed,
)
from prefect_nemo.jobs import (
    Attempt,
    DryRun,
    Failure,
    FailureClass,
    JobHandle,
    JobResult,
    JobSpec,
    JobState,
    JobStatus,
    QueueInfo,
    RecoveryPolicy,
    Resources,
)
from prefect_nemo.nemo_run_home import claim_home

# NeMo-Run reads its home when first imported: a user's `import nemo_run` after ours keeps its
# files in ./.prefect-nemo/nemo-run (or $PREFECT_NEMO_NEMORUN_HOME) with ours, not ~/.nemo_run
claim_home()

# The Prefect-facing parts load on first use, so `prefect_nemo.jobs`, `.packaging` and the
# backends stay importable (and fast to import) without pulling in Prefect.
_LAZY = {
    "run_job": "prefect_nemo.tasks",
    "run_jobs": "prefect_nemo.tasks",
    "submit_job": "prefect_nemo.tasks",
    "wait_for_job": "prefect_nemo.tasks",
    "stop_job": "prefect_nemo.tasks",
    "start_experiment": "prefect_nemo.tasks",
    "run_key": "prefect_nemo.tasks",
    "wait_for_experiments": "prefect_nemo.tasks",
    "deploy_dgd": "prefect_nemo.tasks",
    "wait_dgd_ready": "prefect_nemo.tasks",
    "own_dgds_by_raycluster": "prefect_nemo.tasks",
    "teardown_dgds": "prefect_nemo.tasks",
    "DeployedDgd": "prefect_nemo.tasks",
    "serve_replicas": "prefect_nemo.tasks",
    "start_replicas": "prefect_nemo.tasks",
    "stop_replicas": "prefect_nemo.tasks",
    "slurm_ray_cluster": "prefect_nemo.tasks",
    "RayJobsCluster": "prefect_nemo.blocks",
    "KubeflowTrainerCluster": "prefect_nemo.blocks",
    "KubeRayCluster": "prefect_nemo.blocks",
    "KubernetesCluster": "prefect_nemo.blocks",
    "SlurmCluster": "prefect_nemo.blocks",
    "LeptonWorkspace": "prefect_nemo.blocks",
    "LeptonRayCluster": "prefect_nemo.blocks",
    "DGXCloudCluster": "prefect_nemo.blocks",
    "DGXCloudRayCluster": "prefect_nemo.blocks",
    "PlacementSpec": "prefect_nemo.placement",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'prefect_nemo' has no attribute {name!r}")


def __dir__() -> list[str]:
    # Prefect finds blocks with inspect.getmembers(module), which lists dir(): show lazy names.
    return sorted({*globals(), *_LAZY})


__all__ = [
    "Attempt",
    "AuthenticationFailed",
    "BackendUnavailable",
    "DependencyFailed",
    "DependencyNotFound",
    "DryRun",
    "Failure",
    "FailureClass",
    "InvalidJobSpec",
    "JobAlreadyExists",
    "JobFailed",
    "JobHandle",
    "JobResult",
    "JobSpec",
    "JobState",
    "JobStatus",
    "JobStalled",
    "JobStopped",
    "JobTimedOut",
    "PrefectNemoError",
    "QueueInfo",
    "QueueTimedOut",
    "RayJobsCluster",
    "RecoveryPolicy",
    "Resources",
    "StopNotConfirmed",
    *_LAZY,
]
