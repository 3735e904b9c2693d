"""The OpenAI-compatible HTTP server: `create_app(engine)` builds the FastAPI application.

Routes: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions
(`stream: true` answers with server-sent events, the last chunk carrying `usage` and the
speculative stats), GET /metrics (Prometheus text) and the Lab (/lab, see lab.py). Every
status a route can answer is in /openapi.json (openapi.py); no client input gives a 500.

Every response that generated text carries the request's speculative statistics, named as
in docs/design.md, under `metrics.speculative_decoding` (vLLM reports per-request
speculative metrics the same way).

The engine runs on one worker thread (worker.py); handlers only wait for its events.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from understudy.engine.seats import kv_bytes_per_seat
from understudy.server.choices import Assembly
from understudy.server.generation import account, batched_work, generation_work
from understudy.server.guard import DEFAULT_BODY_TIMEOUT_S, Guard, api_key_problem
from understudy.server.logprobs import TokenStrings
from understudy.server.metrics import CONTENT_TYPE, Metrics
from understudy.server.openapi import (
    error_responses,
    event_stream,
    plain_text,
    request_examples,
)
from understudy.server.prepare import Plan, plan_chat, plan_completion
from understudy.server.protocol import (
    SSE_HEADERS,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    _SamplingRequest,
    as_api_error,
    sse,
    validation_error,
)
from understudy.server.text_check import refuse_lone_surrogates
from understudy.server.worker import Job, QueueFull, Worker

log = logging.getLogger("understudy.server")

DEFAULT_MAX_QUEUE = 64
DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB: a full 4096-token context is ~20 kB of text
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


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
    name = model_name or served_name(engine.target.name)
    seats = engine.scheduler.seats
    batched = len(seats) > 1  # /v1 requests run together on the seats (engine/batch.py)
    worker = Worker(max_queue, engine.scheduler if batched else None)
    metrics = Metrics(name, str(engine.method))
    worker.on_pass = metrics.batch_pass
    kv_per_seq = kv_bytes_per_seat(seats)
    created = int(time.time())
    strings = TokenStrings(engine.tokenizer)  # token ids -> strings and bytes, for logprobs

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        worker.start()
        yield
        # uvicorn has drained the HTTP requests (SIGTERM); let the thread finish and go.
        await asyncio.get_running_loop().run_in_executor(None, worker.stop, 30.0)

    app = FastAPI(title="understudy", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.engine = engine
    app.state.worker = worker
    app.state.metrics = metrics
    app.state.model_name = name

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

    @app.get("/health")
    async def health() -> dict[str, Any]:
        report = {
            "status": "ok",
            "model": name,
            "method": engine.method,
            "running": worker.running,
            "waiting": worker.waiting,
            "max_num_seqs": len(seats),
            "rows_last_pass": worker.rows_last_pass,
            "kv_bytes_per_seq": kv_per_seq,
        }
        if replicas is not None:  # served by Ray Serve: the replicas running now
            report["replicas"] = await replicas()
        return report

    auth = (401,) if api_key else ()
    metrics_auth = () if public_metrics else auth

    @app.get(
        "/metrics",
        response_class=Response,
        responses={**plain_text("Prometheus text"), **error_responses(*metrics_auth)},
    )
    async def prometheus() -> Response:
        text = metrics.render(worker.running, worker.waiting)
        return Response(text, media_type=CONTENT_TYPE)

    def model_card() -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "understudy",
            "max_model_len": engine.max_context,
        }

    @app.get("/v1/models", responses=error_responses(*auth))
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", responses=error_responses(*auth, 404, 422))
    async def model(model_id: str) -> dict[str, Any]:
        check_model(model_id, "model_id")
        return model_card()

    def check_model(requested: str, param: str = "model") -> None:
        if requested != name:
            raise APIError(
                404,
                f"the model {requested!r} does not exist: this server serves {name!r}",
                param,
                kind="not_found_error",
                code="model_not_found",
            )

    def submit(work: Any, size: int = 1, in_batch: bool = False) -> Job:
        job = Job(work, asyncio.get_running_loop(), size, in_batch)
        try:
            worker.submit(job)
        except QueueFull:
            raise APIError(
                429,
                f"the server is busy: {worker.max_queue} sequences are already waiting; "
                "retry later",
                kind="rate_limit_error",
                code="queue_full",
            ) from None
        return job

    app.state.submit = submit

    async def generate(
        request: Request, body: _SamplingRequest, plan: Plan, chat: bool
    ) -> Response:
        prompt_param = "messages" if chat else "prompt"
        explicit = body.max_tokens is not None
        parts = (engine, plan.render, plan.choices, explicit, prompt_param, plan.param)
        if batched:
            job = submit(batched_work(*parts), len(plan.choices), in_batch=True)
        else:
            job = submit(generation_work(*parts))
        events = job.stream(request.is_disconnected)
        streaming = False
        try:
            first = await anext(events, None)
            if first is None or first[0] == "cancelled":
                return Response(status_code=499)  # the client has gone; nobody reads this
            if first[0] == "error":
                raise as_api_error(first[1])
            prompt_tokens = first[1]["prompt_tokens"]
            response_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
            assembly = Assembly(plan.shape, len(plan.choices), strings, response_id, name)
            if body.stream:
                # The stream starts with the first token, so a request the engine refuses
                # before it (a grammar that does not compile, constraints that leave no
                # token) is a 4xx too, not a 200 whose one event is the error.
                second = await anext(events, None)
                if second is None or second[0] == "cancelled":
                    return Response(status_code=499)
                if second[0] == "error":
                    raise as_api_error(second[1])
                streaming = True  # stream_chunks owns `events` from here on
                return StreamingResponse(
                    stream_chunks(_after(second, events), job, body, assembly, prompt_tokens),
                    media_type="text/event-stream",
                    headers=SSE_HEADERS,
                )
            ttft = None
            async for kind, payload in events:
                if kind == "token":
                    if ttft is None:
                        ttft = time.perf_counter() - job.submitted_at
                    assembly.on_token(*payload)
                elif kind == "choice":
                    assembly.outputs.append(payload[1])
                    account(metrics, job, payload[1], ttft)
                elif kind == "error":
                    raise as_api_error(payload)
                elif kind == "done":
                    return JSONResponse(assembly.whole(prompt_tokens))
            return Response(status_code=499)
        finally:
            if not streaming:
                await events.aclose()

    async def stream_chunks(
        events: Any, job: Job, body: _SamplingRequest, assembly: Assembly, prompt_tokens: int
    ) -> AsyncIterator[bytes]:
        ttft = None
        try:
            async for kind, payload in events:
                if kind == "token":
                    if ttft is None:
                        ttft = time.perf_counter() - job.submitted_at
                    for chunk in assembly.on_token(*payload):
                        yield sse(chunk)
                elif kind == "choice":
                    account(metrics, job, payload[1], ttft)
                    for chunk in assembly.on_done(*payload, prompt_tokens):
                        yield sse(chunk)
                elif kind == "done":
                    if body.include_usage_chunk:
                        yield sse(assembly.usage_chunk(prompt_tokens))
                    yield sse("[DONE]")
                elif kind == "error":
                    yield sse(as_api_error(payload).body())
                    yield sse("[DONE]")
        finally:
            job.cancel()  # the client went away (or we are done): stop generating
            await events.aclose()

    generating = {
        **event_stream("The response; with `stream: true`, its chunks as server-sent events"),
        **error_responses(400, *auth, 404, 408, 413, 422, 429, 500),
    }

    @app.post(
        "/v1/completions",
        responses=generating,
        openapi_extra=request_examples(name, chat=False),
    )
    async def completions(body: CompletionRequest, request: Request) -> Response:
        refuse_lone_surrogates(body)
        body.check_supported()
        check_model(body.model)
        plan = plan_completion(body, engine, COMPLETIONS_DEFAULT_MAX_TOKENS)
        return await generate(request, body, plan, chat=False)

    @app.post(
        "/v1/chat/completions",
        responses=generating,
        openapi_extra=request_examples(name, chat=True),
    )
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        refuse_lone_surrogates(body)
        body.check_supported()
        check_model(body.model)
        plan = plan_chat(body, engine, engine.max_context)  # default: until EOS or full context
        return await generate(request, body, plan, chat=True)

    from understudy.server.lab import add_lab_routes

    add_lab_routes(app, engine, submit, metrics, model_name=name, auth_required=bool(api_key))

    app.add_middleware(
        Guard,
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        metrics=metrics,
        public_metrics=public_metrics,
        body_timeout_s=body_timeout_s,
    )
    return app


async def _after(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """`first`, then the items of `rest` (closed with this iterator)."""
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()


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
