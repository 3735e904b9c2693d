"""Running one request on the engine (worker thread) and turning its events into responses.

`generation_work` is what the worker thread runs for /v1 requests on a one-seat engine:
encode, check the budget, then stream each choice's tokens, one choice after another.
`batched_work` is the same request on an engine with several seats: it submits the choices
to the batch loop as sequences, which run together with every other request's (worker.py).
Either way choice i is seeded with seed + i when the request gives a seed (`choice_params`),
so n choices are n reproducible streams, each exactly its solo run. `StopHoldback` keeps a
streamed text consistent with the final one: text that might be the start of a stop string
is held back until it is known not to be.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from typing import Any, Literal

from understudy.config import SamplingParams, UnderstudyError
from understudy.server.metrics import Metrics
from understudy.server.protocol import APIError, error_from_understudy
from understudy.server.worker import Job

PromptParam = Literal["prompt", "messages"]  # the request field an encoding error names


def encode_for_budget(
    engine: Any,
    prompt: Any,
    params: SamplingParams,
    explicit_max_tokens: bool,
    prompt_param: PromptParam,
) -> list[int]:
    """Prompt token ids, or an APIError naming the field at fault (prompt, max_tokens)."""
    try:
        ids = engine.encode(prompt)
    except UnderstudyError as error:
        raise error_from_understudy(error, prompt_param) from None
    if explicit_max_tokens and len(ids) + params.max_tokens > engine.max_context:
        raise APIError(
            400,
            f"max_tokens is {params.max_tokens} and the prompt has {len(ids)} tokens: "
            f"together more than the context of {engine.max_context} tokens",
            "max_tokens",
        )
    return ids


def until_cancelled(stream: Iterable[Any], job: Job) -> Iterator[Any]:
    """The engine stream's events until the job is cancelled; then the engine's generator is
    closed at once (not at garbage collection), so the engine is free for the next request."""
    events = iter(stream)
    try:
        for event in events:
            if job.cancelled.is_set():
                return
            yield event
    finally:
        close = getattr(events, "close", None)
        if close is not None:
            close()


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """One SamplingParams per choice: seeds seed, seed + 1, ... (or all unseeded)."""
    if params.seed is None:
        return [params] * n
    return [replace(params, seed=params.seed + i) for i in range(n)]


def start(
    job: Job,
    engine: Any,
    render: Callable[[], Any],
    params: SamplingParams,
    explicit_max_tokens: bool,
    prompt_param: PromptParam,
) -> list[int] | None:
    """Render and encode the prompt (worker thread) and emit "start"; None after emitting
    "error" when the prompt does not fit or does not encode."""
    try:
        ids = encode_for_budget(engine, render(), params, explicit_max_tokens, prompt_param)
    except APIError as error:
        job.emit("error", error)
        return None
    job.emit("start", {"prompt_tokens": len(ids), "prompt_ids": ids})
    return ids


def generation_work(
    engine: Any,
    render: Callable[[], Any],
    choices: list[SamplingParams],
    explicit_max_tokens: bool,
    prompt_param: PromptParam,
    error_param: str | None = None,
) -> Callable[[Job], None]:
    """The worker-thread side of a /v1 request with len(choices) choices. Emits "start"
    ({"prompt_tokens", "prompt_ids"}); then for each choice i a "token" (i, TokenEvent) per
    token and "choice" (i, GenerationOutput); then "done" (the outputs) -- or "error" /
    "cancelled". `render` makes the prompt here, on the worker thread. An UnderstudyError
    from the engine (a token id outside the vocabulary, a grammar that does not compile) is
    the client's error: a 400 naming the field (`error_param` when its message names
    none)."""

    def work(job: Job) -> None:
        ids = start(job, engine, render, choices[0], explicit_max_tokens, prompt_param)
        if ids is None:
            return
        outputs = []
        for index, params in enumerate(choices):
            try:
                stream = engine.stream(ids, params)
                for event in until_cancelled(stream, job):
                    job.emit("token", (index, event))
            except UnderstudyError as error:
                job.emit("error", error_from_understudy(error, error_param))
                return
            if job.cancelled.is_set():
                job.emit("cancelled", stream.output)
                return
            outputs.append(stream.output)
            job.emit("choice", (index, stream.output))
        job.emit("done", outputs)

    return work


def batched_work(
    engine: Any,
    render: Callable[[], Any],
    choices: list[SamplingParams],
    explicit_max_tokens: bool,
    prompt_param: PromptParam,
    error_param: str | None = None,
) -> Callable[[Job], None]:
    """`generation_work`'s events, for the batch loop: the worker thread calls the returned
    function once; it emits "start" and submits one sequence per choice (`job.sequences`),
    whose callbacks then emit "token" (i, TokenEvent) as rounds run. Tokens of different
    choices interleave; "choice" (i, output) events come in index order (a choice that ends
    early waits for the ones before it), then "done" (the outputs). An error of one choice
    (its grammar, say) is the request's: "error", and its other choices are cancelled."""

    def work(job: Job) -> None:
        ids = start(job, engine, render, choices[0], explicit_max_tokens, prompt_param)
        if ids is None:
            return
        outputs: list[Any] = [None] * len(choices)
        emitted = 0

        def on_token(index: int) -> Callable[[Any], None]:
            return lambda event: job.emit("token", (index, event))

        def on_done(index: int) -> Callable[[Any], None]:
            def done(output: Any) -> None:
                nonlocal emitted
                outputs[index] = output
                while emitted < len(outputs) and outputs[emitted] is not None:
                    job.emit("choice", (emitted, outputs[emitted]))
                    emitted += 1
                if emitted == len(outputs):
                    job.emit("done", outputs)

            return done

        def on_error(error: Exception) -> None:
            if isinstance(error, UnderstudyError):
                job.emit("error", error_from_understudy(error, error_param))
            else:
                job.emit("error", error)
            for sequence in job.sequences:
                sequence.cancel()

        job.sequences = [
            engine.scheduler.submit(ids, params, on_token(i), on_done(i), on_error)
            for i, params in enumerate(choices)
        ]

    return work


def account(metrics: Metrics, job: Job, output: Any, ttft: float | None) -> None:
    """Record a finished generation: its stats, latency, time to first token, queue wait."""
    now = time.perf_counter()
    queue_s = (job.started_at or now) - job.submitted_at
    metrics.generation(output.stats.to_dict(), now - job.submitted_at, ttft, queue_s)


class StopHoldback:
    """Streams text deltas without ever sending text a stop string later removes.

    The engine cuts a stop string out of its final text, but a stop string can span several
    tokens, and the first ones were already emitted. So the longest suffix of the text that
    is a proper prefix of some stop string waits until the next token settles it; `finish`
    sends whatever of the final text has not been sent yet."""

    def __init__(self, stop: list[str]) -> None:
        self.stop = stop
        self.text = ""
        self.sent = 0

    def push(self, delta: str) -> str:
        self.text += delta
        safe = len(self.text) - self._held()
        if safe <= self.sent:
            return ""
        out = self.text[self.sent : safe]
        self.sent = safe
        return out

    def finish(self, final_text: str) -> str:
        return final_text[self.sent :]

    def _held(self) -> int:
        held = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), held, -1):
                if self.text.endswith(s[:n]):
                    held = n
                    break
        return held
