"""A loopback TCP proxy that counts connections and can make its target unreachable."""

from __future__ import annotations

import asyncio
import contextlib
import threading


class TcpProxy:
    """Forwards 127.0.0.1:<port> to a target; `go_down()` refuses and cuts connections until
    `come_back()`. `connections` counts every accepted connection (one per HTTP request for
    clients without keep-alive, one per websocket)."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self.connections = 0
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._thread = threading.Thread(
            target=self._loop.run_forever, daemon=True, name="prefect-nemo-proxy"
        )

    @property
    def url(self) -> str:
        """The proxy's http URL."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> TcpProxy:
        """Start listening on a free port."""
        self._thread.start()
        self._run(self._listen())
        return self

    def go_down(self) -> None:
        """Refuse new connections and cut the open ones, as if the target died."""
        self._run(self._close())

    def come_back(self) -> None:
        """Accept connections again on the same port."""
        self._run(self._listen())

    def stop(self) -> None:
        """Close everything and end the proxy's thread."""
        self._run(self._close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self, coro: object) -> None:
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)  # type: ignore[arg-type]

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(
            self._handle, "127.0.0.1", self.port, reuse_address=True
        )
        self.port = self._server.sockets[0].getsockname()[1]

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for writer in list(self._writers):
            writer.close()
        self._writers.clear()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self._writers -= {writer, up_writer}
