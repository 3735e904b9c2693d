"""The OpenAI wire format: request bodies (validated strictly) and the errors we answer with.

Requests follow OpenAI's `/v1/completions` and `/v1/chat/completions` schemas, plus vLLM's
sampling extras (`top_k`, `min_p`, `ignore_eos`, `repetition_penalty`, `min_tokens`,
`stop_token_ids`, `include_stop_str_in_output`, `guided_json` / `guided_regex` /
`guided_grammar` / `guided_choice`, `structured_outputs`). Every field is honoured with
speculation on, or refused with a 400 that names it: the known fields we do not implement
are listed in refused.py; fields we do not know at all are ignored, as vLLM does. `n` > 1
runs n sequences (together on the engine's seats, or one after another on a one-seat
engine), choice i seeded with seed + i when a seed is given. Logprobs are the target's
log-softmax of its raw logits (before penalties, bias, grammar and temperature: vLLM's
default "raw_logprobs").

Errors use OpenAI's envelope, so the official clients raise the right exception:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "n", "code": null}}
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field

from understudy.config import MAX_LOGPROBS, SamplingParams, StructuredSpec, UnderstudyError
from understudy.server.refused import refused_field
from understudy.server.request_parts import (
    NamedToolChoice,
    ResponseFormat,
    StructuredOutputs,
    Tool,
    ToolCallMessage,
)

# Strict: "5" is not an int and true is not a number; NaN and inf are not numbers either.
_STRICT = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_SAMPLING_FIELDS = (
    "max_tokens",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "seed",
    "stop",
    "logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "min_tokens",
    "stop_token_ids",
)
MAX_N = 16  # choices a request may ask for; they run one after another


class APIError(Exception):
    """An error answered to the client as OpenAI's error envelope."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


def error_from_understudy(error: UnderstudyError, default_param: str | None = None) -> APIError:
    """A 400 for an engine validation error; its message starts with the field it is about
    ("top_p must be in (0, 1], got 2.0"), which becomes `param`."""
    message = str(error)
    first = message.split(" ", 1)[0]
    param = first if first in _SAMPLING_FIELDS else default_param
    return APIError(400, message, param=param)


def _param_from_loc(loc: tuple) -> str | None:
    """('body', 'messages', 0, 'content', 'str') -> 'messages[0].content' (type tags dropped)."""
    type_tags = {"str", "int", "float", "bool", "list", "dict", "none"}
    out = ""
    for part in loc[1:] if loc and loc[0] in ("body", "query", "path") else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and part.isidentifier() and part.islower():
            if part in type_tags:
                continue
            out += f".{part}" if out else part
    return out or None


def validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return APIError(422, "invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        reason = first.get("ctx", {}).get("error", "")
        return APIError(400, f"the body is not valid JSON: {reason}".rstrip(": "))
    param = _param_from_loc(tuple(first.get("loc", ())))
    if param is None:
        return APIError(422, f"the body must be a JSON object: {first.get('msg', '')}")
    top = param.split(".")[0].split("[")[0]
    messages = []
    for e in errors:  # a union type fails once per alternative: say it once
        p = _param_from_loc(tuple(e.get("loc", ())))
        if p and p.split(".")[0].split("[")[0] == top and e["msg"] not in messages:
            messages.append(e["msg"])
    return APIError(422, f"{param}: {'; or '.join(messages[:3])}", param)


def as_api_error(error: BaseException) -> APIError:
    """What the client is told about a failed job: its APIError, or a plain 500 (the
    traceback stays in the server's log)."""
    if isinstance(error, APIError):
        return error
    return APIError(500, f"internal error: {type(error).__name__}", kind="server_error")


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """Fields shared by both endpoints. Unknown fields are kept (`model_extra`) only to be
    checked against refused.py's table."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")
    is_chat: ClassVar[bool] = False

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extra (vLLM); 0 = off
    min_p: float | None = None  # extra (vLLM); 0 = off
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False  # extra (vLLM)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # extra (vLLM); 1 = off
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias
    min_tokens: int = 0  # extra (vLLM)
    stop_token_ids: list[int] | None = None  # extra (vLLM)
    include_stop_str_in_output: bool = False  # extra (vLLM)
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None  # extra (vLLM)
    guided_regex: str | None = None  # extra (vLLM)
    guided_grammar: str | None = None  # extra (vLLM)
    guided_choice: list[str] | None = None  # extra (vLLM)
    structured_outputs: StructuredOutputs | None = None  # extra (vLLM)

    def requested_logprobs(self) -> int | None:
        """SamplingParams.logprobs: alternatives per token, or None for no logprobs."""
        return None

    def check_supported(self) -> None:
        """Refuse what the engine cannot do, naming the field."""
        refused = refused_field(self.model_extra, chat=self.is_chat)
        if refused is not None:
            raise APIError(400, refused[1], refused[0])
        if not 1 <= self.n <= MAX_N:
            raise APIError(400, f"n must be an integer in 1..{MAX_N}, got {self.n}", "n")
        if isinstance(self.stop, list) and len(self.stop) > 4:
            raise APIError(400, f"stop takes at most 4 strings, got {len(self.stop)}", "stop")
        if self.stream_options is not None and not self.stream:
            raise APIError(
                400, "stream_options is only allowed with stream: true", "stream_options"
            )

    def sampling_params(
        self,
        default_max_tokens: int,
        structured: StructuredSpec | None = None,
        structured_param: str | None = None,
    ) -> SamplingParams:
        """The engine's SamplingParams (OpenAI defaults: temperature 1, top_p 1); the
        structured output comes from `structured_spec` (server/structured.py), asked for by
        the field `structured_param`."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        bias = None
        if self.logit_bias:
            try:
                bias = {int(token): value for token, value in self.logit_bias.items()}
            except ValueError:
                raise APIError(
                    400, "logit_bias keys must be token ids (strings of integers)", "logit_bias"
                ) from None
        try:
            return SamplingParams(
                max_tokens=self.max_tokens if self.max_tokens is not None else default_max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=0 if self.top_k is None or self.top_k < 0 else self.top_k,  # -1 = off
                min_p=0.0 if self.min_p is None else self.min_p,
                seed=self.seed,
                stop=stop,
                ignore_eos=self.ignore_eos,
                logprobs=self.requested_logprobs(),
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=(
                    1.0 if self.repetition_penalty is None else self.repetition_penalty
                ),
                logit_bias=bias,
                min_tokens=self.min_tokens,
                stop_token_ids=list(self.stop_token_ids or []),
                include_stop_str_in_output=self.include_stop_str_in_output,
                structured=structured,
            )
        except UnderstudyError as error:
            raise error_from_understudy(error, structured_param) from None

    @property
    def include_usage_chunk(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions. One prompt: a string, token ids, or a one-element list of either."""

    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None  # alternatives per token, 0..20

    def requested_logprobs(self) -> int | None:
        return self.logprobs

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo and self.logprobs is not None:
            raise APIError(
                400, "echo with logprobs is not supported (it needs the prompt's logprobs)", "echo"
            )
        if self.suffix:
            raise APIError(400, "suffix is not supported", "suffix")
        if self.best_of not in (None, 1):
            raise APIError(400, f"best_of must be 1, got {self.best_of}", "best_of")

    def engine_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(
                    400, f"prompt: one prompt per request, got a batch of {len(prompt)}", "prompt"
                )
            prompt = prompt[0]
        if not prompt:
            raise APIError(400, "prompt is empty", "prompt")
        return prompt  # type: ignore[return-value]


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer: to which call


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    is_chat: ClassVar[bool] = True

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # the newer name for max_tokens
    logprobs: bool | None = False
    top_logprobs: int | None = None  # alternatives per token, 0..20; needs logprobs: true
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def requested_logprobs(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise APIError(
                400,
                f"top_logprobs must be an integer in 0..{MAX_LOGPROBS}, got {self.top_logprobs}",
                "top_logprobs",
            )
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise APIError(
                    400, "give max_tokens or max_completion_tokens, not both", "max_tokens"
                )
            self.max_tokens = self.max_completion_tokens

    def engine_prompt(self) -> list[dict[str, str]]:
        messages = []
        for message in self.messages:
            content = message.content
            if isinstance(content, list):
                content = "".join(part.text for part in content)
            messages.append({"role": message.role, "content": content or ""})
        return messages


def sse(payload: dict[str, Any] | str) -> bytes:
    """One server-sent event carrying `payload` (a JSON object, or a literal like [DONE])."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode()
