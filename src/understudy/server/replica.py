"""One engine replica on Ray Serve: the whole single-process server, one HTTP request at a time.

Each replica loads its engine once, in its constructor, and builds the same FastAPI app that
`understudy serve` runs on one machine (`create_app`), with its worker thread. The front
(front.py) hands a replica one request as an `HTTPRequest` and relays, in order, the ASGI
messages the app sends back (`EngineReplica.forward`, called through a DeploymentHandle with
streaming on). So every route, validation error, 429 and token stream is the single-process
server's own, and a request's answer does not depend on which replica served it: each runs
the same weights through the same code, and greedy or seeded sampling gives the same tokens.

Every response carries the header `x-understudy-replica` naming the replica that served it.
The replica publishes its Prometheus text to a `MetricsBoard` (replica_metrics.py) before
each response's last message (so a finished generation is counted by the time its client
has the answer) and every `PUBLISH_EVERY_S` if it changed (gauges, request counts); GET
/metrics at the front shows each running replica under a `replica` label. /health adds
`"replicas"`: the replicas Ray Serve reports running.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("understudy.server")

APP_NAME = "understudy"  # the Serve application `understudy serve --replicas` deploys
DEPLOYMENT_NAME = "engine"  # its one deployment, of EngineReplica
SERVE_NAMESPACE = "serve"  # the Ray namespace Ray Serve creates its replica actors in

REPLICA_HEADER = b"x-understudy-replica"
PUBLISH_EVERY_S = 1.0  # how stale a replica's gauges at GET /metrics may be


@dataclass(frozen=True)
class ReplicaSpec:
    """What every replica builds: `Engine.from_pretrained(**engine)`, then
    `create_app(engine, **app)`. Plain data, so Ray can ship it to any node."""

    engine: dict[str, Any]
    app: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class HTTPRequest:
    """One HTTP request, read whole by the front, as plain data (an ASGI scope plus body)."""

    method: str
    path: str
    raw_path: bytes
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    client: tuple[str, int] | None = None
    server: tuple[str, int] | None = None
    scheme: str = "http"
    http_version: str = "1.1"

    @classmethod
    def from_scope(cls, scope: dict[str, Any], body: bytes) -> HTTPRequest:
        return cls(
            method=scope["method"],
            path=scope["path"],
            raw_path=scope.get("raw_path") or scope["path"].encode(),
            query_string=scope.get("query_string", b""),
            headers=[(bytes(k), bytes(v)) for k, v in scope["headers"]],
            body=body,
            client=tuple(scope["client"]) if scope.get("client") else None,
            server=tuple(scope["server"]) if scope.get("server") else None,
            scheme=scope.get("scheme", "http"),
            http_version=scope.get("http_version", "1.1"),
        )

    def scope(self) -> dict[str, Any]:
        return {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": self.http_version,
            "method": self.method,
            "scheme": self.scheme,
            "path": self.path,
            "raw_path": self.raw_path,
            "query_string": self.query_string,
            "root_path": "",
            "headers": list(self.headers),
            "client": self.client,
            "server": self.server,
            "state": {},
        }


async def relay(
    app: Any,
    request: HTTPRequest,
    replica: str,
    before_last: Callable[[], Awaitable[None]],
) -> AsyncIterator[dict[str, Any]]:
    """Run `request` through the ASGI `app`; yield each message it sends, up to and including
    the last body message, awaiting `before_last()` just before that one.

    After the body, the app's `receive` waits for the consumer to go: if this generator is
    closed or cancelled early (the client left, and Ray cancels the call), the app receives
    `http.disconnect` and is cancelled, so its handlers cancel their engine jobs exactly as
    they do when a client leaves a single-process server."""
    sent: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    gone = asyncio.Event()
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            headers = [*message.get("headers", []), (REPLICA_HEADER, replica.encode())]
            message = {**message, "headers": headers}
        await sent.put(message)

    task = asyncio.ensure_future(app(request.scope(), receive, send))
    complete = False
    try:
        while True:
            message = await _next_message(sent, task)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                await before_last()
                complete = True
                yield message
                return
            yield message
    finally:
        gone.set()
        if complete:
            with contextlib.suppress(Exception):
                await task  # the app returns once its response is sent
        elif not task.done():
            task.cancel()
        elif not task.cancelled() and task.exception() is not None:
            log.error("the app failed", exc_info=task.exception())


async def _next_message(sent: asyncio.Queue[dict[str, Any]], task: asyncio.Future) -> dict:
    """The app's next message; raises the app's own error if it ends without one."""
    getter = asyncio.ensure_future(sent.get())
    try:
        await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not getter.done():
            getter.cancel()
    if getter.done() and not getter.cancelled():
        return getter.result()
    if not sent.empty():
        return sent.get_nowait()
    task.result()  # raises what the app raised
    raise RuntimeError("the app returned without completing its response")


def running_replicas() -> int:
    """Replicas of the engine deployment that Ray Serve reports RUNNING (a controller call)."""
    from ray import serve

    application = serve.status().applications.get(APP_NAME)
    if application is None or DEPLOYMENT_NAME not in application.deployments:
        return 0
    return application.deployments[DEPLOYMENT_NAME].replica_states.get("RUNNING", 0)


class EngineReplica:
    """A Ray Serve deployment class: one engine, its worker thread and its app.

    Deployed by replicas.py with `serve.deployment(EngineReplica, ...)`; Ray Serve restarts a
    replica whose process dies, and its router stops sending requests to it once the death
    is known (the front turns requests lost with it into retryable 503s)."""

    async def __init__(self, spec: ReplicaSpec, board: Any) -> None:
        import ray
        from ray import serve

        from understudy.engine.engine import Engine
        from understudy.server.app import create_app

        self.name = serve.get_replica_context().replica_id.unique_id
        self._actor_name = ray.get_runtime_context().get_actor_name()
        self._board = board
        engine = await asyncio.to_thread(Engine.from_pretrained, **spec.engine)
        self.app = create_app(engine, **spec.app, replicas=self.running_replicas)
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()  # starts the worker thread
        self._publisher = asyncio.ensure_future(self._publish())
        self._publisher.add_done_callback(_log_failure)

    async def forward(self, request: HTTPRequest) -> AsyncIterator[dict[str, Any]]:
        """Serve one HTTP request; yields its ASGI response messages (call with stream=True)."""
        async for message in relay(self.app, request, self.name, self._publish_now):
            yield message

    async def running_replicas(self) -> int:
        """Replicas of this deployment that Ray Serve reports RUNNING (this one included)."""
        return await asyncio.to_thread(running_replicas)

    async def _publish_now(self) -> None:
        """Put this replica's metrics on the board and wait until they are there. Called
        before a response's last message leaves: a finished generation is counted at
        GET /metrics by the time its client has the whole answer."""
        await self._board.put.remote(self.name, self._actor_name, SERVE_NAMESPACE, self._render())

    async def _publish(self) -> None:
        """Put this replica's metrics on the board whenever they changed (the gauges and
        request counts that change after a response)."""
        last = b""
        while True:
            text = self._render()
            if text != last:
                self._board.put.remote(self.name, self._actor_name, SERVE_NAMESPACE, text)
                last = text
            await asyncio.sleep(PUBLISH_EVERY_S)

    def _render(self) -> bytes:
        worker = self.app.state.worker
        return self.app.state.metrics.render(worker.running, worker.waiting)

    async def __del__(self) -> None:
        """Ray Serve's graceful stop: the requests in flight have finished; stop the worker."""
        self._publisher.cancel()
        await self._lifespan.__aexit__(None, None, None)


def _log_failure(task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("publishing metrics stopped", exc_info=task.exception())
