"""What a Kubernetes job backend remembers in this process beyond what the API server keeps."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

from prefect_nemo.jobs import JobState, JobStatus


class JobMemory:
    """Per (cluster, job id): whether we deleted the job to stop it (so it reads STOPPED once
    it is gone, not "missing"), and the last log we read (still readable after teardown took
    the pods or the Ray head away). One per backend kind, shared by its instances."""

    def __init__(self, max_logs: int = 256) -> None:
        self._lock = threading.Lock()
        self._deleted: set[tuple[str, str]] = set()
        self._logs: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._max_logs = max_logs

    def mark_deleted(self, key: tuple[str, str]) -> None:
        with self._lock:
            self._deleted.add(key)

    def forget_deleted(self, key: tuple[str, str]) -> None:
        with self._lock:
            self._deleted.discard(key)

    def was_deleted(self, key: tuple[str, str]) -> bool:
        with self._lock:
            return key in self._deleted

    def stopped_status(self, cluster: str, job_id: str, how: str) -> JobStatus | None:
        """STOPPED (saying `how`) for a job we deleted to stop it, else None."""
        if not self.was_deleted((cluster, job_id)):
            return None
        return JobStatus(job_id=job_id, state=JobState.STOPPED, message=how)

    def remember_log(self, key: tuple[str, str], text: str) -> str:
        """Keep the longest log read so far; returns it."""
        with self._lock:
            if len(text) >= len(self._logs.get(key, "")):
                self._logs[key] = text
                self._logs.move_to_end(key)
            while len(self._logs) > self._max_logs:
                self._logs.popitem(last=False)
            return self._logs.get(key, text)

    def last_log(self, key: tuple[str, str]) -> str | None:
        with self._lock:
            return self._logs.get(key)


class Subscribers:
    """The watchers a backend wakes on every informer change (see jobs.PushesChanges)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wakes: list[Callable[[], None]] = []

    def add(self, wake: Callable[[], None]) -> None:
        with self._lock:
            self._wakes.append(wake)

    def remove(self, wake: Callable[[], None]) -> bool:
        """Forget `wake`; True when nobody listens any more (time to stop the informers)."""
        with self._lock:
            if wake in self._wakes:
                self._wakes.remove(wake)
            return not self._wakes

    def wake_all(self, *_event: object) -> None:
        """An Informer on_change callback: wake every subscriber."""
        with self._lock:
            wakes = list(self._wakes)
        for wake in wakes:
            wake()
