"""Data prep -> SFT as two experiments, on Slurm (or Lepton / DGX Cloud: swap the block).

`data_prep` and `sft` are separate experiments (flow runs that can be started on their own);
`sft` declares that it depends on the prep experiment. On a cluster whose scheduler queues
dependencies itself (Slurm), the prep flow only submits its job and returns, and the SFT job is
queued at once with ``sbatch --dependency=afterok:<prep job>``: Slurm starts it when prep
succeeds, and cancels it (our task says why) if prep fails. Elsewhere the prep flow waits for
its job, so the SFT experiment's Prefect-level dependency is the order. The SFT job may run
4 hours: on Slurm the block's `time` must be at least 04:00:00 (blocks/slurm.yaml's is).

    prefect-nemo blocks apply ...   # a SlurmCluster / Lepton / DGX Cloud block named e.g. "hpc"
    python -m flows.slurm_pipeline slurm-cluster/hpc /shared/runs/demo
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from prefect import flow

from prefect_nemo import JobSpec, PlacementSpec, run_job, start_experiment, submit_job
from prefect_nemo.jobs import NativeDependencies
from prefect_nemo.tasks import resolve_cluster

JOB_CODE = Path(__file__).parent / "slurm_jobs"


def queues_dependencies(cluster: str) -> bool:
    """True when the cluster's scheduler holds dependent jobs itself (Slurm afterok)."""
    return isinstance(resolve_cluster(cluster).backend(), NativeDependencies)


@flow(name="slurm-data-prep", flow_run_name="{experiment}")
def data_prep(experiment: str, run_dir: str, cluster: str, shards: int = 2) -> dict[str, Any]:
    """Write the training shards into run_dir/data (one CPU job)."""
    exp = start_experiment(experiment)
    spec = JobSpec(
        name="prep",
        entrypoint=f"python prep.py --out {run_dir}/data --shards {shards}",
        working_dir=JOB_CODE,
        placement=PlacementSpec(nodes=1, gpus_per_node=0, cpus_per_node=1),
        timeout_s=1800,
    )
    if queues_dependencies(cluster):
        handle = submit_job(spec, cluster)  # SFT waits for it on the cluster (afterok)
        outputs: dict[str, Any] = {"data_uri": f"{run_dir}/data", "job_id": handle.job_id}
    else:
        result = run_job(spec, cluster)
        outputs = {"data_uri": f"{run_dir}/data", "job_id": result.handle.job_id}
    exp.emit("completed", outputs)
    return outputs


@flow(name="slurm-sft", flow_run_name="{experiment}")
def sft(
    experiment: str,
    run_dir: str,
    depends_on: list[str],
    cluster: str,
    gpus_per_node: int = 0,
) -> dict[str, Any]:
    """Fine-tune on the prepared data once the prep experiment's job has succeeded."""
    exp = start_experiment(experiment, depends_on=depends_on, poll_s=1.0)
    spec = JobSpec(
        name="sft",
        entrypoint=f"python sft.py --data {run_dir}/data --out {run_dir}/checkpoint",
        working_dir=JOB_CODE,
        placement=PlacementSpec(nodes=1, gpus_per_node=gpus_per_node, cpus_per_node=1),
        timeout_s=4 * 3600,
    )
    result = run_job(spec, cluster, after=[exp])  # afterok where the scheduler can
    # run_dir is on the cluster's shared storage, which the flow's machine may not mount
    metrics_file = Path(run_dir) / "checkpoint" / "metrics.json"
    metrics = json.loads(metrics_file.read_text()) if metrics_file.exists() else {}
    outputs = {
        "checkpoint_uri": f"{run_dir}/checkpoint",
        "job_id": result.handle.job_id,
        **metrics,
    }
    exp.emit("completed", outputs)
    return outputs


@flow(name="slurm-pipeline")
def slurm_pipeline(
    cluster: str, run_dir: str, name: str | None = None, gpus_per_node: int = 0
) -> dict[str, Any]:
    """Run both experiments: prep, then SFT depending on it (natively on Slurm)."""
    name = name or f"nemo-{int(time.time())}"
    prep = data_prep(experiment=f"{name}-prep", run_dir=run_dir, cluster=cluster)
    trained = sft(
        experiment=f"{name}-sft",
        run_dir=run_dir,
        depends_on=[f"{name}-prep"],
        cluster=cluster,
        gpus_per_node=gpus_per_node,
    )
    return {"prep": prep, "sft": trained}


if __name__ == "__main__":
    print(json.dumps(slurm_pipeline(cluster=sys.argv[1], run_dir=sys.argv[2]), indent=2))
