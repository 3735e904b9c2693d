"""What the OpenAPI document (/openapi.json) says each route can answer, errors included.

FastAPI documents a 200 and its own 422 shape by default; our errors all use OpenAI's
envelope (protocol.APIError), so every status a route can give is listed here with that
schema, and the streaming routes list their text/event-stream 200 beside the JSON one.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

DESCRIPTIONS = {
    400: "The request is invalid: `error.param` names the field.",
    401: "The API key is missing or wrong (`Authorization: Bearer <key>`).",
    404: "No such model (`error.param` is `model`) or route.",
    408: "The request body did not arrive in time.",
    413: "The request body is too large.",
    422: "The body does not match the schema: `error.param` names the field.",
    429: "The queue is full: retry later.",
    500: "The engine failed on this request; the server goes on.",
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """OpenAI's error envelope."""

    error: ErrorDetail


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """FastAPI `responses` entries for these error statuses."""
    return {s: {"model": ErrorBody, "description": DESCRIPTIONS[s]} for s in statuses}


# One server-sent event, as OpenAPI 3.2 describes a text/event-stream item: every event we
# send is a `data:` line holding one JSON object (or the literal [DONE]).
SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "data": {"type": "string", "description": "one JSON object, or [DONE]"},
        "event": {"type": "string"},
        "id": {"type": "string"},
        "retry": {"type": "integer"},
    },
}


def event_stream(description: str) -> dict[int | str, dict[str, Any]]:
    """A 200 that may be (or always is) a stream of server-sent events."""
    return {
        200: {"description": description, "content": {"text/event-stream": {"schema": SSE_EVENT}}}
    }


def body_examples(**examples: tuple[str, dict[str, Any]]) -> dict[str, Any]:
    """A route's `openapi_extra`: named examples (summary, body) of its JSON request body,
    which a client can send as they are (a fuzzer such as schemathesis mixes them into what
    it sends)."""
    named = {
        name: {"summary": summary, "value": body} for name, (summary, body) in examples.items()
    }
    return {"requestBody": {"content": {"application/json": {"examples": named}}}}


def request_examples(model: str, chat: bool) -> dict[str, Any]:
    """Examples of a /v1 request body, naming the served model."""
    prompt: dict[str, Any] = (
        {"messages": [{"role": "user", "content": "Say hello."}]}
        if chat
        else {"prompt": "def add(a, b):"}
    )
    base = {"model": model, **prompt, "max_tokens": 8}
    return body_examples(
        greedy=("Greedy", {**base, "temperature": 0}),
        sampled=(
            "Seeded sampling, two choices, streamed",
            {**base, "temperature": 0.8, "seed": 1, "n": 2, "stream": True},
        ),
    )


def plain_text(description: str) -> dict[int | str, dict[str, Any]]:
    return {
        200: {"description": description, "content": {"text/plain": {"schema": {"type": "string"}}}}
    }
