"""Parts of request bodies: structured-output formats and tools, in OpenAI's (and vLLM's)
shapes. Validated as strictly as the rest of the protocol (protocol.py)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

_STRICT = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # BaseModel.schema
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: {"type": "text" | "json_object" | "json_schema", ...}."""

    model_config = _STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs: one of json, regex, grammar, choice, json_object."""

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None
    json_object: bool | None = None


class FunctionCall(BaseModel):
    model_config = _STRICT
    name: str
    arguments: str  # JSON text


class ToolCallMessage(BaseModel):
    model_config = _STRICT
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(BaseModel):
    model_config = _STRICT
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class Tool(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = _STRICT
    name: str


class NamedToolChoice(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: NamedFunction
