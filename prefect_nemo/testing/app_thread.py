"""An aiohttp application served on 127.0.0.1 (a free port) from its own event-loop thread:
the one way the loopback servers (Kubernetes, run:ai, Lepton) run beside synchronous tests."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import threading
from collections.abc import Awaitable, Callable

from aiohttp import web


class AppThread:
    """Serve one aiohttp application from a daemon thread until `stop()`."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None

    @property
    def running(self) -> bool:
        """True between start() and stop()."""
        return self._thread is not None

    def start(
        self, app: Callable[[], web.Application], ssl_context: ssl.SSLContext | None = None
    ) -> int:
        """Build the app on the loop, serve it, and return its port (start-up errors raise)."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        loop = asyncio.new_event_loop()
        ready = threading.Event()
        failure: list[BaseException] = []

        async def boot() -> None:
            self._runner = web.AppRunner(app(), access_log=None, shutdown_timeout=1.0)
            await self._runner.setup()
            await web.SockSite(self._runner, sock, ssl_context=ssl_context).start()

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(boot())
            except BaseException as exc:  # surfaced to start()
                failure.append(exc)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.close()

        self.loop = loop
        self._thread = threading.Thread(target=run, name=self.name, daemon=True)
        self._thread.start()
        ready.wait(30)
        if failure:
            raise failure[0]
        return sock.getsockname()[1]

    def stop(self, before_cleanup: Callable[[], Awaitable[None]] | None = None) -> None:
        """Run `before_cleanup` on the loop, close the server, end the handlers of connections
        clients keep open (watches, log streams), and end the thread."""
        if self._thread is None or self.loop is None:
            return
        loop = self.loop

        async def shutdown() -> None:
            if before_cleanup is not None:
                await before_cleanup()
            if self._runner is not None:
                await self._runner.cleanup()
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in rest:
                task.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(shutdown(), loop).result(15)
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(15)
        self._thread = None
        self.loop = None
