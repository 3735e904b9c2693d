"""The Lab: /lab (one self-contained HTML page) and the JSON/SSE endpoints it drives.

- GET  /lab                the page (src/understudy/web/lab.html; no external network)
- GET  /lab/api/info       what the server runs: model, method, K, its measured costs (draft
                           cost c, row cost v, pass curve)
- POST /lab/api/run        one generation on the real engine, streamed as server-sent events:
                           {"type": "start"}, a {"type": "token"} per emitted token (its
                           origin, round, the round's drafted tokens -- rejected ones
                           included -- and live counters), then {"type": "done"} with the stats.
                           mode "plain" uses the same weights with method="none".
- GET  /lab/api/theory     `understudy.theory.simulate_report`: the same numbers as
                           `understudy simulate` (Act 3's dial), rows charged at row_cost
                           or a comma-separated pass_curve.
- GET  /lab/api/alpha      the per-token acceptance α implied by a measured
                           accepted/drafted rate at K (inverts `expected_acceptance_rate`).
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from importlib import resources
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from understudy.config import SamplingParams, UnderstudyError
from understudy.server.generation import account, encode_for_budget, until_cancelled
from understudy.server.metrics import Metrics
from understudy.server.openapi import body_examples, error_responses, event_stream
from understudy.server.protocol import (
    SSE_HEADERS,
    APIError,
    as_api_error,
    error_from_understudy,
    sse,
)
from understudy.server.text_check import refuse_lone_surrogates
from understudy.server.worker import Job

LAB_MAX_TOKENS = 1024
THEORY_ROUNDS = 4000  # Monte Carlo rounds per dial move: a few ms


class LabRun(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")

    mode: Literal["plain", "spec"]
    prompt: str = Field(min_length=1)
    chat: bool = False
    max_tokens: int = Field(default=96, ge=1, le=LAB_MAX_TOKENS)
    temperature: float = Field(default=0.0, ge=0.0)
    seed: int | None = None


class _Engines:
    """The served engine and, built on first use (on the worker thread), its plain twin."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._plain: Any | None = None
        self._pieces: dict[int, str] = {}

    def for_mode(self, mode: str) -> Any:
        if mode == "spec" or self.engine.method == "none":
            return self.engine
        if self._plain is None:
            self._plain = self.engine.with_method("none")
        return self._plain

    def piece(self, token_id: int) -> str:
        """One token's own text, for showing it as a chip."""
        text = self._pieces.get(token_id)
        if text is None:
            tokenizer = self.engine.tokenizer
            text = tokenizer.decode([token_id]) if tokenizer is not None else f"⟨{token_id}⟩"
            self._pieces[token_id] = text
        return text


def lab_work(engines: _Engines, run: LabRun, params: SamplingParams) -> Callable[[Job], None]:
    """The worker-thread side of a Lab run: emits "start", "token" payloads, "done". Each
    round's drafted tokens (rejected ones included) come from the engine's `on_round`, which
    reports a round before its tokens are emitted."""

    def work(job: Job) -> None:
        engine = engines.for_mode(run.mode)
        prompt: Any = [{"role": "user", "content": run.prompt}] if run.chat else run.prompt
        try:
            ids = encode_for_budget(engine, prompt, params, True, "prompt")
        except APIError as error:
            job.emit("error", error)
            return
        drafted_in: dict[int, list[int]] = {}  # round -> its drafted ids, until shown
        job.emit("start", {"prompt_tokens": len(ids)})
        stream = engine.stream(
            ids, params, on_round=lambda r: drafted_in.update({r.round: r.drafted})
        )
        t0 = time.perf_counter()
        counters = {"tokens": 0, "passes": 0, "rounds": 0, "drafted": 0, "accepted": 0}
        current = -1
        for event in until_cancelled(stream, job):
            payload: dict[str, Any] = {
                "type": "token",
                "id": event.token_id,
                "text": event.text,
                "piece": engines.piece(event.token_id),
                "origin": event.origin,
                "round": event.round,
            }
            if event.round != current:  # the first token of a new round (target pass)
                current = event.round
                counters["passes"] = event.round + 1  # the prefill is pass 1
                counters["rounds"] = event.round
                drafted = drafted_in.pop(event.round, [])
                counters["drafted"] += len(drafted)
                payload["drafted"] = [{"id": t, "piece": engines.piece(t)} for t in drafted]
            counters["tokens"] += 1
            counters["accepted"] += event.origin == "accepted"
            payload["counters"] = dict(counters)
            payload["t"] = time.perf_counter() - t0
            job.emit("token", payload)
        job.emit("cancelled" if job.cancelled.is_set() else "done", stream.output)

    return work


def _theory_error(error: UnderstudyError) -> APIError:
    message = str(error)
    first = message.split(" ", 1)[0]
    params = {"alpha": "alpha", "c": "c", "K": "k", "row_cost": "row_cost"}
    param = params.get(first) or ("pass_curve" if first == "pass_curve" else None)
    return APIError(400, message, param)


def add_lab_routes(
    app: FastAPI,
    engine: Any,
    submit: Callable[[Callable[[Job], None]], Job],
    metrics: Metrics,
    *,
    model_name: str,
    auth_required: bool,
) -> None:
    """The Lab's page and API on `app`, over the served `engine`."""
    auth = (401,) if auth_required else ()
    _add_page_and_info(app, engine, auth, model_name=model_name, auth_required=auth_required)
    _add_theory_routes(app, auth)
    _add_run_route(app, _Engines(engine), submit, metrics, auth)


def _add_page_and_info(
    app: FastAPI, engine: Any, auth: tuple[int, ...], *, model_name: str, auth_required: bool
) -> None:
    page = resources.files("understudy").joinpath("web/lab.html").read_text(encoding="utf-8")

    @app.get("/lab", response_class=HTMLResponse)
    async def lab_page() -> HTMLResponse:
        return HTMLResponse(page)

    @app.get("/lab/api/info", responses=error_responses(*auth))
    async def lab_info() -> dict[str, Any]:
        tokenizer = engine.tokenizer
        return {
            "model": model_name,
            "method": engine.method,
            "k": engine.k,
            "cost_ratio": engine.costs.draft_step,
            "row_cost": engine.costs.row,
            "pass_curve": list(engine.costs.pass_curve.ratios),
            "max_context": engine.max_context,
            "max_tokens": LAB_MAX_TOKENS,
            "chat_template": bool(
                tokenizer is not None and getattr(tokenizer, "chat_template", None)
            ),
            "auth_required": auth_required,
        }


def _add_theory_routes(app: FastAPI, auth: tuple[int, ...]) -> None:
    """Act 3's dial: the theory at given α, c and row costs, and α from a measured rate."""

    @app.get("/lab/api/theory", responses=error_responses(400, *auth, 422))
    async def lab_theory(
        alpha: float,
        c: float,
        k: int | None = None,
        row_cost: float | None = None,
        pass_curve: str | None = None,
    ) -> dict[str, Any]:
        from understudy.policy.theory import PassCost, parse_pass_curve, simulate_report

        if row_cost is not None and pass_curve is not None:
            raise APIError(400, "give row_cost or pass_curve, not both", "pass_curve")
        try:
            passes = (
                PassCost(row=row_cost or 0.0)
                if pass_curve is None
                else PassCost.from_curve(parse_pass_curve(pass_curve))
            )
            return simulate_report(alpha, c, k, passes=passes, rounds=THEORY_ROUNDS)
        except UnderstudyError as error:
            raise _theory_error(error) from None

    @app.get("/lab/api/alpha", responses=error_responses(400, *auth, 422))
    async def lab_alpha(acceptance_rate: float, k: int) -> dict[str, Any]:
        from understudy.policy.theory import alpha_from_acceptance_rate

        if not 1 <= k <= 64:
            raise APIError(400, "k must be in 1..64", "k")
        try:
            return {"alpha": alpha_from_acceptance_rate(acceptance_rate, k), "k": k}
        except UnderstudyError as error:
            raise APIError(400, str(error), "acceptance_rate") from None


def _add_run_route(
    app: FastAPI,
    engines: _Engines,
    submit: Callable[[Callable[[Job], None]], Job],
    metrics: Metrics,
    auth: tuple[int, ...],
) -> None:
    @app.post(
        "/lab/api/run",
        response_class=StreamingResponse,
        responses={
            **event_stream("The run's events: start, a token each, then done (or error)"),
            **error_responses(400, *auth, 408, 413, 422, 429, 500),
        },
        openapi_extra=body_examples(
            spec=("Speculative", {"mode": "spec", "prompt": "def add(a, b):", "max_tokens": 8}),
            plain=(
                "Plain decoding, sampled",
                {"mode": "plain", "prompt": "def", "temperature": 0.7, "seed": 1, "max_tokens": 8},
            ),
        ),
    )
    async def lab_run(run: LabRun, request: Request) -> StreamingResponse:
        refuse_lone_surrogates(run)
        try:
            params = SamplingParams(
                max_tokens=run.max_tokens, temperature=run.temperature, seed=run.seed
            )
        except UnderstudyError as error:
            raise error_from_understudy(error) from None
        job = submit(lab_work(engines, run, params))
        events = job.stream(request.is_disconnected)
        first = await anext(events, None)
        if first is None or first[0] != "start":
            await events.aclose()
            if first is not None and first[0] == "error":
                raise as_api_error(first[1])
            raise APIError(499, "the client went away")
        start = {
            "type": "start",
            "mode": run.mode,
            "method": engines.engine.method if run.mode == "spec" else "none",
            "prompt_tokens": first[1]["prompt_tokens"],
        }
        body = _run_events(job, events, start, metrics)
        return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)


async def _run_events(
    job: Job, events: AsyncGenerator[tuple[str, Any]], start: dict[str, Any], metrics: Metrics
) -> AsyncIterator[bytes]:
    """A Lab run's server-sent events: start, a token each, then done (or error)."""
    ttft = None
    try:
        yield sse(start)
        async for kind, payload in events:
            if kind == "token":
                if ttft is None:
                    ttft = time.perf_counter() - job.submitted_at
                yield sse(payload)
            elif kind == "done":
                account(metrics, job, payload, ttft)
                done = {"type": "done", "text": payload.text, "token_ids": payload.token_ids,
                        "stats": payload.stats.to_dict()}  # fmt: skip
                yield sse(done)
            elif kind == "error":
                yield sse({"type": "error", "message": as_api_error(payload).message})
    finally:
        job.cancel()
        await events.aclose()
