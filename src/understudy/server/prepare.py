"""From a validated request body to what the worker runs and what the response looks like.

`Plan.render` produces the engine's prompt on the worker thread (the one thread that uses
the tokenizer for encoding): the body's prompt or messages, or, with tools, the model's chat
template rendered with them (tools.py). `Plan.choices` holds one SamplingParams per choice.
`Plan.param` is the field an engine error names when its message does not start with one:
the structured output's (a grammar that does not compile, or that allows no token).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from understudy.config import SamplingParams
from understudy.server.choices import Shape
from understudy.server.generation import choice_params
from understudy.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from understudy.server.structured import structured_spec
from understudy.server.tools import render_prompt, tool_constraint, tool_mode


@dataclass(frozen=True)
class Plan:
    render: Callable[[], Any]  # -> a prompt Engine.encode takes
    choices: list[SamplingParams]
    shape: Shape
    param: str | None = None


def plan_completion(body: CompletionRequest, engine: Any, default_max_tokens: int) -> Plan:
    structured, param = structured_spec(body) or (None, None)
    params = body.sampling_params(default_max_tokens, structured, param)
    prompt = body.engine_prompt()
    echo = ""
    if body.echo:
        if isinstance(prompt, str):
            echo = prompt
        elif engine.tokenizer is None:
            raise APIError(400, "echo of token ids needs the model's tokenizer", "echo")
        else:
            echo = engine.tokenizer.decode(prompt)
    shape = Shape(chat=False, stop=params.stop, logprobs=params.logprobs is not None, echo=echo)
    return Plan(lambda: prompt, choice_params(params, body.n), shape, param)


def plan_chat(body: ChatCompletionRequest, engine: Any, default_max_tokens: int) -> Plan:
    mode = tool_mode(body)
    structured, param = structured_spec(body) or (None, None)
    constraint = tool_constraint(body, mode)
    if structured is not None and constraint is not None:
        raise APIError(
            400,
            f"tool_choice {body.tool_choice!r} constrains the output itself: "
            "it cannot be combined with response_format or guided_* fields",
            "tool_choice",
        )
    if constraint is not None:
        param = "tools"  # the grammar is made from a tool's parameters
    params = body.sampling_params(default_max_tokens, structured or constraint, param)
    named = body.tool_choice.function.name if mode == "named" else None  # type: ignore[union-attr]
    shape = Shape(
        chat=True,
        stop=params.stop,
        logprobs=params.logprobs is not None,
        tool_mode=mode,
        tool_name=named,
        tool_names=tuple(tool.function.name for tool in body.tools or []),
    )
    tool_history = any(m.tool_calls or m.tool_call_id for m in body.messages)
    if mode == "off" and not tool_history:
        messages = body.engine_prompt()
        return Plan(lambda: messages, choice_params(params, body.n), shape, param)

    def render() -> list[int]:
        return render_prompt(engine.tokenizer, body)

    return Plan(render, choice_params(params, body.n), shape, param)
