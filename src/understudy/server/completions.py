"""POST /v1/completions and /v1/chat/completions: check the request, plan its prompt and
choices (prepare.py), run it on the worker, and answer with one JSON body or, with
`stream: true`, server-sent events whose last chunk carries `usage` and the speculative
stats."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from understudy.server.choices import Assembly
from understudy.server.generation import PromptParam, account, batched_work, generation_work
from understudy.server.openapi import error_responses, event_stream, request_examples
from understudy.server.prepare import Plan, plan_chat, plan_completion
from understudy.server.protocol import (
    SSE_HEADERS,
    ChatCompletionRequest,
    CompletionRequest,
    _SamplingRequest,
    as_api_error,
    sse,
)
from understudy.server.served import ServedModel
from understudy.server.text_check import refuse_lone_surrogates
from understudy.server.worker import Job

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def add_completion_routes(app: FastAPI, served: ServedModel, auth: tuple[int, ...]) -> None:
    """The two generation routes; `auth` is (401,) when an API key guards them, else ()."""
    generating = {
        **event_stream("The response; with `stream: true`, its chunks as server-sent events"),
        **error_responses(400, *auth, 404, 408, 413, 422, 429, 500),
    }
    engine = served.engine

    @app.post(
        "/v1/completions",
        responses=generating,
        openapi_extra=request_examples(served.name, chat=False),
    )
    async def completions(body: CompletionRequest, request: Request) -> Response:
        refuse_lone_surrogates(body)
        body.check_supported()
        served.check_model(body.model)
        plan = plan_completion(body, engine, COMPLETIONS_DEFAULT_MAX_TOKENS)
        return await generate(served, request, body, plan, chat=False)

    @app.post(
        "/v1/chat/completions",
        responses=generating,
        openapi_extra=request_examples(served.name, chat=True),
    )
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        refuse_lone_surrogates(body)
        body.check_supported()
        served.check_model(body.model)
        plan = plan_chat(body, engine, engine.max_context)  # default: until EOS or full context
        return await generate(served, request, body, plan, chat=True)


async def generate(
    served: ServedModel, request: Request, body: _SamplingRequest, plan: Plan, chat: bool
) -> Response:
    """Run `plan` on the worker and answer it. An error the engine raises before the first
    token is the request's 4xx; a client that leaves gets 499 (nobody reads it)."""
    prompt_param: PromptParam = "messages" if chat else "prompt"
    explicit = body.max_tokens is not None
    parts = (served.engine, plan.render, plan.choices, explicit, prompt_param, plan.param)
    if served.batched:
        job = served.submit(batched_work(*parts), len(plan.choices), in_batch=True)
    else:
        job = served.submit(generation_work(*parts))
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
        assembly = Assembly(plan.shape, len(plan.choices), served.strings, response_id, served.name)
        if not body.stream:
            return await answer_whole(served, events, job, assembly, prompt_tokens)
        # The stream starts with the first token, so a request the engine refuses before it
        # (a grammar that does not compile, constraints that leave no token) is a 4xx too,
        # not a 200 whose one event is the error.
        second = await anext(events, None)
        if second is None or second[0] == "cancelled":
            return Response(status_code=499)
        if second[0] == "error":
            raise as_api_error(second[1])
        streaming = True  # stream_chunks owns `events` from here on
        return StreamingResponse(
            stream_chunks(served, _after(second, events), job, body, assembly, prompt_tokens),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )
    finally:
        if not streaming:
            await events.aclose()


async def answer_whole(
    served: ServedModel, events: Any, job: Job, assembly: Assembly, prompt_tokens: int
) -> Response:
    """The answer as one JSON body, once every choice is done (499 if the client left)."""
    ttft = None
    async for kind, payload in events:
        if kind == "token":
            if ttft is None:
                ttft = time.perf_counter() - job.submitted_at
            assembly.on_token(*payload)
        elif kind == "choice":
            assembly.outputs.append(payload[1])
            account(served.metrics, job, payload[1], ttft)
        elif kind == "error":
            raise as_api_error(payload)
        elif kind == "done":
            return JSONResponse(assembly.whole(prompt_tokens))
    return Response(status_code=499)


async def stream_chunks(
    served: ServedModel,
    events: Any,
    job: Job,
    body: _SamplingRequest,
    assembly: Assembly,
    prompt_tokens: int,
) -> AsyncIterator[bytes]:
    """The answer as server-sent events; the job is cancelled when the client goes."""
    ttft = None
    try:
        async for kind, payload in events:
            if kind == "token":
                if ttft is None:
                    ttft = time.perf_counter() - job.submitted_at
                for chunk in assembly.on_token(*payload):
                    yield sse(chunk)
            elif kind == "choice":
                account(served.metrics, job, payload[1], ttft)
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


async def _after(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """`first`, then the items of `rest` (closed with this iterator)."""
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()
