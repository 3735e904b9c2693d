"""Structured output from the request: OpenAI's `response_format` and vLLM's `guided_*` /
`structured_outputs` extras, each turned into one `StructuredSpec` (a logits processor in
the engine, understudy.constraints.grammar). Asking for two at once is a 400 naming both."""

from __future__ import annotations

import json
from typing import Any

from understudy.config import StructuredSpec, UnderstudyError
from understudy.server.protocol import APIError
from understudy.server.request_parts import ResponseFormat, StructuredOutputs


def _schema(value: dict[str, Any] | str, param: str) -> dict[str, Any] | str:
    if isinstance(value, str):
        try:
            json.loads(value)
        except ValueError as error:
            raise APIError(400, f"{param} is not valid JSON: {error}", param) from None
    return value


def structured_spec(body: Any) -> tuple[StructuredSpec, str] | None:
    """The one structured-output request in `body` (its response_format, guided_json,
    guided_regex, guided_grammar, guided_choice or structured_outputs) and the field that
    asked for it (which an error about the grammar names), or None."""
    asked: list[tuple[str, dict[str, Any]]] = []
    fmt: ResponseFormat | None = body.response_format
    if fmt is not None and fmt.type == "json_object":
        asked.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise APIError(
                400,
                "response_format of type json_schema needs json_schema.schema",
                "response_format",
            )
        asked.append(("response_format", {"json_schema": fmt.json_schema.schema_}))
    if body.guided_json is not None:
        asked.append(("guided_json", {"json_schema": _schema(body.guided_json, "guided_json")}))
    for name, key in (("guided_regex", "regex"), ("guided_grammar", "grammar")):
        if getattr(body, name) is not None:
            asked.append((name, {key: getattr(body, name)}))
    if body.guided_choice is not None:
        asked.append(("guided_choice", {"choice": tuple(body.guided_choice)}))
    outputs: StructuredOutputs | None = body.structured_outputs
    if outputs is not None:
        fields = {
            "json_schema": outputs.json_
            if outputs.json_ is None
            else _schema(outputs.json_, "structured_outputs.json"),
            "regex": outputs.regex,
            "grammar": outputs.grammar,
            "choice": None if outputs.choice is None else tuple(outputs.choice),
            "json_object": bool(outputs.json_object),
        }
        asked.append(("structured_outputs", {k: v for k, v in fields.items() if v}))
    if not asked:
        return None
    if len(asked) > 1:
        names = ", ".join(name for name, _ in asked)
        raise APIError(400, f"give one structured output, got {names}", asked[1][0])
    param, fields = asked[0]
    try:
        return StructuredSpec(**fields), param
    except UnderstudyError as error:
        raise APIError(400, f"{param}: {error}", param) from None
