"""Fields clients send that this server does not implement: a 400 naming the field, never a
reply that silently differs from what was asked.

The request models take fields they do not know (as vLLM does: OpenAI adds fields often, and
most are bookkeeping such as `store` or `metadata`). The fields below are known, and each
changes the reply when given: OpenAI's deprecated functions API and its audio output, and
vLLM's extras for beam search, prompt logprobs, token filters and chat templates. Each is
accepted only with the value that asks for nothing (`use_beam_search: false`, `echo: false`,
`skip_special_tokens: true`, the engine's own behaviour).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _absent(value: Any) -> bool:
    """Nothing asked: null, false, 0, or an empty string, list or object."""
    return value is None or value is False or value == 0 or value in ("", [], {})


def _one_of(*neutral: Any) -> Callable[[Any], bool]:
    return lambda value: (
        value is None or any(value == n and type(value) is type(n) for n in neutral)
    )


Rule = tuple[Callable[[Any], bool], str]  # (asks for nothing?, why it is refused)

EVERYWHERE: dict[str, Rule] = {
    "use_beam_search": (_absent, "beam search is not supported"),
    "length_penalty": (_one_of(1, 1.0), "length_penalty applies to beam search only"),
    "prompt_logprobs": (_absent, "prompt logprobs are not supported"),
    "bad_words": (_absent, "bad_words is not supported (logit_bias can forbid tokens)"),
    "allowed_token_ids": (_absent, "allowed_token_ids is not supported"),
    "truncate_prompt_tokens": (_absent, "prompts are never truncated"),
    "logits_processors": (_absent, "custom logits processors are not supported"),
    "return_tokens_as_token_ids": (_absent, "tokens are returned as text"),
    "skip_special_tokens": (_one_of(True), "special tokens are always left out of the text"),
    "guided_whitespace_pattern": (
        _absent,
        "JSON output has fixed separators and no other whitespace",
    ),
}
IN_CHAT: dict[str, Rule] = {
    "functions": (_absent, "the functions API is deprecated: send tools"),
    "function_call": (_one_of("none"), "the functions API is deprecated: send tool_choice"),
    "audio": (_absent, "audio output is not supported"),
    "modalities": (_one_of(["text"]), "only text output is supported"),
    "web_search_options": (_absent, "web search is not supported"),
    "echo": (_absent, "echo is not supported in chat"),
    "add_generation_prompt": (_one_of(True), "the prompt always ends with the assistant's turn"),
    "continue_final_message": (_absent, "the prompt always starts a new assistant turn"),
    "chat_template": (_absent, "the model's own chat template is used"),
    "chat_template_kwargs": (_absent, "chat_template_kwargs is not supported"),
    "documents": (_absent, "documents are not supported"),
}


def refused_field(extra: dict[str, Any] | None, chat: bool) -> tuple[str, str] | None:
    """(field, message) for the first field of `extra` (a body's unknown fields) that asks for
    something this server does not do, or None."""
    rules = {**EVERYWHERE, **IN_CHAT} if chat else EVERYWHERE
    for name, value in (extra or {}).items():
        rule = rules.get(name)
        if rule is not None and not rule[0](value):
            return name, f"{name}: {rule[1]}"
    return None
