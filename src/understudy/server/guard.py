"""The outermost layer of the server: API key, request body size and time, request counting,
and the time a connection may take to send its request head.

`Guard` is a pure ASGI middleware, so it runs before FastAPI parses anything: a request
without the key gets 401 even when its body is not JSON, an oversized body is refused (413)
without being buffered whole, and a body that has not fully arrived `body_timeout_s` after
the request began gets 408. The key guards /v1, the Lab's API and /metrics (unless
`public_metrics`); /health and the Lab's page stay open.

The request head (request line and headers) is read by uvicorn before any ASGI code runs,
so its time limit lives in the protocol: `head_timeout_protocol` closes a connection that
has not sent a complete head `timeout_s` after it opened or after its previous response.
Together with uvicorn's keep-alive timeout, no connection can stay open for nothing.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from typing import Any

from understudy.server.metrics import Metrics
from understudy.server.protocol import APIError

KNOWN_ROUTES = (
    "/health",
    "/metrics",
    "/v1/models",
    "/v1/completions",
    "/v1/chat/completions",
    "/lab",
    "/lab/api/info",
    "/lab/api/run",
    "/lab/api/theory",
    "/lab/api/alpha",
)
PROTECTED_PREFIXES = ("/v1/", "/lab/api/")  # need the API key when one is set
METRICS_PATH = "/metrics"  # needs it too, unless the metrics are public
DEFAULT_BODY_TIMEOUT_S = 30.0  # a 1 MiB body in 30 s needs 35 kB/s
DEFAULT_HEAD_TIMEOUT_S = 10.0


def api_key_problem(api_key: str | None) -> str | None:
    """Why `api_key` cannot work, or None. Clients send it in an HTTP header, which carries
    visible ASCII only: any other key is never matched, so it is refused up front."""
    if api_key is None:
        return None
    if not api_key:
        return "the API key is empty: give a key or none"
    if not all("!" <= ch <= "~" for ch in api_key):
        return (
            "the API key must be visible ASCII characters (no spaces, no non-ASCII letters): "
            "HTTP headers carry nothing else"
        )
    return None


class Guard:
    """Checks the API key, the body's size and time, counts requests by route and status."""

    def __init__(
        self,
        app: Any,
        *,
        api_key: str | None,
        max_body_bytes: int,
        metrics: Metrics,
        public_metrics: bool = False,
        body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    ) -> None:
        problem = api_key_problem(api_key)
        if problem is not None:
            raise ValueError(problem)
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics
        self.public_metrics = public_metrics
        self.body_timeout_s = body_timeout_s

    def _needs_key(self, path: str) -> bool:
        if self.api_key is None:
            return False
        if path == METRICS_PATH:
            return not self.public_metrics
        return path.startswith(PROTECTED_PREFIXES)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        route = path if path in KNOWN_ROUTES else "other"
        status_seen: list[int] = []

        async def send_counted(message: dict) -> None:
            if message["type"] == "http.response.start":
                status_seen.append(message["status"])
            await send(message)

        try:
            await self._guarded(scope, receive, send_counted, path)
        finally:
            if status_seen:
                self.metrics.request(route, status_seen[0])

    async def _guarded(self, scope: dict, receive: Any, send: Any, path: str) -> None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.api_key is not None and self._needs_key(path):
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode("latin-1"), self.api_key.encode()
            ):
                error = APIError(
                    401,
                    "missing or invalid API key: send the header 'Authorization: Bearer <key>'",
                    kind="authentication_error",
                    code="invalid_api_key",
                )
                await _send_error(send, error)
                return
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            await _send_error(send, self._too_large())
            return
        # Read the body here (bounded), then hand it to the app in one piece.
        chunks: list[bytes] = []
        size = 0
        more = scope["method"] not in ("GET", "HEAD")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout_s
        while more:
            try:
                message = await asyncio.wait_for(receive(), deadline - loop.time())
            except TimeoutError:
                error = APIError(
                    408,
                    f"the request body did not arrive within {self.body_timeout_s:g} s",
                    code="timeout",
                )
                await _send_error(send, error)
                return
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await _send_error(send, self._too_large())
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _too_large(self) -> APIError:
        return APIError(
            413, f"the request body is larger than {self.max_body_bytes} bytes", code="too_large"
        )


async def _send_error(send: Any, error: APIError) -> None:
    """The error as OpenAI's envelope. A 408 or 413 leaves a body unread: the connection
    closes after it, since what follows on it is no request."""
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if error.status in (408, 413):
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def head_timeout_protocol(timeout_s: float) -> type:
    """uvicorn's h11 HTTP protocol, closing a connection whose request head has not fully
    arrived `timeout_s` after the connection opened or after its previous response ended
    (uvicorn itself waits for a head forever: a client that sends nothing, or a byte a
    minute, would hold its connection open). Pass it as uvicorn's `http`."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeadTimeoutH11Protocol(H11Protocol):
        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_head_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_head_timer()

        def _arm_head_timer(self) -> None:
            if self.transport.is_closing():
                return
            if self.cycle is not None and not self.cycle.response_complete:
                return  # a pipelined request is under way: its head is in
            waiting_after = self.cycle  # a complete head replaces the cycle
            self.loop.call_later(timeout_s, self._head_timed_out, waiting_after)

        def _head_timed_out(self, waiting_after: Any) -> None:
            if self.cycle is waiting_after and not self.transport.is_closing():
                self.transport.close()

    return HeadTimeoutH11Protocol
