"""Logprobs in OpenAI's two shapes, from the engine's TokenEvents.

Each TokenEvent carries `logprob` (the emitted token's) and `top_logprobs` (the n most likely
(token id, logprob) pairs): the target's log-softmax of its RAW logits at that position,
before penalties, logit bias, grammar masks and temperature / top-k / top-p (vLLM's default
"raw_logprobs"), so they describe the model, not the constrained sampler.

- /v1/completions (`logprobs: n`): {"tokens", "token_logprobs", "top_logprobs" (one
  {token: logprob} dict per token), "text_offset" (where each token's text starts)}.
- /v1/chat/completions (`logprobs: true`, `top_logprobs: n`): {"content": [{"token",
  "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}.

A token's string is its own decoding; `bytes` are its exact bytes where the tokenizer is
byte-level BPE (the Qwen and GPT-2 families), else the UTF-8 of that string. Without a
tokenizer a token reads "token_id:<id>" (vLLM's spelling).
"""

from __future__ import annotations

import functools
from typing import Any


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: printable stand-in character -> the byte it stands for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class TokenStrings:
    """Strings and bytes of token ids, memoised per id."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._compute(token_id)
        return hit

    def _compute(self, token_id: int) -> tuple[str, list[int]]:
        if self.tokenizer is None:
            text = f"token_id:{token_id}"
            return text, list(text.encode())
        text = self.tokenizer.decode([token_id])
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        table = _byte_decoder()
        if isinstance(piece, str) and piece and all(c in table for c in piece):
            return text, [table[c] for c in piece]
        return text, list(text.encode())


def chat_entry(event: Any, strings: TokenStrings) -> dict[str, Any]:
    """One element of choices[i].logprobs.content."""
    token, raw = strings(event.token_id)
    return {
        "token": token,
        "logprob": event.logprob,
        "bytes": raw,
        "top_logprobs": [
            {"token": strings(t)[0], "logprob": lp, "bytes": strings(t)[1]}
            for t, lp in event.top_logprobs or []
        ],
    }


def chat_logprobs(entries: list[dict[str, Any]]) -> dict[str, Any]:
    return {"content": entries}


def completion_logprobs(
    events: list[Any], offsets: list[int], strings: TokenStrings
) -> dict[str, Any]:
    """The legacy shape for these events; offsets[i] is where event i's text starts."""
    return {
        "tokens": [strings(e.token_id)[0] for e in events],
        "token_logprobs": [e.logprob for e in events],
        "top_logprobs": [_top_dict(e.top_logprobs or [], strings) for e in events],
        "text_offset": offsets,
    }


def _top_dict(top: list[tuple[int, float]], strings: TokenStrings) -> dict[str, float]:
    """{token string: logprob}, most likely first; tokens whose strings are equal (pieces
    of one UTF-8 character, say) keep the likeliest one's logprob."""
    out: dict[str, float] = {}
    for token_id, logprob in top:
        out.setdefault(strings(token_id)[0], logprob)
    return out
