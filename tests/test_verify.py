"""Tests of the chain verifier (understudy.verify.chain), by hand: greedy tables, and the
cases of rejection sampling whose outcome is certain (one-hot p, p(x) >= q(x), p(x) = 0, a
one-hot residual). That its sampled output has the target's law: test_verify_law.py.
"""

from __future__ import annotations

import pytest
import torch

from understudy.config import SamplingParams
from understudy.verify.chain import Verdict, verify_greedy, verify_sampling
from understudy.verify.sampling import warp_probs

# --------------------------------------------------------------------------------------------
# Greedy verification tables
# --------------------------------------------------------------------------------------------

VOCAB = 10
EOS = 7


def logits_with_argmax(argmax_ids: list[int], vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    """Random logits [len(argmax_ids), vocab] whose row-wise argmax is exactly `argmax_ids`."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(argmax_ids), vocab, generator=g)  # [K+1, vocab]
    rows = torch.arange(len(argmax_ids))
    logits[rows, torch.tensor(argmax_ids)] = logits.max() + 1.0
    return logits


GREEDY_TABLE = [
    # (name, draft ids [K], target argmax per position [K+1], expected Verdict)
    ("all_accepted_bonus_is_last_argmax", [3, 1, 4], [3, 1, 4, 2], Verdict(3, 2)),
    ("first_rejected", [3, 1, 4], [0, 1, 4, 2], Verdict(0, 0)),
    ("middle_rejected", [3, 1, 4], [3, 5, 4, 2], Verdict(1, 5)),
    ("last_rejected", [3, 1, 4], [3, 1, 9, 2], Verdict(2, 9)),
    ("later_agreement_after_rejection_is_ignored", [3, 1, 4], [3, 0, 4, 2], Verdict(1, 0)),
    ("k1_accepted", [6], [6, 8], Verdict(1, 8)),
    ("k1_rejected", [6], [5, 8], Verdict(0, 5)),
    # A draft containing EOS: the verifier keeps comparing past it. Truncating the emitted
    # tokens at EOS is the engine's business, not the verifier's.
    ("eos_in_draft_all_accepted", [3, EOS, 4], [3, EOS, 4, 2], Verdict(3, 2)),
    ("eos_in_draft_rejected_after_eos", [3, EOS, 4], [3, EOS, 5, 2], Verdict(2, 5)),
    ("eos_in_draft_rejected_at_eos", [3, EOS, 4], [3, 0, 4, 2], Verdict(1, 0)),
    ("eos_as_correction", [3, 1, 4], [3, EOS, 4, 2], Verdict(1, EOS)),
]


@pytest.mark.parametrize(
    ("draft", "argmax", "expected"),
    [case[1:] for case in GREEDY_TABLE],
    ids=[case[0] for case in GREEDY_TABLE],
)
def test_verify_greedy_table(draft: list[int], argmax: list[int], expected: Verdict) -> None:
    verdict = verify_greedy(torch.tensor(draft), logits_with_argmax(argmax))
    assert verdict == expected
    assert isinstance(verdict.accepted, int) and isinstance(verdict.next_token, int)


@pytest.mark.parametrize("drafter", ["one_hot_q", "random_q", "deterministic"])
def test_verify_sampling_with_one_hot_p_matches_greedy(drafter: str) -> None:
    """temperature 0: p = warp_probs(., greedy) is one-hot, so sampling verification must give
    exactly the greedy verdict, whatever q is and whatever the random numbers are."""
    greedy = SamplingParams(temperature=0.0)
    g = torch.Generator().manual_seed(1)
    verifier_gen = torch.Generator().manual_seed(2)
    n_rejections = 0
    for _ in range(300):
        k = int(torch.randint(1, 6, (1,), generator=g))
        target_logits = torch.randn(k + 1, VOCAB, generator=g)  # [K+1, vocab]
        target_argmax = target_logits.argmax(-1)
        draft = torch.randint(0, VOCAB, (k,), generator=g)  # [K]
        agree = int(torch.randint(0, k + 1, (1,), generator=g))  # force a prefix to agree
        draft[:agree] = target_argmax[:agree]
        if drafter == "one_hot_q":  # a greedy draft model: q = warp(draft logits) is one-hot
            q = torch.nn.functional.one_hot(draft, VOCAB).float()  # [K, vocab]
        elif drafter == "random_q":
            q = torch.rand(k, VOCAB, generator=g) + 0.01  # [K, vocab], positive everywhere
            q = q / q.sum(-1, keepdim=True)
        else:
            q = None
        p = warp_probs(target_logits, greedy)  # [K+1, vocab], one-hot
        expected = verify_greedy(draft, target_logits)
        assert verify_sampling(draft, q, p, verifier_gen) == expected
        n_rejections += expected.accepted < k
    assert 50 < n_rejections < 250  # both branches were exercised


def test_verify_sampling_certain_accept_and_certain_reject() -> None:
    """Hand-made edge cases: p(x) >= q(x) is always accepted; p(x) = 0 is always rejected and
    the correction then never equals the rejected token."""
    g = torch.Generator().manual_seed(0)
    q = torch.tensor([[0.5, 0.5, 0.0, 0.0]])  # [K=1, vocab=4]
    p_accept = torch.tensor([[0.6, 0.1, 0.2, 0.1], [0.0, 0.0, 0.0, 1.0]])  # [K+1, vocab]
    p_reject = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.0, 0.0, 0.0, 1.0]])
    for _ in range(200):
        assert verify_sampling(torch.tensor([0]), q, p_accept, g) == Verdict(1, 3)
        verdict = verify_sampling(torch.tensor([0]), q, p_reject, g)
        assert verdict.accepted == 0 and verdict.next_token in (1, 2)
        verdict = verify_sampling(torch.tensor([0]), None, p_reject, g)
        assert verdict.accepted == 0 and verdict.next_token in (1, 2)


def test_verify_sampling_residual_excludes_tokens_where_q_exceeds_p() -> None:
    """After a rejection the correction comes from norm(max(0, p - q)): with p = (.5, .5, 0)
    and q = (1, 0, 0) the residual is one-hot at token 1, so the correction is always 1."""
    g = torch.Generator().manual_seed(0)
    q = torch.tensor([[1.0, 0.0, 0.0]])
    p = torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])
    verdicts = [verify_sampling(torch.tensor([0]), q, p, g) for _ in range(400)]
    rejected = [v for v in verdicts if v.accepted == 0]
    assert 120 < len(rejected) < 280  # accepted with probability 1/2
    assert all(v.next_token == 1 for v in rejected)
    assert all(v == Verdict(1, 0) for v in verdicts if v.accepted == 1)


def test_verify_sampling_leaves_its_inputs_unchanged() -> None:
    g = torch.Generator().manual_seed(0)
    for q in (torch.softmax(torch.randn(3, 8, generator=g), -1), None):
        p = torch.softmax(torch.randn(4, 8, generator=g), -1)
        ids = torch.tensor([5, 0, 2])
        before = (ids.clone(), None if q is None else q.clone(), p.clone())
        for _ in range(50):
            verify_sampling(ids, q, p, g)
        assert torch.equal(ids, before[0]) and torch.equal(p, before[2])
        assert q is None or torch.equal(q, before[1])
