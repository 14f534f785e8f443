"""The log pump: streams the logs of every followed job into sinks, on one asyncio loop thread.

A follower delivers whole lines as a backend's `tail_logs` yields chunks; `finish()` stops the
stream and sends the rest from one full read, so nothing is lost when a stream broke or the job
ended between two chunks. The loop thread runs only while jobs are followed: it stops (and
joins the threads `asyncio.to_thread` started) when the last follower finishes. No Prefect here.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Callable

from prefect_nemo.jobs import Backend

log = logging.getLogger(__name__)

RETAIL_PAUSE_S = 1.0  # Ray may close a log stream while the job still runs: tail it again


class LogFollower:
    """Sends a job's log lines to a sink as they stream; `finish` completes it exactly once."""

    def __init__(self, backend: Backend, job_id: str, sink: Callable[[str], None]) -> None:
        self.backend = backend
        self.job_id = job_id
        self._sink = sink
        self._lock = threading.Lock()
        self._emitted = 0  # characters of the log whose lines reached the sink
        self._closed = False
        self._future: concurrent.futures.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the pump's, while it streams

    def deliver(self, line: str, upto: int) -> None:
        """Pass one streamed line on (ignored once finished); `upto` = log offset after it."""
        with self._lock:
            if not self._closed:
                self._sink(line)
                self._emitted = upto

    def finish(self) -> str | None:
        """Stop streaming and send the rest of the log from one full read (nothing lost).

        Returns that whole log (None if it could not be read), so callers need not read it again.
        """
        with self._lock:
            self._closed = True
            emitted = self._emitted
        self._stop_stream()
        try:
            whole = self.backend.logs(self.job_id)
        except Exception as exc:
            log.debug("could not read the rest of the log of %s: %s", self.job_id, exc)
            return None
        for line in whole[emitted:].splitlines():
            self._sink(line)
        return whole

    def _stop_stream(self) -> None:
        """Cancel the stream on the pump's loop: cancelled here, its future would run the
        pump's callbacks in this thread, and the last follower's would stop the loop before the
        next one asked that loop to cancel the stream ("Event loop is closed" in the log)."""
        future, loop = self._future, self._loop
        if future is None or loop is None or future.done():
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: the stream ended with it
            loop.call_soon_threadsafe(future.cancel)


class LogPump:
    """Runs the followers' streams on one event loop thread, alive while any job is followed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._following = 0

    def follow(
        self,
        backend: Backend,
        job_id: str,
        sink: Callable[[str], None],
        is_done: Callable[[], bool],
    ) -> LogFollower:
        """Start streaming job_id's log lines into sink; call `finish()` when the job ended."""
        follower = LogFollower(backend, job_id, sink)
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(
                    target=_serve, args=(self._loop,), name="prefect-nemo-logs", daemon=True
                )
                self._thread.start()
            self._following += 1
            loop = self._loop
            future = asyncio.run_coroutine_threadsafe(_pump(follower, is_done), loop)
        follower._future, follower._loop = future, loop
        future.add_done_callback(self._done)
        return follower

    def _done(self, _future: concurrent.futures.Future[None]) -> None:
        with self._lock:
            self._following -= 1
            if self._following or self._loop is None:
                return
            loop, self._loop, self._thread = self._loop, None, None
        loop.call_soon_threadsafe(loop.stop)  # the thread closes the loop on its way out

    def close(self, timeout_s: float = 5.0) -> None:
        """Cancel every stream and stop the loop thread (at interpreter exit, or in tests)."""
        with self._lock:
            loop, thread = self._loop, self._thread
            self._loop, self._thread, self._following = None, None, 0
        if loop is None or thread is None:
            return
        loop.call_soon_threadsafe(_cancel_all, loop)
        thread.join(timeout_s)


def _serve(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
        _cancel_all(loop)
        # the streams' asyncio.to_thread workers are ours too: join them before the loop goes
        loop.run_until_complete(loop.shutdown_default_executor())
    finally:
        loop.close()


def _cancel_all(loop: asyncio.AbstractEventLoop) -> None:
    tasks = asyncio.all_tasks(loop)
    for task in tasks:
        task.cancel()
    if loop.is_running():
        loop.stop()
    elif tasks:
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))


async def _pump(follower: LogFollower, is_done: Callable[[], bool]) -> None:
    delivered = 0  # characters received: a re-tail starts from the top of the log
    line_start = 0  # log offset where `pending` begins
    pending = ""
    while True:
        offset = 0
        try:
            async with contextlib.aclosing(follower.backend.tail_logs(follower.job_id)) as stream:
                async for chunk in stream:
                    end = offset + len(chunk)
                    if end > delivered:
                        pending += chunk[max(0, delivered - offset) :]
                        delivered = end
                        *lines, pending = pending.split("\n")
                        for line in lines:
                            line_start += len(line) + 1
                            follower.deliver(line, line_start)
                    offset = end
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the stream broke; the watcher decides whether the job is over
            log.debug("log stream of %s broke: %s", follower.job_id, exc)
        if is_done():
            return  # the partial last line is sent by finish() from a full read
        await asyncio.sleep(RETAIL_PAUSE_S)


log_pump = LogPump()
atexit.register(log_pump.close)
