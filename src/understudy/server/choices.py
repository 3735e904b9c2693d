"""The choices of a response, assembled from the engine's events, streamed or whole.

A request with `n` choices runs n sequences (generation.py: together on the seats, or one
after another on a one-seat engine); events carry the choice's index. `Choice` keeps one
choice's state: the text held back while it may still become a stop string (StopHoldback),
its logprobs (logprobs.py) and its tool calls (tools.py). Streaming, `on_token` /
`on_done` return the chunk choices to send now; whole, `whole` returns the response's
choice. Streamed logprobs travel with the next chunk that carries text, so every token's
entry is sent once, in order, by the last chunk.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from understudy.server.generation import StopHoldback
from understudy.server.logprobs import (
    TokenStrings,
    chat_entry,
    chat_logprobs,
    completion_logprobs,
)
from understudy.server.tools import (
    ToolCall,
    ToolCallStream,
    ToolMode,
    constrained_calls,
    parse_tool_calls,
)


@dataclass(frozen=True)
class Shape:
    """What the request asked its response to look like."""

    chat: bool
    stop: list[str]
    logprobs: bool = False  # include logprobs (the engine computes them when asked)
    tool_mode: ToolMode = "off"  # tools.py
    tool_name: str | None = None  # the named function
    tool_names: tuple[str, ...] = ()  # every tool's name ("auto" takes untagged calls of these)
    echo: str = ""  # completions' echo: the prompt's text, sent before the completion


class Choice:
    def __init__(self, index: int, shape: Shape, strings: TokenStrings) -> None:
        self.index = index
        self.shape = shape
        self.strings = strings
        self.holdback = StopHoldback(shape.stop)
        auto = shape.chat and shape.tool_mode == "auto"
        self.tools = ToolCallStream(shape.tool_names) if auto else None
        self.events: list[Any] = []  # with logprobs: every token's event
        self.offsets: list[int] = []  # completions: where each token's text starts
        self.sent_events = 0  # events whose logprobs have been sent (streaming)
        self.calls_sent = 0
        self.text_len = len(shape.echo)
        self.prefix = shape.echo  # streaming: sent with the first text
        self.started = False

    # -- streaming ---------------------------------------------------------------------

    def on_token(self, event: Any) -> list[dict[str, Any]]:
        out = self._start()
        if self.shape.logprobs:
            self.events.append(event)
            self.offsets.append(self.text_len)
        self.text_len += len(event.text)
        if self.constrained_calls:
            return out  # the whole output is the calls' JSON: sent once it is complete
        return out + self._deltas(self.holdback.push(event.text))

    @property
    def constrained_calls(self) -> bool:
        return self.shape.chat and self.shape.tool_mode in ("named", "required")

    def on_done(self, output: Any) -> list[dict[str, Any]]:
        out = self._start()
        rest = self.holdback.finish(output.text)
        calls: list[ToolCall] = []
        if self.constrained_calls:
            calls = constrained_calls(output.text, self.shape.tool_mode, self.shape.tool_name)
            rest = "" if calls else output.text
        out += self._deltas(rest, calls, final=True)
        if not out:
            out.append(self._chunk({}, None))
        out[-1]["finish_reason"] = self._finish_reason(output, bool(calls) or self.calls_sent > 0)
        return out

    def _start(self) -> list[dict[str, Any]]:
        if self.started or not self.shape.chat:
            self.started = True
            return []
        self.started = True
        return [self._chunk({"role": "assistant", "content": ""}, None)]

    def _deltas(
        self, text: str, calls: list[ToolCall] | None = None, final: bool = False
    ) -> list[dict[str, Any]]:
        calls = list(calls or [])
        if self.tools is not None:
            content, found = self.tools.push(text)
            if final:
                rest, more = self.tools.finish()
                content, found = content + rest, found + more
            text, calls = content, found + calls
        if self.prefix and (text or final):
            text, self.prefix = self.prefix + text, ""
        out = []
        if text or (final and not calls and self.sent_events < len(self.events)):
            out.append(self._text_chunk(text))
        for call in calls:
            delta = {"tool_calls": [call.wire(self.calls_sent)]}
            self.calls_sent += 1
            out.append(self._chunk(delta, self._pending_logprobs()))
        return out

    def _text_chunk(self, text: str) -> dict[str, Any]:
        if self.shape.chat:
            return self._chunk({"content": text}, self._pending_logprobs())
        return {
            "index": self.index,
            "text": text,
            "logprobs": self._pending_logprobs(),
            "finish_reason": None,
        }

    def _chunk(self, delta: dict[str, Any], logprobs: Any) -> dict[str, Any]:
        if not self.shape.chat:
            return {"index": self.index, "text": "", "logprobs": logprobs, "finish_reason": None}
        return {"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": None}

    def _pending_logprobs(self) -> dict[str, Any] | None:
        if not self.shape.logprobs:
            return None
        start, self.sent_events = self.sent_events, len(self.events)
        return self._logprobs(start, self.sent_events)

    def _logprobs(self, start: int, end: int) -> dict[str, Any]:
        events = self.events[start:end]
        if self.shape.chat:
            return chat_logprobs([chat_entry(e, self.strings) for e in events])
        return completion_logprobs(events, self.offsets[start:end], self.strings)

    def _finish_reason(self, output: Any, called: bool) -> str:
        if called and self.shape.tool_mode in ("auto", "required"):
            return "tool_calls"
        return output.stats.finish_reason

    # -- whole -------------------------------------------------------------------------

    def whole(self, output: Any) -> dict[str, Any]:
        """The response's choice for a finished generation whose events all went through
        `on_token`."""
        logprobs = self._logprobs(0, len(self.events)) if self.shape.logprobs else None
        choice: dict[str, Any] = {"index": self.index, "logprobs": logprobs}
        if not self.shape.chat:
            choice["text"] = self.shape.echo + output.text
            choice["finish_reason"] = output.stats.finish_reason
            return choice
        content: str | None = output.text
        calls: list[ToolCall] = []
        if self.shape.tool_mode == "auto":
            content, calls = parse_tool_calls(output.text, self.shape.tool_names)
        elif self.shape.tool_mode in ("named", "required"):
            calls = constrained_calls(output.text, self.shape.tool_mode, self.shape.tool_name)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:  # the text beside "auto" calls, if any, stays; a constrained one is the calls
            message["content"] = (content or None) if self.shape.tool_mode == "auto" else None
            message["tool_calls"] = [call.wire() for call in calls]
        choice["message"] = message
        choice["finish_reason"] = self._finish_reason(output, bool(calls))
        return choice


class Assembly:
    """A response's choices and the envelope around them (ids, usage, speculative stats).
    `metrics.speculative_decoding` holds the first choice's stats; with n > 1 every choice
    also carries its own under `metrics`."""

    def __init__(
        self, shape: Shape, n: int, strings: TokenStrings, response_id: str, model: str
    ) -> None:
        self.shape = shape
        self.choices = [Choice(i, shape, strings) for i in range(n)]
        self.outputs: list[Any] = []
        self.response_id = response_id
        self.model = model
        self.created = int(time.time())

    def usage(self, prompt_tokens: int) -> dict[str, int]:
        completion = sum(len(output.token_ids) for output in self.outputs)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
        }

    def _envelope(self, chunk: bool) -> dict[str, Any]:
        kind = "chat.completion" if self.shape.chat else "text_completion"
        return {
            "id": self.response_id,
            "object": kind + ".chunk" if chunk and self.shape.chat else kind,
            "created": self.created,
            "model": self.model,
        }

    def _metrics(self) -> dict[str, Any]:
        return {"speculative_decoding": self.outputs[0].stats.to_dict()}

    def whole(self, prompt_tokens: int) -> dict[str, Any]:
        choices = [c.whole(o) for c, o in zip(self.choices, self.outputs, strict=True)]
        if len(choices) > 1:
            for choice, output in zip(choices, self.outputs, strict=True):
                choice["metrics"] = {"speculative_decoding": output.stats.to_dict()}
        return {
            **self._envelope(chunk=False),
            "choices": choices,
            "usage": self.usage(prompt_tokens),
            "metrics": self._metrics(),
        }

    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {**self._envelope(chunk=True), "choices": choices}

    def on_token(self, index: int, event: Any) -> list[dict[str, Any]]:
        return [self.chunk([c]) for c in self.choices[index].on_token(event)]

    def on_done(self, index: int, output: Any, prompt_tokens: int) -> list[dict[str, Any]]:
        """The choice's last chunks; the last choice's final chunk carries the usage and
        the speculative stats."""
        self.outputs.append(output)
        chunks = [self.chunk([c]) for c in self.choices[index].on_done(output)]
        if len(self.choices) > 1:
            chunks[-1]["choices"][0]["metrics"] = {"speculative_decoding": output.stats.to_dict()}
        if index == len(self.choices) - 1:
            chunks[-1]["usage"] = self.usage(prompt_tokens)
            chunks[-1]["metrics"] = self._metrics()
        return chunks

    def usage_chunk(self, prompt_tokens: int) -> dict[str, Any]:
        """stream_options.include_usage: a last chunk with no choices, only the usage."""
        return {**self.chunk([]), "usage": self.usage(prompt_tokens)}
