"""Prompts: a string, a list of token ids, or a chat message list, as prompt token ids."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeGuard

from understudy.config import UnderstudyError, is_unicode_text

if TYPE_CHECKING:
    from typing_extensions import TypeIs

Prompt = str | list[int] | list[dict[str, str]]


def encode_prompt(prompt: Prompt, tokenizer: Any | None, vocab: int, max_context: int) -> list[int]:
    """A string, a list of token ids, or a chat message list -> prompt token ids."""
    if isinstance(prompt, str):
        if not prompt:
            raise UnderstudyError("the prompt is empty")
        if tokenizer is None:
            raise UnderstudyError("this model has no tokenizer: give the prompt as token ids")
        if not is_unicode_text(prompt):
            raise UnderstudyError("the prompt holds a lone surrogate: that is no Unicode text")
        ids = list(tokenizer(prompt)["input_ids"])
    elif is_chat(prompt):
        ids = apply_chat_template(tokenizer, prompt)
    elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        ids = list(prompt)
    else:
        raise UnderstudyError("a prompt is a string, a list of token ids or a list of messages")
    if not ids:
        raise UnderstudyError("the prompt is empty")
    if any(t < 0 or t >= vocab for t in ids):
        raise UnderstudyError(f"prompt token ids must be in 0..{vocab - 1}")
    if len(ids) >= max_context:
        raise UnderstudyError(
            f"the prompt has {len(ids)} tokens; the context holds {max_context} "
            "(prompt + generation): shorten it or raise max_context"
        )
    return ids


def apply_chat_template(tokenizer: Any | None, messages: list[dict[str, str]]) -> list[int]:
    if tokenizer is None or not tokenizer.chat_template:
        raise UnderstudyError("this model has no chat template: give a plain prompt")
    for m in messages:
        if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise UnderstudyError("each chat message needs a string 'role' and 'content'")
        if not is_unicode_text(m["role"]) or not is_unicode_text(m["content"]):
            raise UnderstudyError("a chat message holds a lone surrogate: no Unicode text")
    try:
        out = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )
    except Exception as error:  # a template is the model's code, run on the caller's messages:
        # many raise on a role order they refuse, and some fail with a TypeError instead
        raise UnderstudyError(f"the model's chat template refused the messages: {error}") from None
    return list(out["input_ids"])


def is_chat(prompt: object) -> TypeGuard[list[dict[str, str]]]:
    """A chat message list: a list of dicts (apply_chat_template checks each message)."""
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(m, dict) for m in prompt)


def is_batch(prompt: Prompt | list[Prompt]) -> TypeIs[list[Prompt]]:
    """A list of prompts (strings, token-id lists or chats), not one prompt (an empty list
    is the empty prompt: a list of token ids)."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], str | list)
