"""One poller per cluster (and credentials) serves every job waited on in this process.

A waiting task registers its job with the cluster's watcher and blocks on a condition (or, on an
event loop, awaits an asyncio event that the watcher sets only when that job changed: a thousand
waits then hold no thread and wake nobody else). A backend that pushes changes (Kubernetes
informers) wakes the watcher's thread when a job changed, and the thread asks only about the
jobs that changed (plus new and missing ones), with a full pass every `max_interval_s` as the
safety net: a thousand idle jobs cost nothing. Any other backend (Ray Jobs) is polled for all
watched jobs in one call per tick (Ray: one `list_jobs`), so the request rate does not grow
with the number of jobs; its tick interval adapts to the youngest live job: fast while jobs
are young (short jobs finish soon), slower for long-running ones. `wait_until_terminal` (and
its `_async` twin) is the one wait for a job to end on it. No Prefect import here.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime

from prefect_nemo.errors import (
    AuthenticationFailed,
    BackendClosed,
    BackendUnavailable,
    JobInterrupted,
    JobStalled,
    JobTimedOut,
    QueueTimedOut,
)
from prefect_nemo.jobs import Backend, JobHandle, JobState, JobStatus, PushesChanges

log = logging.getLogger(__name__)

MIN_INTERVAL_S = 0.1
AGE_FACTOR = 0.05  # poll every 5% of the youngest live job's age...
MISSING_TICKS = 3  # ...and call a job gone after it is missing from this many lists in a row
# A polled backend that is slow to answer is busy with us a bounded share of the time: a poll's
# first POLL_ALLOWANCE_S are free, and each second past them holds the next poll back
# POLL_COST_FACTOR seconds, a new job's wake-up included. Ray's list_jobs returns every job the
# cluster ever ran (ray#55010): at 200 jobs, a poll every 0.1 s plus one per submission kept
# its dashboard busy on 2 cores; a 1 s list now allows one poll every 9.5 s (under 10 % busy).
# The allowance is what a few jobs asked one by one take on a loaded machine (50-80 ms on
# 2 busy cores): held back 10x its whole cost, such a poll delayed a job's end 0.5 s.
# (Pushed changes are read from a local cache: no bound.)
POLL_COST_FACTOR = 10.0
POLL_ALLOWANCE_S = 0.05


class ClusterWatcher:
    """Polls one cluster for all watched jobs and wakes the waiters whose job changed."""

    def __init__(
        self,
        backend: Backend,
        *,
        max_interval_s: float = 2.0,
        unreachable_budget_s: float = 120.0,
    ) -> None:
        self.backend = backend
        self.max_interval_s = max_interval_s
        self.unreachable_budget_s = unreachable_budget_s
        self._cond = threading.Condition()
        self._refs: Counter[str] = Counter()
        self._latest: dict[str, JobStatus] = {}
        self._missing: Counter[str] = Counter()
        self._phase_since: dict[str, tuple[JobState, float]] = {}  # live state, first seen at
        self._error: BackendUnavailable | None = None
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        # async waiters by job: woken (on their own loop) when that job's status changes
        self._async_waiters: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Event]]] = {}
        self.ticks = 0  # polls made; read by tests and benchmarks

    @contextmanager
    def watching(self, job_id: str) -> Iterator[None]:
        """Keep job_id in the poll set while the block runs."""
        with self._cond:
            self._refs[job_id] += 1
            if self._thread is None:
                self._error = None
                self._thread = threading.Thread(
                    target=self._run, name=f"prefect-nemo-watch {self.backend.cluster}", daemon=True
                )
                self._thread.start()
        self._wake.set()  # a new job: poll now rather than at the end of a long interval
        try:
            yield
        finally:
            with self._cond:
                self._refs[job_id] -= 1
                if self._refs[job_id] <= 0:
                    del self._refs[job_id]
                    self._latest.pop(job_id, None)
                    self._missing.pop(job_id, None)
                    self._phase_since.pop(job_id, None)

    @property
    def idle(self) -> bool:
        """No poll running: never started, every wait ended, or failed."""
        with self._cond:
            return self._thread is None

    def latest(self, job_id: str) -> JobStatus | None:
        """The last status seen for job_id (None before the first poll)."""
        with self._cond:
            return self._latest.get(job_id)

    def next_status(
        self, job_id: str, seen: JobStatus | None, timeout_s: float
    ) -> JobStatus | None:
        """Block until job_id's status differs from `seen` or timeout; return the latest.

        Raises BackendUnavailable once the cluster has been unreachable past the budget.
        """
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                if (current := self._settled(job_id, seen)) is not None:
                    return current
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return self._latest.get(job_id)
                self._cond.wait(remaining)

    async def next_status_async(
        self, job_id: str, seen: JobStatus | None, timeout_s: float
    ) -> JobStatus | None:
        """`next_status` for a coroutine: awaits without holding a thread; woken only when
        job_id's status changes (or the watcher fails)."""
        loop = asyncio.get_running_loop()
        event = asyncio.Event()
        with self._cond:
            if (early := self._settled(job_id, seen)) is not None:
                return early
            waiter = (loop, event)
            self._async_waiters.setdefault(job_id, []).append(waiter)
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await event.wait()
        finally:
            with self._cond:
                waiters = self._async_waiters.get(job_id, [])
                if waiter in waiters:
                    waiters.remove(waiter)
                if not waiters:
                    self._async_waiters.pop(job_id, None)
        with self._cond:
            if self._error is not None:
                raise type(self._error)(str(self._error))
            return self._latest.get(job_id)

    def _settled(self, job_id: str, seen: JobStatus | None) -> JobStatus | None:
        """The new status if job_id already changed since `seen` (raises the watcher's
        error); None to wait. Call with the lock held."""
        if self._error is not None:
            raise type(self._error)(str(self._error))
        current = self._latest.get(job_id)
        return current if current is not None and _changed(current, seen) else None

    def _wake_async(self, job_ids: Iterable[str]) -> None:
        """Set the events of these jobs' async waiters, each on its loop. Lock held."""
        for job_id in job_ids:
            for loop, event in self._async_waiters.get(job_id, ()):
                with contextlib.suppress(RuntimeError):  # its loop closed: nobody waits
                    loop.call_soon_threadsafe(event.set)

    def close(self) -> None:
        """Stop polling: waiters get BackendClosed at once and the thread ends."""
        self._fail(BackendClosed(f"stopped watching {self.backend.cluster}: the watcher closed"))
        self._wake.set()

    # -- the polling thread -----------------------------------------------------------------

    def _run(self) -> None:
        # a backend that pushes changes (a Kubernetes watch) wakes us at once and says which
        # jobs changed; statuses() then reads its cache, so the ticks below cost no requests
        pushes = self.backend if isinstance(self.backend, PushesChanges) else None
        unsubscribe = pushes.subscribe(self._pushed) if pushes is not None else None
        try:
            self._poll(pushes)
        finally:
            if unsubscribe is not None:
                unsubscribe()

    def _pushed(self) -> None:
        """A change, or the backend's close, was pushed: wake the poll. Under the lock a failed
        poll holds while it decides to warn, so a close() returns after that warning, never
        before it (nothing is logged once the backend is closed)."""
        with self._cond:
            self._wake.set()

    def _poll(self, pushes: PushesChanges | None) -> None:
        failing_since: float | None = None
        failures = 0
        version, full_at = -1, 0.0  # the backend's change version seen; the last full pass
        not_before = 0.0  # the poll cost's bound on the next poll
        while True:
            with self._cond:
                while (left := not_before - time.monotonic()) > 0 and (
                    self._thread is threading.current_thread()
                ):
                    self._cond.wait(left)  # a close (_fail) notifies: it does not wait this out
                if self._thread is not threading.current_thread():  # closed, or failed
                    return
                job_ids = list(self._refs)
                if not job_ids:
                    self._thread = None
                    return
            seen = version
            if pushes is not None:  # asked before reading: a change meanwhile wakes us again
                version, changed = pushes.changed_since(version)
                if changed is not None and time.monotonic() - full_at < self.max_interval_s:
                    job_ids = self._due(job_ids, changed)
                else:
                    full_at = time.monotonic()
            polled_at = time.monotonic()
            try:
                statuses = self.backend.statuses(job_ids) if job_ids else {}
            except (AuthenticationFailed, BackendClosed) as exc:  # final: retrying cannot help
                self._fail(exc)
                return
            except Exception as exc:  # transport trouble: retry with backoff within the budget
                with self._cond:  # a close() meanwhile waits for this (see _pushed)
                    if getattr(self.backend, "closed", False):  # closed while it ran: final
                        closed = f"stopped watching {self.backend.cluster}: closed"
                        self._fail(BackendClosed(closed))
                        return
                    version = seen  # what changed meanwhile is asked again
                    failures += 1
                    failing_since = failing_since or time.monotonic()
                    down_for = time.monotonic() - failing_since
                    log.warning(
                        "polling %s failed (%s); retrying, down for %.0fs of a %.0fs budget",
                        self.backend.cluster,
                        exc,
                        down_for,
                        self.unreachable_budget_s,
                    )
                if down_for > self.unreachable_budget_s:
                    self._fail(
                        BackendUnavailable(
                            f"cluster {self.backend.cluster} was unreachable for {down_for:.0f}s "
                            f"(budget {self.unreachable_budget_s:.0f}s, raise unreachable_budget_s "
                            f"on the cluster block to wait longer); last error: {exc}"
                        )
                    )
                    return
                interval = min(0.25 * 2**failures, 5.0)
            else:
                failing_since, failures = None, 0
                self._publish(job_ids, statuses)
                interval = (
                    self.max_interval_s if pushes is not None else self._interval(statuses.values())
                )
            self.ticks += 1
            if pushes is None:
                took = time.monotonic() - polled_at
                pause = max(MIN_INTERVAL_S, POLL_COST_FACTOR * (took - POLL_ALLOWANCE_S))
                not_before = polled_at + min(pause, self.max_interval_s)
            self._wake.wait(interval)
            self._wake.clear()

    def _due(self, job_ids: list[str], changed: set[str]) -> list[str]:
        """Of the watched jobs, those to ask about: changed, not seen yet, or missing."""
        with self._cond:
            return [
                j for j in job_ids if j in changed or j not in self._latest or j in self._missing
            ]

    def _publish(self, job_ids: list[str], statuses: dict[str, JobStatus]) -> None:
        with self._cond:
            changed = []
            for job_id in job_ids:
                status = statuses.get(job_id)
                if status is None:
                    self._missing[job_id] += 1
                    if self._missing[job_id] >= MISSING_TICKS:
                        status = JobStatus(
                            job_id=job_id,
                            state=JobState.FAILED,
                            message="the job is no longer on the cluster (deleted by someone?)",
                        )
                else:
                    self._missing.pop(job_id, None)
                if status is not None and job_id in self._refs:
                    if _changed(status, self._latest.get(job_id)):
                        changed.append(job_id)
                    self._latest[job_id] = status
            self._cond.notify_all()
            self._wake_async(changed)

    def _fail(self, error: BackendUnavailable) -> None:
        with self._cond:
            self._error = error
            self._thread = None
            self._cond.notify_all()
            self._wake_async(list(self._async_waiters))
        if isinstance(error, BackendClosed):  # the next waiter gets a watcher of a live backend
            with _watchers_lock:
                for key in [k for k, w in _watchers.items() if w is self]:
                    del _watchers[key]

    def _interval(self, statuses: Iterable[JobStatus]) -> float:
        """Poll every AGE_FACTOR of the youngest live phase: a job that just started RUNNING
        (or was just submitted) is polled fast, since short jobs end soon; a job that has run
        for an hour is polled at max_interval_s. Ray's own start_time is the submission time,
        so the phase age is kept here, from when we first saw the job in its current state."""
        now = time.monotonic()
        ages = []
        with self._cond:
            for status in statuses:
                if status.state.is_terminal() or status.job_id not in self._refs:
                    continue
                phase = self._phase_since.get(status.job_id)
                if phase is None or phase[0] is not status.state:
                    phase = self._phase_since[status.job_id] = (status.state, now)
                ages.append(now - phase[1])
        youngest = min(ages, default=0.0)
        return min(self.max_interval_s, max(MIN_INTERVAL_S, youngest * AGE_FACTOR))


def _changed(current: JobStatus, seen: JobStatus | None) -> bool:
    """What wakes a waiter: a new state or message, news of its place in a queue, or new
    progress from its engine."""
    return seen is None or (current.state, current.message, current.queue, current.progress) != (
        seen.state,
        seen.message,
        seen.queue,
        seen.progress,
    )


def _never() -> str | None:
    return None


# -------------------------------------------------------------------------------------------------
# Waiting for one job to end, on the watcher


class JobClock:
    """Where one job's time goes while we watch it: active (PENDING or RUNNING: what
    `timeout_s` bounds) and queued (QUEUED: what `queue_timeout_s` bounds, each wait anew, and
    the queue wait a result reports). Queue time is not run time."""

    def __init__(self, now: datetime | None = None) -> None:
        self._since = now or datetime.now(UTC)  # when the current phase began
        self._state: JobState | None = None  # None before the first status (counted active)
        self._closed_active_s = 0.0
        self._closed_queued_s = 0.0
        self._closed_running_s = 0.0
        # RUNNING -> QUEUED transitions seen, or the engine's count of requeues if higher
        self.preemptions = 0
        self._steps_back = 0  # RUNNING -> QUEUED transitions seen
        self.last_wait_s: float | None = None  # the last wait in the queue that ended

    @property
    def state(self) -> JobState | None:
        """The state of the current phase (None before the first status)."""
        return self._state

    def observe(self, status: JobStatus, now: datetime | None = None) -> None:
        """Take a status: a new state closes the phase before it."""
        # A step back into the queue is a preemption; the engine's count of requeues, where it
        # keeps one, also tells of those that happened between two polls. Both count the same
        # preemptions, so the higher one is the count, never their sum: a count can come a poll
        # before the step it counts (CI: RUNNING with 1 requeue, then QUEUED with 1) or after.
        if status.state is JobState.QUEUED and self._state is JobState.RUNNING:
            self._steps_back += 1
        self.preemptions = max(self.preemptions, self._steps_back, status.requeues or 0)
        if status.state is self._state:
            return
        now = now or datetime.now(UTC)
        if self._state is None and status.start_time and not status.state.is_waiting():
            # first seen running (re-attached): the cluster's start bounds what ran before us,
            # so a re-attach never extends the timeout
            self._since = min(self._since, status.start_time)
        spent = max(0.0, (now - self._since).total_seconds())
        if self._state is JobState.QUEUED:
            self._closed_queued_s += spent
            self.last_wait_s = spent
        elif self._state is None or not self._state.is_terminal():
            self._closed_active_s += spent
            if self._state is JobState.RUNNING:
                self._closed_running_s += spent
        self._state, self._since = status.state, now

    def _current(self, now: datetime | None) -> float:
        return max(0.0, ((now or datetime.now(UTC)) - self._since).total_seconds())

    def active_s(self, now: datetime | None = None) -> float:
        """Seconds spent PENDING or RUNNING so far."""
        live = self._state is None or not (self._state is JobState.QUEUED or
                                           self._state.is_terminal())  # fmt: skip
        return self._closed_active_s + (self._current(now) if live else 0.0)

    def running_s(self, now: datetime | None = None) -> float:
        """Seconds seen RUNNING so far (what holds GPUs), every run together."""
        current = self._current(now) if self._state is JobState.RUNNING else 0.0
        return self._closed_running_s + current

    def queued_s(self, now: datetime | None = None) -> float:
        """Seconds spent QUEUED so far, every wait together."""
        current = self._current(now) if self._state is JobState.QUEUED else 0.0
        return self._closed_queued_s + current

    def this_wait_s(self, now: datetime | None = None) -> float | None:
        """Seconds of the current wait in the queue; None unless QUEUED."""
        return self._current(now) if self._state is JobState.QUEUED else None


class Silence:
    """How long a RUNNING job has said nothing (no log line, no report), checked on each tick
    of its wait: past `after_s` it is stalled, `on_stall(silent_s)` is told once, and with
    `stop` JobStalled is raised (the caller stops the job). A line ends the stall. The clock
    lives in the wait, which ticks every second anyway: no thread of its own. Silence counts
    only while the job runs: queued or starting, a job has nothing to say."""

    def __init__(
        self, after_s: float, on_stall: Callable[[float], None], *, stop: bool = False
    ) -> None:
        self.after_s, self.on_stall, self.stop = after_s, on_stall, stop
        self._last = time.monotonic()
        self.stalled = False

    def heard(self) -> None:
        """A line of the job's log (any thread): the silence, and any stall, ends."""
        self._last = time.monotonic()
        self.stalled = False

    def silent_s(self) -> float:
        """Seconds since the last line (or since the job was first seen running)."""
        return time.monotonic() - self._last

    def check(self, job_id: str, state: JobState | None) -> None:
        """One tick of the wait: tell a new stall; raise JobStalled when asked to stop."""
        if state is not JobState.RUNNING:
            self._last = time.monotonic()
            return
        silent = self.silent_s()
        if silent <= self.after_s or self.stalled:
            return
        self.stalled = True
        self.on_stall(silent)
        if self.stop:
            raise JobStalled(
                f"job '{job_id}' said nothing for {silent:.1f}s, past its stall_after_s of "
                f"{self.after_s:g}s: stopping it"
            )


class _TerminalWait:
    """The rules of waiting for one job, whoever waits (a thread or a coroutine): each new
    status is passed on once, a terminal one ends the wait, `interrupted()` and the timeouts
    raise: `timeout_s` bounds the time the job is active (not queued; from its start on the
    cluster when we attach to a running job, so re-attaching does not extend it),
    `queue_timeout_s` each wait in its scheduler's queue."""

    def __init__(
        self,
        handle: JobHandle,
        timeout_s: float | None,
        on_change: Callable[[JobStatus], None],
        interrupted: Callable[[], str | bool | None],
        queue_timeout_s: float | None = None,
        clock: JobClock | None = None,
        silence: Silence | None = None,
    ) -> None:
        self.handle, self.timeout_s, self.queue_timeout_s = handle, timeout_s, queue_timeout_s
        self.on_change, self.interrupted = on_change, interrupted
        self.clock = clock or JobClock()
        self.silence = silence
        self.seen: JobStatus | None = None

    def step(self, status: JobStatus | None) -> JobStatus | None:
        """Take the watcher's latest status: the terminal status, or None to wait on."""
        if status is not None and status != self.seen:
            self.seen = status
            self.clock.observe(status)
            self.on_change(status)
        if self.seen is not None and self.seen.state.is_terminal():
            return self.seen
        if reason := self.interrupted():
            raise JobInterrupted(
                self.handle.job_id,
                reason if isinstance(reason, str) else "the flow run is being cancelled",
            )
        if self.silence is not None:
            self.silence.check(self.handle.job_id, self.seen.state if self.seen else None)
        now = datetime.now(UTC)
        if self.timeout_s is not None and self.clock.active_s(now) > self.timeout_s:
            raise JobTimedOut(
                f"job '{self.handle.job_id}' ran past its timeout of {self.timeout_s:g}s: "
                "stopping it"
            )
        waited = self.clock.this_wait_s(now)
        if (
            self.queue_timeout_s is not None
            and waited is not None
            and (waited > self.queue_timeout_s)
        ):
            queue = self.seen.queue if self.seen else None
            where = queue.describe() if queue else "in its queue"
            raise QueueTimedOut(
                f"job '{self.handle.job_id}' waited {waited:.0f}s {where}, past its "
                f"queue_timeout_s of {self.queue_timeout_s:g}s: removing it from the queue"
            )
        return None


def wait_until_terminal(
    watcher: ClusterWatcher,
    handle: JobHandle,
    *,
    timeout_s: float | None = None,
    queue_timeout_s: float | None = None,
    on_change: Callable[[JobStatus], None] = lambda status: None,
    interrupted: Callable[[], str | bool | None] = _never,
    tick_s: float = 1.0,
    clock: JobClock | None = None,
    silence: Silence | None = None,
) -> JobStatus:
    """Block until the job is terminal, calling on_change once per observed change.

    `timeout_s` counts the time the job is active, not queued (from its start on the cluster
    when first seen running, so re-attaching after a crash does not extend it);
    `queue_timeout_s` each wait in its scheduler's queue; `clock` (optional) keeps the
    account; `silence` (optional) watches a running job for stalls. Raises JobTimedOut /
    QueueTimedOut / JobStalled (the caller stops the job), JobInterrupted when
    `interrupted()` gives a reason (or True: the run is being cancelled), or
    BackendUnavailable.
    """
    waiting = _TerminalWait(
        handle, timeout_s, on_change, interrupted, queue_timeout_s, clock, silence
    )
    with watcher.watching(handle.job_id):
        while True:
            # Bounded waits keep the thread responsive to signals (Prefect's cancellation).
            status = watcher.next_status(handle.job_id, waiting.seen, timeout_s=tick_s)
            if (final := waiting.step(status)) is not None:
                return final


async def wait_until_terminal_async(
    watcher: ClusterWatcher,
    handle: JobHandle,
    *,
    timeout_s: float | None = None,
    queue_timeout_s: float | None = None,
    on_change: Callable[[JobStatus], None] = lambda status: None,
    interrupted: Callable[[], str | bool | None] = _never,
    tick_s: float = 1.0,
    clock: JobClock | None = None,
    silence: Silence | None = None,
) -> JobStatus:
    """`wait_until_terminal` on an event loop: the wait holds no thread."""
    waiting = _TerminalWait(
        handle, timeout_s, on_change, interrupted, queue_timeout_s, clock, silence
    )
    with watcher.watching(handle.job_id):
        while True:
            status = await watcher.next_status_async(handle.job_id, waiting.seen, tick_s)
            if (final := waiting.step(status)) is not None:
                return final


# one watcher per cluster and credentials: a block saved with a new token (after a 401, or a
# test server on a reused port) is watched with it, never with an earlier backend's; and two
# blocks with their own rights on one cluster never poll with each other's
_watchers: dict[tuple[str, str], ClusterWatcher] = {}
_watchers_lock = threading.Lock()


def close_watchers() -> None:
    """Close every watcher of this process (at interpreter exit: no thread outlives its owner)."""
    with _watchers_lock:
        watchers = list(_watchers.values())
    for watcher in watchers:
        watcher.close()


atexit.register(close_watchers)


def watcher_for(
    backend: Backend, *, max_interval_s: float = 2.0, unreachable_budget_s: float = 120.0
) -> ClusterWatcher:
    """The process-wide watcher of backend's cluster and credentials (created on first use)."""
    key = (backend.cluster, backend.credentials_key)
    with _watchers_lock:
        watcher = _watchers.get(key)
        if watcher is None:
            # an idle watcher of other credentials on this cluster (a token since replaced)
            # serves nobody now: forgotten, not kept for the life of the process
            for stale in [k for k, w in _watchers.items() if k[0] == key[0] and w.idle]:
                del _watchers[stale]
            watcher = _watchers[key] = ClusterWatcher(
                backend, max_interval_s=max_interval_s, unreachable_budget_s=unreachable_budget_s
            )
        return watcher
