"""The processor a request's sampling parameters ask for: the processors of this package,
chained in a fixed order (base.py's protocol, so speculation stays lossless under it)."""

from __future__ import annotations

from typing import Any

from understudy.config import SamplingParams
from understudy.constraints.base import Composite, LogitsProcessor
from understudy.constraints.bias import LogitBias
from understudy.constraints.grammar import GrammarProcessor
from understudy.constraints.min_tokens import MinTokens
from understudy.constraints.penalties import Penalties


def build_processor(
    params: SamplingParams,
    tokenizer: Any,
    vocab_size: int,
    eos_token_ids: tuple[int, ...],
) -> LogitsProcessor | None:
    """The processor `params` ask for, or None when they ask for nothing (the engine's fast
    path stays untouched). Order, as vLLM's sampler: logit_bias, min_tokens, penalties, then
    the grammar (last, so that what it allows is decided on the final logits). Raises
    UnderstudyError for a token id outside the vocabulary or a grammar that does not compile.
    `tokenizer` is only needed for structured output."""
    stop_ids = tuple(params.stop_token_ids)
    eos = () if params.ignore_eos else tuple(eos_token_ids)
    parts: list[LogitsProcessor] = []
    if params.logit_bias:
        parts.append(LogitBias(params.logit_bias, vocab_size))
    if params.min_tokens > 0 and (eos or stop_ids):
        parts.append(MinTokens(params.min_tokens, (*eos, *stop_ids), vocab_size))
    if (
        params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
        or params.repetition_penalty != 1.0
    ):
        parts.append(
            Penalties(
                vocab_size,
                params.presence_penalty,
                params.frequency_penalty,
                params.repetition_penalty,
            )
        )
    if params.structured is not None:
        stops = tuple(dict.fromkeys((*eos_token_ids, *stop_ids)))
        parts.append(GrammarProcessor.build(params.structured, tokenizer, vocab_size, stops))
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else Composite(parts)
