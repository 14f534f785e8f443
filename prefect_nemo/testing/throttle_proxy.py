"""A loopback HTTP reverse proxy that answers 429/503 to chosen requests for a while, as a
gateway or rate limiter in front of a real server (the Ray dashboard) does."""

from __future__ import annotations

import aiohttp
from aiohttp import web

from prefect_nemo.testing.app_thread import AppThread

# hop-by-hop and re-encoded headers: aiohttp sets its own
_DROP = {"host", "content-length", "transfer-encoding", "connection", "content-encoding"}


class ThrottleProxy:
    """Forwards 127.0.0.1:<port> to `target`; `throttle(method, path, answers)` makes the next
    requests of that method and path get the given status codes (429 or 503) instead."""

    def __init__(self, target: str, retry_after_s: float | None = 1.0) -> None:
        self.target = target.rstrip("/")
        self.retry_after_s = retry_after_s
        self.pushed_back = 0  # answers given instead of forwarding
        self._plans: dict[tuple[str, str], list[int]] = {}
        self._server = AppThread("prefect-nemo-throttle-proxy")
        self._session: aiohttp.ClientSession | None = None
        self.port = 0

    @property
    def url(self) -> str:
        """The proxy's http URL."""
        return f"http://127.0.0.1:{self.port}"

    def throttle(self, method: str, path: str, answers: list[int]) -> None:
        """Answer the next len(answers) `method path` requests with these status codes."""
        self._plans[(method.upper(), path)] = list(answers)

    def __enter__(self) -> ThrottleProxy:
        self.port = self._server.start(self._app)
        return self

    def __exit__(self, *exc: object) -> None:
        async def close() -> None:
            if self._session is not None:
                await self._session.close()

        self._server.stop(close)

    def _app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        return app

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        plan = self._plans.get((request.method, request.path))
        if plan:
            status = plan.pop(0)
            self.pushed_back += 1
            headers = {}
            if self.retry_after_s is not None:
                headers["Retry-After"] = f"{self.retry_after_s:g}"
            return web.Response(status=status, text="slow down", headers=headers)
        if self._session is None:
            self._session = aiohttp.ClientSession(auto_decompress=False)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP}
        async with self._session.request(
            request.method,
            self.target + request.path_qs,
            headers=headers,
            data=await request.read(),
            allow_redirects=False,
        ) as upstream:
            body = await upstream.read()
            kept = {k: v for k, v in upstream.headers.items() if k.lower() not in _DROP}
            if enc := upstream.headers.get("Content-Encoding"):
                kept["Content-Encoding"] = enc  # forwarded as sent (not decompressed)
            return web.Response(status=upstream.status, body=body, headers=kept)
