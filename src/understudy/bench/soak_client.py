"""Sending the soak run's requests and reading what came back.

A well-formed `Call` goes through the official `openai` client, as an application would send
it; a `BadCall` goes raw through httpx (the client would refuse to send most of them). Each
gives an `Outcome`: the status (the HTTP code, or "stream error" for an error event inside
a 200 stream, "connection error" for a connection the server dropped), the answer of each
choice, the time to the whole answer and to the first token, and `problem`: what is wrong
with an answer that came back with the status it should (a choice missing, logprobs not as
asked, a constrained answer that breaks its constraint, a refusal that does not name the
problem), or None.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai

from understudy.bench.soak_mix import PATHS, REGEX, SCHEMA, BadCall, Call, Constraint

SERVER_ERRORS = ("stream error", "connection error")  # statuses that are the server's fault
FINISH_REASONS = ("stop", "length")


@dataclass
class Outcome:
    status: str  # "200", "400", ..., or one of SERVER_ERRORS
    latency_s: float
    ttft_s: float | None = None
    tokens: int = 0  # completion tokens (usage), 0 when unknown
    answers: list[tuple[str, str | None]] = field(default_factory=list)  # (text, finish_reason)
    cancelled: bool = False  # the client closed the stream before its end
    problem: str | None = None
    detail: str | None = None  # the response for an unexpected status, for the report


def satisfies(constraint: Constraint, text: str) -> bool:
    """Whether a finished constrained answer is what its constraint allows: the regex
    matched whole, or a JSON object that soak_mix.SCHEMA accepts."""
    if constraint == "regex":
        return re.fullmatch(REGEX, text) is not None
    try:
        value = json.loads(text)
    except ValueError:
        return False
    if not isinstance(value, dict) or set(value) != set(SCHEMA["required"]):
        return False
    colors = SCHEMA["properties"]["color"]["enum"]
    number = value["n"]
    return (
        value["color"] in colors
        and isinstance(value["ok"], bool)
        and type(number) is int
        and 0 <= number <= 99
    )


def send_call(client: openai.OpenAI, call: Call) -> Outcome:
    """One well-formed request through the official client."""
    create = client.chat.completions.create if call.route == "chat" else client.completions.create
    t0 = time.perf_counter()
    try:
        if call.delivery == "whole":
            outcome = read_whole(call, create(**call.kwargs), t0)
        else:
            outcome = read_stream(call, create(**call.kwargs), t0)
    except openai.APIStatusError as error:
        return Outcome(str(error.status_code), time.perf_counter() - t0,
                       detail=error.response.text[:1000])  # fmt: skip
    except openai.APIConnectionError as error:
        detail = repr(error.__cause__ or error)
        return Outcome("connection error", time.perf_counter() - t0, detail=detail)
    except openai.APIError as error:  # an error event inside the stream
        return Outcome("stream error", time.perf_counter() - t0, detail=json.dumps(error.body))
    except Exception as error:  # noqa: BLE001 (a stream cut mid-way, an answer unreadable)
        return Outcome(f"failed: {type(error).__name__}", time.perf_counter() - t0,
                       detail=repr(error)[:1000])  # fmt: skip
    outcome.problem = answer_problem(call, outcome)
    return outcome


def choice_text(call: Call, choice: Any) -> str:
    if call.route == "chat":
        return choice.message.content or ""
    return choice.text


def has_logprobs(call: Call, logprobs: Any) -> bool:
    """Whether a choice's (or a chunk's) logprobs carry entries."""
    if logprobs is None:
        return False
    entries = logprobs.content if call.route == "chat" else logprobs.tokens
    return bool(entries)


def logprobs_problem(call: Call, with_text: set[int], with_logprobs: set[int]) -> str | None:
    """Logprobs where asked, only there: asked, every choice with text carries them (one
    whose tokens made no text yet may or may not); not asked, none does."""
    if (with_text <= with_logprobs) if call.logprobs else not with_logprobs:
        return None
    return (
        f"logprobs asked: {call.logprobs}, but choices {sorted(with_logprobs)} carry them "
        f"(choices with text: {sorted(with_text)})"
    )


def read_whole(call: Call, response: Any, t0: float) -> Outcome:
    outcome = Outcome("200", time.perf_counter() - t0)
    outcome.tokens = response.usage.completion_tokens if response.usage else 0
    choices = sorted(response.choices, key=lambda c: c.index)
    outcome.answers = [(choice_text(call, c), c.finish_reason) for c in choices]
    with_text = {c.index for c in choices if choice_text(call, c)}
    with_logprobs = {c.index for c in choices if has_logprobs(call, c.logprobs)}
    outcome.problem = logprobs_problem(call, with_text, with_logprobs)
    return outcome


def read_stream(call: Call, stream: Any, t0: float) -> Outcome:
    """Read a streamed answer; a cancelling call closes it after `cancel_after` chunks."""
    texts: dict[int, list[str]] = {}
    finish: dict[int, str | None] = {}
    with_logprobs: set[int] = set()
    outcome = Outcome("200", 0.0)
    usage_seen = False
    for events, chunk in enumerate(stream, start=1):
        if chunk.usage is not None:
            outcome.tokens, usage_seen = chunk.usage.completion_tokens, True
        for choice in chunk.choices:
            piece = choice.delta.content if call.route == "chat" else choice.text
            if piece and outcome.ttft_s is None:
                outcome.ttft_s = time.perf_counter() - t0
            texts.setdefault(choice.index, []).append(piece or "")
            if choice.finish_reason is not None:
                finish[choice.index] = choice.finish_reason
            if has_logprobs(call, choice.logprobs):
                with_logprobs.add(choice.index)
        if call.delivery == "cancel" and events >= call.cancel_after:
            stream.close()
            outcome.cancelled = True
            break
    outcome.latency_s = time.perf_counter() - t0
    outcome.answers = [("".join(texts[i]), finish.get(i)) for i in sorted(texts)]
    if not outcome.cancelled:
        with_text = {i for i in texts if any(texts[i])}
        outcome.problem = logprobs_problem(call, with_text, with_logprobs)
        if outcome.problem is None and not usage_seen:
            outcome.problem = "no usage chunk at the end of the stream"
    return outcome


def answer_problem(call: Call, outcome: Outcome) -> str | None:
    """What is wrong with a 200 answer, or None (a cancelled one: nothing is checked here;
    its text is compared with its greedy solo answer elsewhere)."""
    if outcome.problem is not None or outcome.cancelled:
        return outcome.problem
    if len(outcome.answers) != call.n:
        return f"{call.n} choices asked, {len(outcome.answers)} came"
    for index, (text, finish) in enumerate(outcome.answers):
        if finish not in FINISH_REASONS:
            return f"choice {index} ended with finish_reason {finish!r}"
        if (
            call.constraint is not None
            and finish == "stop"
            and not satisfies(call.constraint, text)
        ):
            return f"choice {index} breaks its {call.constraint} constraint: {text!r}"
    return None


def send_bad(http: httpx.Client, base_url: str, bad: BadCall) -> Outcome:
    """One malformed request, raw; its problem is a refusal that does not name the fault."""
    t0 = time.perf_counter()
    try:
        response = http.post(base_url + PATHS[bad.route], content=bad.content,
                             headers={"content-type": "application/json"})  # fmt: skip
    except httpx.HTTPError as error:
        return Outcome("connection error", time.perf_counter() - t0, detail=repr(error))
    outcome = Outcome(str(response.status_code), time.perf_counter() - t0)
    if response.status_code != bad.status:
        outcome.detail = response.text[:1000]
        return outcome
    try:
        error = response.json()["error"]
        named = bad.names in (error.get("param") or "") or bad.names in error["message"]
    except (ValueError, KeyError, TypeError):
        named = False
    if not named:
        outcome.problem = f"the error does not name {bad.names!r}: {response.text[:300]}"
    return outcome
