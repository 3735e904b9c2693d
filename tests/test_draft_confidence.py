"""method="draft" with draft_confidence: a round stops at a guess the draft itself doubts.

Lossless like every rule that looks only at the draft's side: greedy output equals plain
decoding, and the sampled joint law of the first 3 tokens is the target's (chi-squared,
p > 0.001, with the harness of test_exactness.py).
"""

from __future__ import annotations

import pytest

from test_exactness import P_THRESHOLD, WARPS, goodness_of_fit, random_prompts
from understudy import Engine, SamplingParams, UnderstudyError


def test_greedy_identity_and_early_stop(tiny_pair):
    target, draft = tiny_pair
    sure = Engine.from_pretrained(
        target=target, draft=draft, dtype="float32", num_speculative_tokens=5
    )
    doubting = Engine.from_pretrained(
        target=target, draft=draft, dtype="float32", num_speculative_tokens=5, draft_confidence=0.9
    )
    plain = sure.with_method("none")
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    drafted = {"sure": 0, "doubting": 0}
    for prompt in random_prompts(4, seed=3):
        expected = plain.generate(prompt, params).token_ids
        for name, engine in (("sure", sure), ("doubting", doubting)):
            out = engine.generate(prompt, params)
            assert out.token_ids == expected, name
            drafted[name] += out.stats.drafted
    assert 0 < drafted["doubting"] < drafted["sure"], drafted  # rounds did stop early


def test_full_confidence_drafts_one_token(tiny_pair):
    """At 1.0 every guess after the first is doubted (its probability is below 1)."""
    target, draft = tiny_pair
    engine = Engine.from_pretrained(
        target=target, draft=draft, dtype="float32", num_speculative_tokens=5, draft_confidence=1.0
    )
    rounds = []
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    list(engine.stream([5, 6, 7], params, on_round=rounds.append))
    assert rounds and all(len(r.drafted) == 1 for r in rounds)


@pytest.mark.parametrize("value", [-0.1, 1.5, "high"])
def test_bad_confidence_is_refused(tiny_pair, value):
    target, draft = tiny_pair
    with pytest.raises(UnderstudyError, match="draft_confidence"):
        Engine.from_pretrained(target=target, draft=draft, draft_confidence=value)


def test_sampling_law_with_early_stop(tmp_path_factory):
    """The stop depends on the draft's own draws only: the target's law is kept."""
    from conftest import make_tiny_pair

    target, draft = make_tiny_pair(
        tmp_path_factory.mktemp("confidence"), seed=5, noise=0.5, tokenizer=False
    )
    engine = Engine.from_pretrained(
        target=target, draft=draft, dtype="float32", num_speculative_tokens=3, draft_confidence=0.5
    )
    params = SamplingParams(ignore_eos=True, **WARPS["top_k"])
    pvalue = goodness_of_fit(engine, [11, 42, 7], params, samples=1500)
    assert pvalue > P_THRESHOLD, f"p = {pvalue:.2e}"
