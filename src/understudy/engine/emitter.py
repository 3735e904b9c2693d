"""Emission: tokens leave the engine one by one, and text ends exactly where plain decoding's
would, however many tokens a round emits at once.

Text ends at an EOS token or one of `stop_token_ids` (kept in token_ids, not in the text),
after a stop string (cut from the text, or kept with include_stop_str_in_output), at
max_tokens or at the end of the context. Before `min_tokens` tokens no stop string is looked
for (as vLLM does; the stop tokens are masked then, constraints/min_tokens.py). Everything is decided per token, in order, so a
round of five tokens ending at its third is cut after the third, as plain decoding would be.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from understudy.config import SamplingParams
from understudy.engine.detokenize import IncrementalDetokenizer

# per emitted token: (its log-probability, the most likely alternatives as (id, logprob))
TokenLogprobs = tuple[float, list[tuple[int, float]]]


@dataclass(frozen=True)
class TokenEvent:
    """One emitted token. origin: "accepted" (a kept guess), "corrected" (the target's token at
    the first rejection), "bonus" (the target's extra token after all guesses were kept) or
    "target" (a target token from a pass with nothing drafted: the prefill, plain decoding).
    logprob / top_logprobs: only when SamplingParams.logprobs is set (the target's raw
    log-softmax at that position, before processors and warping)."""

    token_id: int
    text: str
    origin: str
    round: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


class Emitter:
    """The request's output so far: token ids, text and why it ended (finish_reason)."""

    def __init__(
        self,
        tokenizer: Any | None,
        eos_token_ids: tuple[int, ...],
        params: SamplingParams,
        budget: int,
    ) -> None:
        self.ends = set(params.stop_token_ids)
        if not params.ignore_eos:
            self.ends |= set(eos_token_ids)
        self.stop = params.stop
        self.min_tokens = params.min_tokens
        self.keep_stop = params.include_stop_str_in_output
        self.budget = budget
        self.detok = IncrementalDetokenizer(tokenizer)
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason = ""

    @property
    def done(self) -> bool:
        return bool(self.finish_reason)

    @property
    def remaining(self) -> int:
        return self.budget - len(self.token_ids)

    def emit(
        self,
        token_ids: list[int],
        origin: str,
        round_index: int,
        logprobs: list[TokenLogprobs] | None = None,
    ) -> Iterator[TokenEvent]:
        for i, token_id in enumerate(token_ids):
            if self.done:
                return
            self.token_ids.append(token_id)
            delta = self.detok.push(token_id)
            if self.stop and delta and len(self.token_ids) >= self.min_tokens:
                delta = self._cut_at_stop(delta)
            self.text += delta
            if token_id in self.ends:
                self.finish_reason = "stop"
            elif len(self.token_ids) >= self.budget and not self.done:
                self.finish_reason = "length"
            logprob, top = logprobs[i] if logprobs is not None else (None, None)
            yield TokenEvent(token_id, delta, origin, round_index, logprob, top)

    def _cut_at_stop(self, delta: str) -> str:
        window_start = max(0, len(self.text) - max(len(s) for s in self.stop))
        window = self.text[window_start:] + delta
        hits = [(i, s) for i, s in ((window.find(s), s) for s in self.stop) if i >= 0]
        if not hits:
            return delta
        self.finish_reason = "stop"
        start, stop = min(hits)
        # index in text + delta where the text ends: before the stop string, or after it
        cut = window_start + start + (len(stop) if self.keep_stop else 0)
        if cut >= len(self.text):
            return (self.text + delta)[len(self.text) : cut]
        self.text = self.text[:cut]
        return ""


def token_logprobs(
    logits: torch.Tensor, token_ids: list[int], top: int | None
) -> list[TokenLogprobs] | None:
    """Row i of `logits` [n, V] is the position of token_ids[i]: its log-probability under the
    raw logits and the `top` most likely tokens there with theirs (None: not asked for)."""
    if top is None:
        return None
    logp = torch.log_softmax(logits.float(), dim=-1)  # [n, V]
    chosen = logp[torch.arange(len(token_ids)), torch.tensor(token_ids)].tolist()
    if top == 0:
        return [(c, []) for c in chosen]
    values, ids = logp.topk(top, dim=-1)  # [n, top]
    return [
        (c, list(zip(i, v, strict=True)))
        for c, i, v in zip(chosen, ids.tolist(), values.tolist(), strict=True)
    ]
