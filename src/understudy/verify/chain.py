"""The verifier: which drafted tokens does the target keep, and what does it emit next?

Vocabulary (engine/stats.py): a round drafts K tokens x_1..x_K. The target scores them
in one pass, giving p_1..p_{K+1} (p_i is the target's distribution for the position of x_i;
p_{K+1} the one after x_K). The verifier keeps the longest accepted prefix x_1..x_a and then
emits exactly one token of its own: the *corrected* token sampled at the first rejection
(a < K), or the *bonus* token sampled from p_{K+1} when every guess was kept (a == K).
So every round emits a + 1 tokens, 1 <= a + 1 <= K + 1.

Invariant (Leviathan et al. 2023, Algorithm 1 and Theorem 1; Chen et al. 2023): each emitted
token is distributed exactly as the target's own sample given the tokens before it. Draft
token x_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)); on rejection the
replacement is drawn from norm(max(0, p_i - q_i)). A deterministic drafter (n-gram lookup)
has q_i = one-hot(x_i). Greedy decoding (temperature 0) is the limit in which p_i is
one-hot at the target's argmax: accept while argmax(p_i) == x_i, then emit the argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from understudy.verify.sampling import sample


@dataclass(frozen=True)
class Verdict:
    """accepted: how many drafted tokens were kept (0..K). next_token: the corrected token
    (accepted < K) or the bonus token (accepted == K)."""

    accepted: int
    next_token: int


def verify_greedy(draft_ids: torch.Tensor, target_logits: torch.Tensor) -> Verdict:
    """Greedy verification: keep drafts while they equal the target's argmax.

    draft_ids: [K] int64; target_logits: [K+1, vocab].
    """
    target_ids = target_logits.argmax(-1)  # [K+1]
    k = draft_ids.shape[0]
    mismatch = (draft_ids != target_ids[:k]).nonzero()
    accepted = int(mismatch[0, 0]) if mismatch.numel() else k
    return Verdict(accepted, int(target_ids[accepted]))


def verify_sampling(
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> Verdict:
    """Rejection-sampling verification (Leviathan et al. 2023, Algorithm 1).

    draft_ids: [K] int64; draft_probs: [K, vocab] (q, after the same warping as p) or None
    for a deterministic drafter (q = one-hot); target_probs: [K+1, vocab] (p, warped).
    """
    k = draft_ids.shape[0]
    rows = torch.arange(k)
    p_draft = target_probs[rows, draft_ids]  # [K]: p_i(x_i)
    q_draft = draft_probs[rows, draft_ids] if draft_probs is not None else torch.ones(k)
    uniforms = torch.rand(k, generator=generator)  # [K]
    rejected = (uniforms * q_draft >= p_draft).nonzero()  # r >= p/q, without dividing by 0
    accepted = int(rejected[0, 0]) if rejected.numel() else k
    if accepted == k:  # every guess kept: the bonus token comes from p_{K+1}
        return Verdict(k, int(sample(target_probs[k : k + 1], generator)))
    p = target_probs[accepted]  # [vocab]
    if draft_probs is not None:
        residual = (p - draft_probs[accepted]).clamp_min(0.0)  # [vocab]
    else:
        residual = p.clone()
        residual[draft_ids[accepted]] = 0.0
    total = residual.sum()
    if total <= 0:  # p == q up to rounding: the residual is empty, p itself is exact
        residual, total = p, p.sum()
    return Verdict(accepted, int(sample((residual / total)[None], generator)))
