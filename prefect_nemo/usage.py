"""GPU-hours: what one job used (its queue wait, run time, nodes x GPUs, GPU-hours and cost) and
the roll-up of many jobs. Pure arithmetic: no Prefect, no cluster call.

A job's GPU-hours are nodes x GPUs per node x run hours; its cost those GPU-hours times the
cluster block's `gpu_hour_price` (None when the block names no price). Time spent waiting in a
queue holds no GPU and costs nothing. A job that ended FAILED or STOPPED used its GPU-hours for
nothing: they are "wasted", counted in the totals and once more apart.
"""

from __future__ import annotations

from collections.abc import Iterable

from pydantic import BaseModel, ConfigDict, Field

SECONDS_PER_HOUR = 3600.0


class JobShape(BaseModel):
    """How many GPUs a job holds: `nodes` x `gpus_per_node`."""

    model_config = ConfigDict(frozen=True)

    nodes: int = Field(1, ge=1, description="Nodes the job spans.")
    gpus_per_node: float = Field(0.0, ge=0, description="GPUs it holds on each node.")

    @property
    def gpus(self) -> float:
        """GPUs over all nodes."""
        return self.nodes * self.gpus_per_node


def gpu_hours(shape: JobShape, run_s: float) -> float:
    """GPU-hours of a job of this shape that ran `run_s` seconds (2 x 8 GPUs, 90 s -> 0.4)."""
    return shape.gpus * max(0.0, run_s) / SECONDS_PER_HOUR


def cost(hours: float, price: float | None) -> float | None:
    """What `hours` GPU-hours cost at `price` per GPU-hour; None without a price."""
    return None if price is None else hours * price


class JobUsage(BaseModel):
    """What one job used: carried by JobResult.usage, the job table and the terminal
    `prefect-nemo.job.*` events."""

    model_config = ConfigDict(frozen=True)

    queue_wait_s: float = Field(0.0, description="Seconds it waited in its scheduler's queue.")
    run_s: float = Field(0.0, description="Seconds it ran (held its GPUs).")
    nodes: int = Field(1, description="Nodes it spanned.")
    gpus_per_node: float = Field(0.0, description="GPUs it held on each node.")
    gpu_hours: float = Field(0.0, description="nodes x gpus_per_node x run hours.")
    cost: float | None = Field(
        None, description="gpu_hours x the block's gpu_hour_price; None without a price."
    )
    wasted: bool = Field(False, description="It ended FAILED or STOPPED: its GPU-hours bought "
                         "nothing.")  # fmt: skip


def measure(
    shape: JobShape,
    *,
    run_s: float,
    queue_wait_s: float = 0.0,
    price: float | None = None,
    wasted: bool = False,
) -> JobUsage:
    """The usage of one job of `shape` that waited `queue_wait_s` and ran `run_s` seconds."""
    run_s = round(max(0.0, run_s), 3)  # GPU-hours from the run time reported, to agree with it
    hours = gpu_hours(shape, run_s)
    return JobUsage(
        queue_wait_s=round(max(0.0, queue_wait_s), 3),
        run_s=run_s,
        nodes=shape.nodes,
        gpus_per_node=shape.gpus_per_node,
        gpu_hours=hours,
        cost=cost(hours, price),
        wasted=wasted,
    )


class RollUp(BaseModel):
    """Many jobs' usage summed: every job in the totals, the wasted ones also apart."""

    model_config = ConfigDict(frozen=True)

    jobs: int = 0
    queue_wait_s: float = 0.0
    run_s: float = 0.0
    gpu_hours: float = Field(0.0, description="GPU-hours of every job, wasted ones included.")
    wasted_gpu_hours: float = Field(0.0, description="Of gpu_hours, those of failed and "
                                    "stopped jobs.")  # fmt: skip
    cost: float | None = Field(None, description="Cost of every job that has one; None when "
                               "none has.")  # fmt: skip
    wasted_cost: float | None = None


def roll_up(usages: Iterable[JobUsage]) -> RollUp:
    """The sum of the jobs' usage; wasted GPU-hours and cost also apart."""
    items = list(usages)
    wasted = [u for u in items if u.wasted]

    def total_cost(of: list[JobUsage]) -> float | None:
        costs = [u.cost for u in of if u.cost is not None]
        return sum(costs) if costs else None

    return RollUp(
        jobs=len(items),
        queue_wait_s=sum(u.queue_wait_s for u in items),
        run_s=sum(u.run_s for u in items),
        gpu_hours=sum(u.gpu_hours for u in items),
        wasted_gpu_hours=sum(u.gpu_hours for u in wasted),
        cost=total_cost(items),
        wasted_cost=total_cost(wasted),
    )
