"""Logits -> probabilities, with the warps every method applies identically.

The same function warps the target's logits (p) and the drafter's (q): lossless rejection
sampling needs p and q to be the distributions actually sampled from (verify/chain.py).
Order (as in transformers and vLLM): temperature, then top-k, then top-p, then min-p.
"""

from __future__ import annotations

import torch

from understudy.config import SamplingParams


def warp_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Return the sampling distribution for each row of `logits`.

    logits: [n, vocab] (any float dtype). Returns float32 probabilities [n, vocab], each row
    summing to 1. Greedy (temperature 0) gives a one-hot row at the argmax.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    # softmax(l / T) = softmax((l - max l) / T): shifted first, the top logit is exactly 0 and
    # every other one <= 0, so even a tiny T (down to 2**-126, SamplingParams' floor) gives
    # -inf at worst, never inf - inf = NaN.
    logits = (logits - logits.amax(-1, keepdim=True)) / params.temperature  # [n, vocab]
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [n, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs  # [n, vocab]
        drop_sorted = mass_before >= params.top_p  # [n, vocab]
        # The most likely token always stays, even for a top_p that rounds to 0 in float32.
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    if params.min_p > 0.0:
        threshold = params.min_p * probs.max(-1, keepdim=True).values  # [n, 1]
        probs = probs.masked_fill(probs < threshold, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row. probs: [n, vocab] -> [n] int64."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def make_generator(seed: int | None) -> torch.Generator:
    """A private generator per request: the same seed gives the same output."""
    gen = torch.Generator()
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen
