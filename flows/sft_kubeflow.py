"""SFT on Kubeflow Trainer: ship the local trainer code and run it as a TrainJob.

The code under `flows/sft_jobs/` (or any `code_dir`) is packed into a deterministic archive,
carried by ConfigMaps (the packaging library's Kubernetes plan) and unpacked on every node
before torchrun starts `sft.py` across `num_nodes` pods: no image rebuild for a code change.
A re-run of the same experiment attaches to the TrainJob it already started; a failure, timeout
or cancellation deletes the TrainJob, and its ConfigMaps and Secret go with it.

    from flows.sft_kubeflow import sft_kubeflow
    sft_kubeflow(cluster="kubeflow-trainer-cluster/prod", experiment="sft-lr20", steps=300)
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from pydantic import SecretStr

from prefect_nemo import JobSpec, run_job, start_experiment
from prefect_nemo.blocks.kubeflow import KubeflowTrainerCluster

SFT_JOBS = Path(__file__).resolve().parent / "sft_jobs"


@flow(name="SFT on Kubeflow Trainer", flow_run_name="{experiment}")
def sft_kubeflow(
    cluster: KubeflowTrainerCluster | str,
    experiment: str = "sft-kubeflow",
    steps: int = 100,
    lr: float = 20.0,
    extra_args: list[str] | None = None,
    code_dir: str | None = None,
    env: dict[str, str] | None = None,
    secrets: dict[str, SecretStr] | None = None,
    timeout_s: float | None = None,
) -> dict[str, Any]:
    """Run `sft.py` from the local code on Kubeflow Trainer; returns the job's outcome.

    `cluster` is a KubeflowTrainerCluster block or a saved one's name; `extra_args` are appended
    to `python sft.py` (e.g. ["--fail-at-step", "5"]); `secrets` reach the job only through a
    Kubernetes Secret; `timeout_s` stops the job after that long.
    """
    exp = start_experiment(experiment)
    args = ["--steps", str(steps), "--lr", str(lr), *(extra_args or [])]
    spec = JobSpec(
        name="sft",
        entrypoint="python sft.py " + " ".join(shlex.quote(a) for a in args),
        working_dir=Path(code_dir) if code_dir else SFT_JOBS,
        env={**(env or {}), **(secrets or {})},
        timeout_s=timeout_s,
        launcher="torchrun",  # num_nodes x procs_per_node ranks with the Torch plugin's rendezvous
    )
    result = run_job(spec, cluster)
    outputs = {
        "job_id": result.handle.job_id,
        "state": result.state.value,
        "attached": result.attached,
        "duration_s": result.duration_s,
        "trainjob": result.handle.links.get("trainjob", ""),
    }
    get_run_logger().info(f"SFT job {result.handle.job_id} {result.state.value}")
    exp.emit("completed", outputs)
    return outputs


if __name__ == "__main__":
    import sys

    sft_kubeflow(cluster=sys.argv[1] if len(sys.argv) > 1 else "kubeflow-trainer-cluster/default")
