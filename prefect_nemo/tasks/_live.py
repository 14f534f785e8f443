"""What each flow run of this process started and has not ended (remote work with the callable
that stops it; the jobs its heartbeats name), and the one way to stop it."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from prefect.logging import get_logger

from prefect_nemo.jobs import JobHandle

LOGGER_NAME = "prefect_nemo"


def fallback_logger() -> Any:
    """The logger for code that runs outside a task or flow (hooks, the cancel watch)."""
    return get_logger(LOGGER_NAME)


class _LiveWork:
    """What each flow run started in this process and has not ended yet, each piece with the
    callable that stops it (and says how it ended)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_run: dict[str, dict[str, Callable[[], str]]] = {}
        self._on_success: set[tuple[str, str]] = set()  # stopped when the run completes too

    def add(
        self, flow_run_id: str, key: str, stop: Callable[[], str], *, also_on_success: bool
    ) -> None:
        with self._lock:
            self._by_run.setdefault(flow_run_id, {})[key] = stop
            if also_on_success:
                self._on_success.add((flow_run_id, key))

    def discard(self, flow_run_id: str | None, key: str) -> None:
        with self._lock:
            self._by_run.get(flow_run_id or "", {}).pop(key, None)
            self._on_success.discard((flow_run_id or "", key))

    def take(
        self, flow_run_id: str, *, only_on_success: bool = False
    ) -> list[tuple[str, Callable[[], str]]]:
        """Remove the run's work and return it (`only_on_success`: the part to stop when the
        run completes; the rest is forgotten)."""
        with self._lock:
            work = self._by_run.pop(flow_run_id, {})
            marked = {key for run, key in self._on_success if run == flow_run_id}
            self._on_success -= {(flow_run_id, key) for key in marked}
        return [(k, stop) for k, stop in work.items() if not only_on_success or k in marked]

    def peek(self, flow_run_id: str) -> list[tuple[str, Callable[[], str]]]:
        """The run's work, left in place."""
        with self._lock:
            return list(self._by_run.get(flow_run_id, {}).items())

    def flow_run_ids(self) -> list[str]:
        with self._lock:
            return [run_id for run_id, work in self._by_run.items() if work]


live_work = _LiveWork()


class _RunJobs:
    """The jobs each flow run of this process submitted or attached to and that have not ended:
    what its heartbeats name."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_run: dict[str, dict[tuple[str, str], JobHandle]] = {}

    def own(self, flow_run_id: str, job: JobHandle) -> None:
        with self._lock:
            self._by_run.setdefault(flow_run_id, {})[(job.cluster, job.job_id)] = job

    def release(self, flow_run_id: str, job: JobHandle) -> None:
        with self._lock:
            self._by_run.get(flow_run_id, {}).pop((job.cluster, job.job_id), None)

    def forget(self, flow_run_id: str) -> None:
        with self._lock:
            self._by_run.pop(flow_run_id, None)

    def snapshot(self) -> dict[str, list[JobHandle]]:
        with self._lock:
            return {run: list(jobs.values()) for run, jobs in self._by_run.items() if jobs}


run_jobs = _RunJobs()


def stop_run_work(flow_run_id: str, why: str, *, only_on_success: bool = False) -> None:
    """Stop (in parallel, each confirmed) every piece of work this process tracks for the run
    (`only_on_success`: what is stopped when it completes; the rest is forgotten)."""
    work = live_work.take(flow_run_id, only_on_success=only_on_success)
    if not work:
        return
    logger = fallback_logger()
    logger.warning(f"{why}: stopping {len(work)} piece(s) of remote work")
    with ThreadPoolExecutor(max_workers=min(16, len(work))) as pool:
        outcomes = pool.map(lambda item: item[1](), work)
        for (key, _), outcome in zip(work, outcomes, strict=True):
            logger.warning(f"{key}: {outcome}")
