"""The OpenAI-compatible HTTP server: `create_app(engine)` builds the FastAPI application.

Routes: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions
(`stream: true` answers with server-sent events, the last chunk carrying `usage` and the
speculative stats), GET /metrics (Prometheus text) and the Lab (/lab, see lab.py). Every
status a route can answer is in /openapi.json (openapi.py); no client input gives a 500.

Every response that generated text carries the request's speculative statistics, named as
in docs/design.md, under `metrics.speculative_decoding` (vLLM reports per-request
speculative metrics the same way).

The engine runs on one worker thread (worker.py); handlers only wait for its events. The
routes share one `ServedModel` (served.py); the generation routes are in completions.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from understudy.server.completions import add_completion_routes
from understudy.server.guard import DEFAULT_BODY_TIMEOUT_S, Guard, api_key_problem
from understudy.server.lab import add_lab_routes
from understudy.server.metrics import CONTENT_TYPE
from understudy.server.openapi import error_responses, plain_text
from understudy.server.protocol import APIError, as_api_error, validation_error
from understudy.server.served import ServedModel
from understudy.server.worker import Worker

log = logging.getLogger("understudy.server")

DEFAULT_MAX_QUEUE = 64
DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB: a full 4096-token context is ~20 kB of text


def create_app(
    engine: Any,
    *,
    api_key: str | None = None,
    max_queue: int = DEFAULT_MAX_QUEUE,
    model_name: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    public_metrics: bool = False,
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    replicas: Callable[[], Awaitable[int]] | None = None,
) -> FastAPI:
    """The ASGI application serving `engine` (an understudy Engine; it is used from one
    worker thread only). `model_name` is the id clients send as `model` (default:
    `served_name` of the target). With `api_key`, /v1, the Lab's API and /metrics (unless
    `public_metrics`) need it; an API key no HTTP client can send is a ValueError.
    `replicas` (set by replica.py when Ray Serve runs several copies of this app) counts the
    running copies for /health."""
    problem = api_key_problem(api_key)
    if problem is not None:
        raise ValueError(problem)
    served = ServedModel(engine, model_name or served_name(engine.target.name), max_queue)
    app = FastAPI(
        title="understudy", docs_url=None, redoc_url=None, lifespan=_lifespan(served.worker)
    )
    app.state.engine = engine
    app.state.worker = served.worker
    app.state.metrics = served.metrics
    app.state.model_name = served.name
    app.state.submit = served.submit
    add_error_handlers(app)
    auth = (401,) if api_key else ()
    add_info_routes(app, served, auth, () if public_metrics else auth, replicas)
    add_completion_routes(app, served, auth)
    add_lab_routes(
        app,
        engine,
        served.submit,
        served.metrics,
        model_name=served.name,
        auth_required=bool(api_key),
    )
    app.add_middleware(
        Guard,
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        metrics=served.metrics,
        public_metrics=public_metrics,
        body_timeout_s=body_timeout_s,
    )
    return app


def _lifespan(worker: Worker) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The worker thread runs while the app does."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        worker.start()
        yield
        # uvicorn has drained the HTTP requests (SIGTERM); let the thread finish and go.
        await asyncio.get_running_loop().run_in_executor(None, worker.stop, 30.0)

    return lifespan


def add_error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI's JSON error body: the API's own, validation (400), routing
    (404, 405 with its Allow header) and anything unforeseen (500, logged)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        error = validation_error(exc)
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = (
            f"no route {request.method} {request.url.path}"
            if exc.status_code in (404, 405)
            else str(exc.detail)
        )
        error = APIError(exc.status_code, message, kind=kind)
        # a 405 carries Starlette's `Allow` header (the methods the route takes)
        return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error", exc_info=exc)
        return JSONResponse(as_api_error(exc).body(), status_code=500)


def add_info_routes(
    app: FastAPI,
    served: ServedModel,
    auth: tuple[int, ...],
    metrics_auth: tuple[int, ...],
    replicas: Callable[[], Awaitable[int]] | None,
) -> None:
    """GET /health, /metrics, /v1/models and /v1/models/{id}. `auth` and `metrics_auth` are
    (401,) where an API key guards the route, else ()."""
    engine, worker, metrics = served.engine, served.worker, served.metrics

    @app.get("/health")
    async def health() -> dict[str, Any]:
        report = {
            "status": "ok",
            "model": served.name,
            "method": engine.method,
            "running": worker.running,
            "waiting": worker.waiting,
            "max_num_seqs": len(served.seats),
            "rows_last_pass": worker.rows_last_pass,
            "kv_bytes_per_seq": served.kv_per_seq,
        }
        if replicas is not None:  # served by Ray Serve: the replicas running now
            report["replicas"] = await replicas()
        return report

    @app.get(
        "/metrics",
        response_class=Response,
        responses={**plain_text("Prometheus text"), **error_responses(*metrics_auth)},
    )
    async def prometheus() -> Response:
        text = metrics.render(worker.running, worker.waiting)
        return Response(text, media_type=CONTENT_TYPE)

    @app.get("/v1/models", responses=error_responses(*auth))
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [served.model_card()]}

    @app.get("/v1/models/{model_id:path}", responses=error_responses(*auth, 404, 422))
    async def model(model_id: str) -> dict[str, Any]:
        served.check_model(model_id, "model_id")
        return served.model_card()


def served_name(target: str) -> str:
    """The model id for a target as it was given: a registry name or hub id stays as it is;
    a local file or directory is named by its base name (without a file's suffix), so no
    response shows a path of the server's disk."""
    path = Path(target).expanduser()
    if path.is_file():
        return path.stem
    if path.is_dir():
        return path.resolve().name
    return target
