"""The outermost layer of the server: API key, request body size, request counting.

A pure ASGI middleware, so it runs before FastAPI parses anything: a request without the
key gets 401 even when its body is not JSON, and an oversized body is refused (413)
without being buffered whole.
"""

from __future__ import annotations

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
PROTECTED_PREFIXES = ("/v1/", "/lab/api/run")  # need the API key when one is set


class Guard:
    """Checks the API key and the body size, counts requests by route and status."""

    def __init__(
        self, app: Any, *, api_key: str | None, max_body_bytes: int, metrics: Metrics
    ) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics

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
        if self.api_key and path.startswith(PROTECTED_PREFIXES):
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode(), self.api_key.encode()
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
        while more:
            message = await receive()
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
    body = json.dumps(error.body()).encode()
    await send(
        {
            "type": "http.response.start",
            "status": error.status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
