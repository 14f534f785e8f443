"""Ray on Slurm for the life of a flow: `slurm_ray_cluster` starts a Ray cluster inside one
Slurm allocation (NeMo-Run's SlurmRayCluster) and yields the Ray Jobs block its jobs target;
the allocation is cancelled when the block exits, and by the run's stop hooks when the flow run
is cancelled, crashes or fails first."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from prefect_nemo.blocks.ray_jobs import RayJobsCluster
from prefect_nemo.blocks.slurm import SlurmCluster
from prefect_nemo.tasks._blocks import resolve_block
from prefect_nemo.tasks._run import current_run


@contextmanager
def slurm_ray_cluster(
    cluster: SlurmCluster | str,
    *,
    nodes: int = 2,
    name: str | None = None,
    ready_timeout_s: float = 600.0,
    pre_ray_start_commands: list[str] | None = None,
) -> Iterator[RayJobsCluster]:
    """A Ray cluster of `nodes` Slurm nodes for the `with` block: yields the RayJobsCluster
    that `run_job` and the other Ray Jobs tasks target; the allocation is gone when it exits.

    `cluster` is the SlurmCluster block (or its saved name): account, partition, time, setup
    lines and env come from it (NeMo-Run's Ray script reads its ports and CPUS_PER_WORKER from
    the env). `pre_ray_start_commands` run on every node before Ray starts (NeMo-Run's)."""
    from prefect_nemo.backends.nemo_run.slurm.ray_cluster import SlurmRay

    block = resolve_block(cluster, SlurmCluster, "cluster", "slurm-cluster/my-cluster")
    slurm = block.backend()
    run = current_run()
    ray = SlurmRay(
        slurm,
        name=name or f"ray-{uuid.uuid4().hex[:8]}",
        nodes=nodes,
        ready_timeout_s=ready_timeout_s,
        pre_ray_start_commands=pre_ray_start_commands,
        owner=run.flow_run_id,
    )
    key = f"slurm ray cluster {ray.name}"
    # tracked first: a run cancelled or crashing while the allocation starts still cancels it;
    # owned: the run's heartbeats name it, so the sweeper keeps it while the run lives and
    # stops it when a killed run stops vouching for it
    allocation = slurm.handle(ray.job_name)
    run.track(key, ray.delete, also_on_success=True)
    run.own(allocation)
    try:
        address = ray.start()
        run.logger.info(
            f"Ray cluster {ray.name} is up on {nodes} Slurm nodes (Slurm job "
            f"{ray.slurm_job_id}); Ray Jobs go to {address}"
        )
        yield RayJobsCluster(
            dashboard_url=address,
            max_poll_interval_s=block.max_poll_interval_s,
            unreachable_budget_s=block.unreachable_budget_s,
            stop_timeout_s=block.stop_timeout_s,
        )
    finally:
        run.logger.info(ray.delete())
        run.untrack(key)
        run.release(allocation)
