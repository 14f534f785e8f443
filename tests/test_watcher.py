"""The watcher's polling, on a backend of our own making (no cluster: what is asserted is how
often the watcher asks, not what a cluster answers)."""

from __future__ import annotations

import contextlib
import threading
import time
from datetime import UTC, datetime

from prefect_nemo.jobs import JobState, JobStatus
from prefect_nemo.watcher import POLL_COST_FACTOR, ClusterWatcher


class SlowList:
    """A polled backend whose every statuses() costs `cost_s` (Ray's list_jobs of a cluster
    with a long history): all jobs RUNNING."""

    cluster = "slow-list"

    def __init__(self, cost_s: float) -> None:
        self.cost_s, self.polls = cost_s, []

    def statuses(self, job_ids: list[str]) -> dict[str, JobStatus]:
        self.polls.append(time.monotonic())
        time.sleep(self.cost_s)
        now = datetime.now(UTC)
        return {j: JobStatus(job_id=j, state=JobState.RUNNING, start_time=now) for j in job_ids}


def test_a_slow_poll_spaces_the_next_one_even_when_new_jobs_wake_the_watcher() -> None:
    """The next poll of a polled backend comes no sooner than POLL_COST_FACTOR times the last
    one took: 40 jobs registered one after the other, 50 ms apart, each wake the watcher, and a
    poll costing at least 50 ms allows one every 0.5 s, not one per job (nor one every 0.1 s).
    Asserted as the spacing between polls (a slow machine only makes polls cost more)."""
    backend = SlowList(cost_s=0.05)
    watcher = ClusterWatcher(backend)  # type: ignore[arg-type]
    with contextlib.ExitStack() as held:
        for i in range(40):
            held.enter_context(watcher.watching(f"job-{i}"))
            time.sleep(0.05)
        watcher.close()
    gaps = [b - a for a, b in zip(backend.polls, backend.polls[1:], strict=False)]
    assert len(backend.polls) < 40 / 2, f"about a poll per new job: {len(backend.polls)}"
    assert min(gaps) >= POLL_COST_FACTOR * 0.05 * 0.99, gaps


def test_a_close_does_not_wait_out_the_bound() -> None:
    """A poll that took 1 s holds the next one back 10 s (max_interval_s set above that);
    closing the watcher meanwhile ends its thread long before (every thread has an owner
    that stops it)."""
    backend = SlowList(cost_s=1.0)
    watcher = ClusterWatcher(backend, max_interval_s=60)  # type: ignore[arg-type]
    with watcher.watching("job"):
        while not backend.polls:
            time.sleep(0.01)
        time.sleep(1.2)  # the poll is done; the next is about 8.8 s away
        thread = next(t for t in threading.enumerate() if t.name.endswith(backend.cluster))
        watcher.close()
        thread.join(5.0)
        assert not thread.is_alive(), "the close waited out the poll bound"
    assert len(backend.polls) == 1


def test_ray_asks_each_watched_job_only_where_that_costs_less_than_one_list() -> None:
    """The way a Ray poll asks (backends/ray_jobs._AskingCost): the first poll lists; the next
    asks each watched job where they are at most a quarter of the cluster's jobs (to price a
    get); from then on, whichever way cost less per poll."""
    from prefect_nemo.backends.ray_jobs import _AskingCost

    cost = _AskingCost()
    assert not cost.each(1), "nothing priced yet: list"
    cost.listed(cluster_jobs=300, took_s=0.070)
    assert cost.each(2) and cost.each(75) and not cost.each(76)
    cost.asked_each(watched=2, took_s=0.008)  # 4 ms a job
    assert cost.each(17) and not cost.each(18), "17 x 4 ms < 70 ms <= 18 x 4 ms"
    cost.listed(cluster_jobs=20, took_s=0.010)  # a young cluster: its list is cheap
    assert not cost.each(3) and cost.each(2)
    assert not cost.each(0), "nothing watched: nothing to ask"
