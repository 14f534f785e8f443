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
    one took: 40 jobs registered one after the other within 2 s each wake the watcher, and a
    poll costing 50 ms allows one every 0.5 s, not one per job (nor one every 0.1 s)."""
    backend = SlowList(cost_s=0.05)
    watcher = ClusterWatcher(backend)  # type: ignore[arg-type]
    with contextlib.ExitStack() as held:
        for i in range(40):
            held.enter_context(watcher.watching(f"job-{i}"))
            time.sleep(0.05)
        watcher.close()
    gaps = [b - a for a, b in zip(backend.polls, backend.polls[1:], strict=False)]
    assert len(backend.polls) <= 2 / (POLL_COST_FACTOR * 0.05) + 2, backend.polls
    assert min(gaps) >= POLL_COST_FACTOR * 0.05 * 0.9, gaps


def test_a_close_does_not_wait_out_the_bound() -> None:
    """A poll that took 0.15 s holds the next one back 1.5 s; closing the watcher meanwhile
    ends its thread at once (every thread has an owner that stops it)."""
    backend = SlowList(cost_s=0.15)
    watcher = ClusterWatcher(backend)  # type: ignore[arg-type]
    with watcher.watching("job"):
        while not backend.polls:
            time.sleep(0.01)
        time.sleep(0.3)  # the poll is done; the next is 1.2 s away
        thread = next(t for t in threading.enumerate() if t.name.endswith(backend.cluster))
        closed = time.monotonic()
        watcher.close()
        thread.join(2.0)
        assert not thread.is_alive()
        assert time.monotonic() - closed < 0.5, "the close waited out the poll bound"
    assert len(backend.polls) == 1
