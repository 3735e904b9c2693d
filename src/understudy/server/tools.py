"""Tool calling for /v1/chat/completions: the prompt, the constraint, and the parser.

- The prompt: the model's own chat template renders the tools and the tool messages
  (`apply_chat_template(tools=...)`); a template that ignores `tools` is refused (400), as
  the model would never see them.
- tool_choice "none": tools are in the prompt, the output is plain content. "auto" (the
  default with tools): the output is parsed for the Qwen2.5 family's calls,
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, or the same object in a code
  block or alone, as Qwen2.5-Coder writes them (ToolCallStream). A named function: the output is
  constrained to a JSON object valid for its parameters, and becomes that call's arguments.
  "required": the output is constrained to a JSON array of {"name", "parameters"} objects,
  one per call (vLLM's format for both), at most one when parallel_tool_calls is false.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Literal

from understudy.config import StructuredSpec
from understudy.server.protocol import APIError, ChatCompletionRequest

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FENCE = "```"
# "off": no tools; else tool_choice: "none", "auto", "required", or "named" (one function)
ToolMode = Literal["off", "none", "auto", "required", "named"]
ScanState = Literal["text", "tag", "fence", "bare"]  # text, in <tool_call>, in ```, a bare {
_FENCED = re.compile(r"```[\w-]*[ \t]*\n?(.*?)(?:```)?\s*", re.DOTALL)  # a code block


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str

    def wire(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return out if index is None else {"index": index, **out}


def new_call(name: str, arguments: Any) -> ToolCall:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(name, text, "call_" + uuid.uuid4().hex[:24])


def tool_mode(body: ChatCompletionRequest) -> ToolMode:
    """ "off" (no tools), "none", "auto", "required" or "named"."""
    if not body.tools:
        if body.tool_choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", "tool_choice")
        return "off"
    choice = body.tool_choice or "auto"
    if isinstance(choice, str):
        mode: ToolMode = choice
    else:
        names = [tool.function.name for tool in body.tools]
        if choice.function.name not in names:
            raise APIError(
                400,
                f"tool_choice names the function {choice.function.name!r}, "
                f"which is not among the tools ({', '.join(names)})",
                "tool_choice",
            )
        mode = "named"
    if body.parallel_tool_calls is False and mode == "auto":
        raise APIError(
            400,
            "parallel_tool_calls: false needs tool_choice 'required' or a named function "
            "(an unconstrained output may hold several calls)",
            "parallel_tool_calls",
        )
    return mode


def _parameters(tool: Any) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def tool_constraint(body: ChatCompletionRequest, mode: ToolMode) -> StructuredSpec | None:
    """The JSON schema a named or required tool_choice constrains the output to."""
    if mode == "named":
        name = body.tool_choice.function.name  # type: ignore[union-attr]
        tool = next(t for t in body.tools if t.function.name == name)  # type: ignore[union-attr]
        return StructuredSpec(json_schema=_parameters(tool))
    if mode == "required":
        items = [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [t.function.name]},
                    "parameters": _parameters(t),
                },
                "required": ["name", "parameters"],
            }
            for t in body.tools  # type: ignore[union-attr]
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if body.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return StructuredSpec(json_schema=schema)
    return None


def template_messages(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as chat templates expect them: tool calls' arguments as objects."""
    out = []
    for message in body.messages:
        content = message.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        entry: dict[str, Any] = {"role": message.role, "content": content or ""}
        if message.name is not None:
            entry["name"] = message.name
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        if message.tool_calls:
            entry["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": _as_object(call.function.arguments),
                    },
                }
                for call in message.tool_calls
            ]
        out.append(entry)
    return out


def _as_object(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def render_prompt(tokenizer: Any, body: ChatCompletionRequest) -> list[int]:
    """Prompt token ids from the model's chat template, with the tools rendered."""
    if tokenizer is None or not tokenizer.chat_template:
        raise APIError(400, "this model has no chat template: it cannot take tools", "tools")
    messages = template_messages(body)
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []]

    def render(with_tools: list[dict[str, Any]] | None) -> list[int]:
        out = tokenizer.apply_chat_template(
            messages, tools=with_tools, add_generation_prompt=True, tokenize=True
        )
        return list(out["input_ids"] if isinstance(out, dict) or "input_ids" in out else out)

    try:
        ids = render(tools or None)
        if tools and ids == render(None):
            raise APIError(
                400,
                "this model's chat template does not render tools: it cannot take them",
                "tools",
            )
    except APIError:
        raise
    except Exception as error:  # jinja's errors: the template refused these messages
        message = f"the chat template cannot render these messages: {error}"
        raise APIError(400, message, "messages") from None
    return ids


def parse_tool_calls(text: str, names: Collection[str] = ()) -> tuple[str, list[ToolCall]]:
    """ "auto": the content beside the calls, and the calls (ToolCallStream's rules, on the
    whole text at once). Without calls the content is the text as it is."""
    stream = ToolCallStream(names)
    content, calls = stream.push(text)
    rest, more = stream.finish()
    calls += more
    return ((content + rest).strip(), calls) if calls else (text, [])


def _call_from_json(text: str, names: Collection[str] | None = None) -> ToolCall | None:
    """The call in `text`, a JSON object {"name", "arguments"}, or None. With `names` (the
    untagged forms) the name must be one of the request's tools and the arguments an object
    (vLLM's "parameters" key is taken too), so that ordinary JSON is never taken for a call."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    if names is None:
        return new_call(value["name"], value.get("arguments", {}))
    arguments = value.get("arguments", value.get("parameters"))
    if value["name"] not in names or not isinstance(arguments, dict):
        return None
    return new_call(value["name"], arguments)


def _fenced_call(block: str, names: Collection[str]) -> ToolCall | None:
    """The call in a Markdown code block (```json ... ```, closed or not), or None."""
    match = _FENCED.fullmatch(block)
    return None if match is None else _call_from_json(match.group(1).strip(), names)


def constrained_calls(text: str, mode: ToolMode, name: str | None) -> list[ToolCall]:
    """ "named" / "required": the calls in an output the grammar kept to their schema (an
    output cut short by max_tokens or a stop string may not parse: then no calls)."""
    try:
        value = json.loads(text)
    except ValueError:
        return []
    if mode == "named":
        return [new_call(name or "", text)]
    return [new_call(item["name"], item["parameters"]) for item in value]


class ToolCallStream:
    """ "auto" while streaming: text deltas in, (content delta, finished calls) out.

    A call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the Qwen2.5 chat
    template's format, any name) or, as the Qwen2.5-Coder models often write it instead,
    the same object in a Markdown code block or as the whole output, naming one of the
    request's tools (`names`; llama.cpp's parser for this family takes the same forms).
    Text that might be the start of a tag or a code block waits until the next delta settles
    it; a code block, or an output that starts with "{", is held until it is complete, and
    is content unless it is a call. A call is sent whole once it has ended."""

    def __init__(self, names: Collection[str] = ()) -> None:
        self.names = frozenset(names)
        self.buffer = ""
        self.state: ScanState = "text"
        self.spoke = False  # content other than white space has been sent
        self.calls = 0

    def push(self, delta: str) -> tuple[str, list[ToolCall]]:
        self.buffer += delta
        content, calls = "", []
        while True:
            if self.state == "tag":
                end = self.buffer.find(CLOSE)
                if end < 0:
                    return content, calls
                body, self.buffer = self.buffer[:end], self.buffer[end + len(CLOSE) :]
                self.state = "text"
                call = _call_from_json(body.strip())
                content += self._said(OPEN + body + CLOSE) if call is None else ""
                calls += [call] if call is not None else []
                continue
            if self.state == "fence":
                end = self.buffer.find(FENCE, len(FENCE))
                if end < 0:
                    return content, calls
                block, self.buffer = self.buffer[: end + 3], self.buffer[end + 3 :]
                self.state = "text"
                call = _fenced_call(block, self.names)
                content += self._said(block) if call is None else ""
                calls += [call] if call is not None else []
                continue
            if self.state == "bare":
                return content, calls  # settled by `finish`
            if self.names and not self.spoke:
                first = self.buffer.lstrip()[:1]
                if not first:
                    return content, calls  # only white space so far: it waits
                if first == "{":
                    self.state = "bare"
                    continue
            openers: list[tuple[int, ScanState]] = [(self.buffer.find(OPEN), "tag")]
            if self.names:
                openers.append((self.buffer.find(FENCE), "fence"))
            found = [(i, state) for i, state in openers if i >= 0]
            if found:
                i, state = min(found)
                content += self._said(self.buffer[:i])
                skip = len(OPEN) if state == "tag" else 0  # a fence stays in the block
                self.buffer, self.state = self.buffer[i + skip :], state
                continue
            held = max(_prefix_held(self.buffer, OPEN), _prefix_held(self.buffer, FENCE))
            content += self._said(self.buffer[: len(self.buffer) - held])
            self.buffer = self.buffer[len(self.buffer) - held :]
            return content, calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is left: an unclosed tag or code block, or a whole output that is no call,
        is content; a whole output, or an unclosed code block, that is a call is a call."""
        rest, state = self.buffer, self.state
        self.buffer, self.state = "", "text"
        call = None
        if state == "bare":
            call = _call_from_json(rest.strip(), self.names)
        elif state == "fence":
            call = _fenced_call(rest, self.names)
        if call is not None:
            return "", [call]
        return (OPEN + rest if state == "tag" else rest), []

    def _said(self, text: str) -> str:
        self.spoke = self.spoke or bool(text.strip())
        return text


def _prefix_held(text: str, opener: str) -> int:
    """The length of the longest end of `text` that is a proper start of `opener`."""
    for n in range(min(len(opener) - 1, len(text)), 0, -1):
        if text.endswith(opener[:n]):
            return n
    return 0
