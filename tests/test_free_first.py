"""Free guesses first (drafters/free_first.py): method="eagle" with free_drafts drafts a round
from the text itself where that pays more than the head's round.

The choice on its own (a real n-gram drafter on repetitive text), then the same proofs as
every method: greedy output equals plain decoding (chains, trees, a batch), with rounds of
both kinds; the sampled joint law of 3 tokens is the target's (chi-squared, p > 0.001), and
free guesses handed to the verifier with a wrong q fail the same test.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eagle_helpers import SETTINGS, target_written_text, train_greedy_head
from test_exactness import P_THRESHOLD, WARPS, goodness_of_fit
from understudy import Engine, SamplingParams, UnderstudyError
from understudy.drafters.base import Proposal
from understudy.drafters.free_first import HEAD_PRIOR_RATE, FreeFirst
from understudy.drafters.hybrid import DECAY, bucket
from understudy.drafters.ngram import NgramProposer
from understudy.head.pipeline import train_head
from understudy.models.loader import load_model
from understudy.policy.costs import Costs, PassCurve

# a row costs a tenth of a pass: T(n) = 1 + 0.1 (n - 1)
COSTS = Costs(draft_step=0.05, row=0.1, pass_curve=PassCurve((1, 9), (1.0, 1.8)))
REPEATED = [5, 17, 99, 3, 42, 8, 61, 23] * 4  # every 8-token run already in the text


def repetitive_prompts(n: int, seed: int) -> list[list[int]]:
    """Random 12-token texts, each written out twice: the second copy is the free drafter's."""
    g = torch.Generator().manual_seed(seed)
    halves = [torch.randint(1, 300, (12,), generator=g).tolist() for _ in range(n)]
    return [half + half[:6] for half in halves] + [half * 2 for half in halves]


def test_a_long_match_is_drafted_free_and_a_better_head_keeps_the_round():
    free_first = FreeFirst(NgramProposer(), COSTS)
    free_first.begin(REPEATED[:20])
    guesses = free_first.offer(REPEATED[:20], 8)
    assert guesses and guesses == REPEATED[20 : 20 + len(guesses)]  # what the text repeats
    free_first.commit(REPEATED[: 20 + len(guesses) + 1])  # all kept: the bucket learns it
    assert free_first.rounds == {"free": 1, "head": 0}
    # a head whose rounds keep 6 tokens a pass-equivalent beats the same match
    for _ in range(20):
        free_first.head_round(REPEATED[:20], rows=7, steps=7)
        free_first.commit(REPEATED[:20] + [0] * 12)  # 12 tokens for a round of cost 2.0
    assert free_first.head_rate() > 5.0
    assert free_first.offer(REPEATED[:20], 8) == []


def test_kept_and_missed_free_guesses_move_the_estimate():
    free_first = FreeFirst(NgramProposer(), COSTS)
    free_first.begin(REPEATED[:20])
    _, match = free_first.free.draft(REPEATED[:20], 8)
    before = free_first.best_free(8, match)
    guesses = free_first.offer(REPEATED[:20], 8)
    assert guesses
    free_first.commit(REPEATED[:20] + [0])  # the first guess missed
    after = free_first.best_free(8, match)
    assert after[1] < before[1], (before, after)
    assert free_first.head_rate() == HEAD_PRIOR_RATE  # a free round says nothing of the head


def test_guesses_the_head_won_over_teach_the_estimate_by_what_was_emitted():
    """A declined offer is scored against the tokens the head's round emitted: guesses the
    text then held raise the estimate of their bucket, a guess it did not hold lowers it;
    guesses past what was emitted say nothing."""

    def head_round_after(emitted: list[int]) -> tuple[float, float]:
        free_first = FreeFirst(NgramProposer(), COSTS)
        free_first.begin(REPEATED[:20])
        free_first.head_tokens, free_first.head_cost = 1e6, 1.0  # the head wins every round
        _, match = free_first.free.draft(REPEATED[:20], 8)
        before = free_first.estimate.alpha(match)
        assert free_first.offer(REPEATED[:20], 8) == []
        free_first.head_round(REPEATED[:20], rows=2, steps=2)
        free_first.commit(REPEATED[:20] + emitted)
        return before, free_first.estimate.alpha(match)

    repeated = REPEATED[20:23]  # the head's round kept 2 guesses and added a third token
    before, after = head_round_after(repeated)
    assert after > before  # 3 guesses it declined were what the text then held
    before, after = head_round_after([REPEATED[20], 0, 0])
    assert after < before  # the second declined guess was not
    free_first = FreeFirst(NgramProposer(), COSTS)
    free_first.begin(REPEATED[:20])
    free_first.head_tokens = 1e6
    _, match = free_first.free.draft(REPEATED[:20], 8)
    b = bucket(match)
    tries = free_first.estimate.tries[b]
    assert free_first.offer(REPEATED[:20], 8) == []
    free_first.head_round(REPEATED[:20], rows=0, steps=0)
    free_first.commit(REPEATED[:20] + [REPEATED[20]])  # one token emitted: one verdict
    assert free_first.estimate.tries[b] == pytest.approx(tries * DECAY + 1)


def test_no_match_leaves_the_round_to_the_head():
    free_first = FreeFirst(NgramProposer(), COSTS)
    text = list(range(1, 30))  # no token repeats: nothing to look up
    free_first.begin(text)
    assert free_first.offer(text, 8) == []


@pytest.fixture(scope="module")
def trained(tiny_pair, tmp_path_factory) -> tuple[str, Path]:
    target, _ = tiny_pair
    folder = tmp_path_factory.mktemp("free_first") / "head"
    train_greedy_head(target, folder)
    return target, folder


@pytest.mark.parametrize("free", ["ngram", "suffix"])
@pytest.mark.parametrize("tree", ["off", "on"])
def test_greedy_identity_with_rounds_of_both_kinds(trained, free, tree):
    target, folder = trained
    engine = Engine.from_pretrained(
        target=target, method="eagle", draft=str(folder), dtype="float32",
        num_speculative_tokens=4, tree=tree, free_drafts=free,
    )  # fmt: skip
    assert engine.exact
    plain = engine.with_method("none")
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for prompt in repetitive_prompts(3, seed=3):
        assert engine.generate(prompt, params).token_ids == plain.generate(prompt, params).token_ids
    rounds = engine.drafter.free_first.rounds
    assert rounds["free"] > 0 and rounds["head"] > 0, rounds


def test_a_batch_gives_each_answer_alone(trained):
    """Four seats, greedy and seeded sampled requests: each its solo answer (the choice is
    learnt per request, so a seeded answer does not depend on the requests before it)."""
    target, folder = trained
    engine = Engine.from_pretrained(
        target=target, method="eagle", draft=str(folder), dtype="float32",
        num_speculative_tokens=3, tree="off", free_drafts="ngram", max_num_seqs=4,
        max_context=512,
    )  # fmt: skip
    prompts = repetitive_prompts(3, seed=5)
    params = [
        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.9, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=28, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=1.0, top_k=20, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=26, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=22, temperature=0.7, top_p=0.9, seed=11, ignore_eos=True),
    ]
    solo = [engine.generate(p, q) for p, q in zip(prompts, params, strict=True)]
    together = engine.generate(prompts, params)
    assert [o.token_ids for o in together] == [o.token_ids for o in solo]
    plain = engine.with_method("none")
    for prompt, q, out in zip(prompts, params, together, strict=True):
        if q.greedy:
            assert out.token_ids == plain.generate(prompt, q).token_ids


def test_an_unknown_free_drafter_is_refused(trained):
    target, folder = trained
    with pytest.raises(UnderstudyError, match="free_drafts must be one of off, suffix, ngram"):
        Engine.from_pretrained(
            target=target, method="eagle", draft=str(folder), dtype="float32",
            free_drafts="trie",
        )  # fmt: skip


def law_prompt(engine: Engine) -> list[int]:
    """A text X + G + X, G the target's greedy continuation of X: a sample that begins like
    G (often, at these warps) has n-gram guesses ready from its first round."""
    start = [11, 42, 7, 90]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    return start + engine.with_method("none").generate(start, greedy).token_ids + start


@pytest.fixture(scope="module")
def sampling_free(tmp_path_factory) -> Engine:
    """A head trained on the target's sampled text (q overlaps p, yet differs often), with
    n-gram guesses first."""
    from conftest import make_tiny_pair

    target, _ = make_tiny_pair(
        tmp_path_factory.mktemp("free_sampling"), seed=5, noise=0.5, tokenizer=False
    )
    folder = tmp_path_factory.mktemp("free_sampling_head")
    sequences = target_written_text(target, 40, seed=1, temperature=1.0)
    train_head(load_model(target, "float32"), sequences, folder, "test", SETTINGS, False)
    return Engine.from_pretrained(
        target=target, method="eagle", draft=str(folder), dtype="float32",
        num_speculative_tokens=3, tree="off", free_drafts="ngram",
    )  # fmt: skip


@pytest.mark.parametrize("warp", ["top_k", "min_p"])
def test_sampling_matches_target_law(sampling_free, warp):
    """N = 1500 samples of (x1, x2, x3); chi-squared goodness of fit, p > 0.001; free
    rounds were among them."""
    before = dict(sampling_free.drafter.free_first.rounds)
    params = SamplingParams(ignore_eos=True, **WARPS[warp])
    pvalue = goodness_of_fit(sampling_free, law_prompt(sampling_free), params, samples=1500)
    assert pvalue > P_THRESHOLD, f"{warp}: p = {pvalue:.2e}"
    after = sampling_free.drafter.free_first.rounds
    assert after["free"] - before["free"] > 300 and after["head"] > before["head"]


def test_free_guesses_with_a_wrong_q_fail_the_same_test(sampling_free, monkeypatch):
    """Mutation: free guesses handed to the verifier as if drawn from a uniform q (not the
    one-hot they are) are accepted too often, and the same test detects it."""
    from understudy.drafters.eagle import EagleProposer

    real = EagleProposer._free_guesses

    def uniform_q(self, tokens, k):
        proposal = real(self, tokens, k)
        if proposal is None:
            return None
        vocab = self.head.cfg.target_vocab_size
        q = torch.full((proposal.size, vocab), 1.0 / vocab)
        return Proposal(proposal.draft_ids, q, free=True)

    monkeypatch.setattr(EagleProposer, "_free_guesses", uniform_q)
    params = SamplingParams(ignore_eos=True, **WARPS["top_k"])
    pvalue = goodness_of_fit(sampling_free, law_prompt(sampling_free), params, samples=1500)
    assert pvalue < P_THRESHOLD, f"the wrong q was not detected (p = {pvalue:.3f})"
