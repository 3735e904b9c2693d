"""The HTTP front of a replicated server: an ASGI app, served by uvicorn in the `understudy
serve` process, that forwards each request to an engine replica through Ray Serve.

It reads a request's body (at most `max_body_bytes` + 1 bytes: the replica's own guard then
refuses a larger one with 413, as on one machine; one that takes longer than
`body_timeout_s` gets 408, as there), hands it to a replica through the
deployment's handle (Ray Serve's router picks the less loaded of two replicas) and relays
the replica's ASGI messages as they come, tokens of a stream included. A client that leaves
cancels the call, and with it the replica's engine job.

Failures of the replica, not of the request, become retryable errors; nothing hangs:
- the replica died (or became unreachable) before the response began: 503 with
  `Retry-After`, code "replica_unavailable"; the router already sends new requests to the
  other replicas, and Ray Serve starts a replacement;
- it died while a token stream was under way: the stream ends with an error event carrying
  the same 503 envelope, then `data: [DONE]` (the status line has gone out already);
- every replica is busy and Ray Serve's queue for the deployment is full: 429 with
  `Retry-After`, code "queue_full", as the single-process server answers a full queue.

GET /metrics is answered here: every live replica's metrics, labelled (replica_metrics.py),
behind the API key unless `public_metrics`, as on one machine.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from understudy.server.protocol import APIError, as_api_error, sse
from understudy.server.replica import HTTPRequest
from understudy.server.replica_metrics import merged_exposition

log = logging.getLogger("understudy.server")

RETRY_AFTER_S = 1  # the other replicas serve a retry at once; a lost one restarts meanwhile
METRICS_CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"


def replica_lost(detail: str) -> APIError:
    return APIError(
        503,
        f"the replica serving this request stopped ({detail}); retry the request",
        kind="service_unavailable",
        code="replica_unavailable",
    )


def key_missing() -> APIError:
    return APIError(
        401,
        "missing or invalid API key: send the header 'Authorization: Bearer <key>'",
        kind="authentication_error",
        code="invalid_api_key",
    )


def body_late(seconds: float) -> APIError:
    return APIError(408, f"the request body did not arrive within {seconds:g} s", code="timeout")


def busy() -> APIError:
    return APIError(
        429,
        "the server is busy: every replica is full and the queue for them too; retry later",
        kind="rate_limit_error",
        code="queue_full",
    )


class _Exchange:
    """How far one forwarded response got: its status line sent; its last body part sent."""

    def __init__(self) -> None:
        self.started = False
        self.complete = False


class Front:
    """ASGI app: forwards HTTP requests to `handle` (a DeploymentHandle of EngineReplica)."""

    def __init__(
        self,
        handle: Any,
        board: Any,
        replica_count: Callable[[], Awaitable[int]],
        *,
        api_key: str | None,
        public_metrics: bool,
        max_body_bytes: int,
        body_timeout_s: float,
    ) -> None:
        self.handle = handle.options(stream=True)
        self.board = board
        self.replica_count = replica_count
        self.api_key = api_key
        self.public_metrics = public_metrics
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.unavailable = 0  # requests lost with their replica (see module docstring)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":  # no websocket route exists
            await send({"type": "websocket.close", "code": 1000})
            return
        if scope["path"] == "/metrics" and scope["method"] in ("GET", "HEAD"):
            if self.api_key is None or self.public_metrics or self._key_given(scope):
                await self._metrics(send)
            else:
                await _send_error(send, key_missing(), retry=False)
            return
        try:
            body = await asyncio.wait_for(self._read_body(receive), self.body_timeout_s)
        except TimeoutError:
            await _send_error(send, body_late(self.body_timeout_s), retry=False)
            return
        if body is None:
            return  # the client left before its request was whole
        await self._forward(HTTPRequest.from_scope(scope, body), receive, send)

    def _key_given(self, scope: dict) -> bool:
        """The replicas' rule (guard.py), for the one route answered here."""
        assert self.api_key is not None
        for name, value in scope["headers"]:
            if name.lower() == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and hmac.compare_digest(
                    token.strip().encode("latin-1"), self.api_key.encode()
                )
        return False

    async def _read_body(self, receive: Any) -> bytes | None:
        """The body, cut at max_body_bytes + 1 (enough for the replica's guard to refuse it
        with 413); None if the client left."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            chunks.append(chunk)
            size += len(chunk)
            if size > self.max_body_bytes or not message.get("more_body", False):
                return b"".join(chunks)[: self.max_body_bytes + 1]

    async def _forward(self, request: HTTPRequest, receive: Any, send: Any) -> None:
        """Relay one replica's answer; if the client leaves first, cancel the call."""
        responses = self.handle.forward.remote(request)
        exchange = _Exchange()
        relaying = asyncio.ensure_future(self._relay(responses, send, exchange))
        leaving = asyncio.ensure_future(_disconnected(receive))
        client_left = False
        try:
            await asyncio.wait({relaying, leaving}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            leaving.cancel()
            if not relaying.done() and not exchange.complete:
                client_left = True
                responses.cancel()
                relaying.cancel()
        if client_left:
            await asyncio.gather(relaying, return_exceptions=True)  # let it unwind
        else:
            await relaying  # its own errors surface here

    async def _relay(self, responses: Any, send: Any, exchange: _Exchange) -> None:
        from ray.exceptions import RayActorError, RayTaskError
        from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

        streaming = False
        try:
            async for message in responses:
                if message["type"] == "http.response.start":
                    exchange.started = True
                    headers = dict(message.get("headers", []))
                    streaming = headers.get(b"content-type", b"").startswith(b"text/event-stream")
                last = message["type"] == "http.response.body" and not message.get("more_body")
                exchange.complete = last
                await send(message)
                if last:
                    return
        except BackPressureError:
            exchange.complete = True
            await _send_error(send, busy())
        except (RayActorError, DeploymentUnavailableError) as error:
            self.unavailable += 1
            exchange.complete = True
            lost = replica_lost(type(error).__name__)
            if not exchange.started:
                await _send_error(send, lost)
            elif streaming:
                tail = sse(lost.body()) + sse("[DONE]")
                await send({"type": "http.response.body", "body": tail, "more_body": False})
            else:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except RayTaskError as error:  # the replica's own code failed, not the request's
            log.error("forwarding failed", exc_info=error)
            exchange.complete = True
            if not exchange.started:
                await _send_error(send, as_api_error(error), retry=False)
            else:
                await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _metrics(self, send: Any) -> None:
        texts = await self.board.texts.remote()
        body = merged_exposition(texts, await self.replica_count(), self.unavailable)
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", METRICS_CONTENT_TYPE),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


async def _disconnected(receive: Any) -> None:
    """Returns when the client has gone (uvicorn also says so once the response is sent)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _lifespan(receive: Any, send: Any) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def _send_error(send: Any, error: APIError, retry: bool = True) -> None:
    body = json.dumps(error.body()).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    if retry:
        headers.append((b"retry-after", str(RETRY_AFTER_S).encode()))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
