"""method="ngram" (prompt lookup): matching rules, incremental index, greedy identity, the
target's distribution under sampling (chi-squared homogeneity against method="none", with a
mutation check), options and the CLI."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency

from understudy import Engine, SamplingParams, UnderstudyError
from understudy.drafters.ngram import NgramIndex, NgramProposer
from understudy.verify.sampling import warp_probs

ALPHA = 1e-3


def lookup(seq: list[int], k: int, lo: int = 1, hi: int = 5) -> tuple[list[int], int]:
    index = NgramIndex(lo, hi)
    index.reset(seq)
    return index.lookup(k)


def reference_lookup(seq: list[int], k: int, lo: int, hi: int) -> tuple[list[int], int]:
    """Brute force: longest n first, most recent earlier occurrence, self-extending guesses."""
    length = len(seq)
    for n in range(min(hi, length - 1), lo - 1, -1):
        for start in range(length - n - 1, -1, -1):  # occurrence seq[start:start+n], earlier
            if seq[start : start + n] == seq[length - n :]:
                text = list(seq)
                for j in range(k):
                    text.append(text[start + n + j])
                return text[length:], n
    return [], 0


# -- matching rules ----------------------------------------------------------------------------


def test_most_recent_match_wins():
    seq = [1, 2, 3, 9, 1, 2, 3, 8, 5, 1, 2, 3]
    assert lookup(seq, 1) == ([8], 3)
    assert lookup(seq, 3) == ([8, 5, 1], 3)


def test_longest_n_first():
    # the 3-gram (5, 6, 7) was followed by 100; the 1-gram (7) more recently by 200
    seq = [5, 6, 7, 100, 0, 7, 200, 5, 6, 7]
    assert lookup(seq, 1, hi=3) == ([100], 3)
    assert lookup(seq, 1, hi=1) == ([200], 1)


def test_min_and_max_n():
    seq = [1, 2, 3, 4, 9, 4]  # only the 1-gram (4) recurs
    assert lookup(seq, 2, lo=1) == ([9, 4], 1)
    assert lookup(seq, 2, lo=2) == ([], 0)
    seq = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5, 6]  # a 6-gram recurs; max_n caps the match
    assert lookup(seq, 1, hi=4) == ([7], 4)


def test_continuation_length_and_self_extension():
    seq = [1, 2, 3, 4, 5, 6, 1, 2]
    assert lookup(seq, 1) == ([3], 2)
    assert lookup(seq, 4) == ([3, 4, 5, 6], 2)
    # the continuation of the most recent match runs into the end of the text: it goes on
    # with its own guesses (the pattern repeating now)
    assert lookup([7, 1, 2, 3, 1, 2, 3], 5) == ([1, 2, 3, 1, 2], 3)
    assert lookup([4, 4], 3) == ([4, 4, 4], 1)
    assert lookup([1, 2, 3], 4) == ([], 0)  # nothing recurs
    assert lookup([1], 4) == ([], 0)


def test_matches_brute_force_on_random_text():
    rng = random.Random(0)
    for _ in range(300):
        seq = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        lo = rng.randrange(1, 4)
        hi = rng.randrange(lo, 6)
        k = rng.randrange(1, 8)
        assert lookup(seq, k, lo, hi) == reference_lookup(seq, k, lo, hi), (seq, lo, hi, k)


def test_incremental_index_equals_rebuilt_and_is_cheap():
    rng = random.Random(1)
    seq = [rng.randrange(6) for _ in range(300)]
    grown = NgramIndex(2, 4)
    grown.reset(seq[:10])
    at = 10
    while at < len(seq):
        step = rng.randrange(1, 5)
        before = len(grown.table)
        grown.sync(seq[: at + step])
        assert len(grown.table) - before <= 3 * step  # (max - min + 1) entries per new token
        at += step
        fresh = NgramIndex(2, 4)
        fresh.reset(seq[:at])
        assert grown.table == fresh.table
        assert grown.lookup(5) == fresh.lookup(5)


def test_sync_starts_over_on_a_different_text():
    index = NgramIndex(1, 3)
    index.reset([1, 2, 3, 1])
    index.sync([9, 9, 9])  # not a continuation: rebuilt
    assert index.seq == [9, 9, 9] and index.lookup(2) == ([9, 9], 2)


def test_proposal_is_deterministic_one_hot():
    proposer = NgramProposer()
    proposer.begin([1, 2, 3, 1, 2])
    proposal = proposer.propose([1, 2, 3, 1, 2], 3, SamplingParams(), torch.Generator())
    assert proposal.draft_ids.dtype == torch.long and proposal.draft_ids.tolist() == [3, 1, 2]
    assert proposal.draft_probs is None
    empty = proposer.propose([1, 2, 3, 1, 2, 7], 3, SamplingParams(), torch.Generator())
    assert empty.size == 0 and empty.draft_ids.shape == (0,)


# -- options -----------------------------------------------------------------------------------


def test_option_defaults_and_validation():
    assert (NgramProposer().index.min_n, NgramProposer().index.max_n) == (1, 5)
    assert NgramProposer(prompt_lookup_max=3).index.min_n == 1
    assert NgramProposer(prompt_lookup_min=7).index.max_n == 7
    with pytest.raises(UnderstudyError, match="prompt_lookup_min"):
        NgramProposer(prompt_lookup_max=2, prompt_lookup_min=3)
    with pytest.raises(UnderstudyError, match="prompt_lookup_max"):
        NgramProposer(prompt_lookup_max=0)


def test_engine_options(tiny_pair):
    target, _ = tiny_pair
    engine = Engine.from_pretrained(
        target=target, method="ngram", dtype="float32", prompt_lookup_max=3, prompt_lookup_min=2
    )
    assert (engine.drafter.index.min_n, engine.drafter.index.max_n) == (2, 3)
    with pytest.raises(UnderstudyError, match="prompt_lookup_maxx"):
        Engine.from_pretrained(target=target, method="ngram", dtype="float32", prompt_lookup_maxx=3)


# -- greedy identity ---------------------------------------------------------------------------


def repetitive_prompts(n: int, seed: int) -> list[list[int]]:
    """A random segment repeated twice, sometimes with a different head or tail."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        segment = torch.randint(
            1, 300, (int(torch.randint(3, 25, (1,), generator=g)),), generator=g
        )
        head = torch.randint(1, 300, (int(torch.randint(0, 6, (1,), generator=g)),), generator=g)
        out.append(head.tolist() + segment.tolist() * 2)
    return out


@pytest.fixture(scope="module")
def plain(tiny_pair):
    return Engine.from_pretrained(target=tiny_pair[0], method="none", dtype="float32")


@pytest.mark.filterwarnings("ignore:target passes hold")
@pytest.mark.parametrize("k", ["auto", 4])
def test_greedy_identity(tiny_pair, plain, k):
    engine = Engine.from_pretrained(
        target=tiny_pair[0], method="ngram", num_speculative_tokens=k, dtype="float32"
    )
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    accepted = drafted = 0
    for prompt in repetitive_prompts(12, seed=3):
        out = engine.generate(prompt, params)
        assert out.token_ids == plain.generate(prompt, params).token_ids
        accepted += out.stats.accepted
        drafted += out.stats.drafted
    assert accepted > 0, "prompt lookup never guessed right: the test exercises nothing"
    assert accepted < drafted, "every guess was right: rejections are not exercised"


# -- sampling: chi-squared homogeneity with method="none" --------------------------------------


pytestmark = pytest.mark.usefixtures("one_thread")


# 4 tokens, so the first round may draft K = 2 (the row budget); the test looks at 3
SAMPLING = SamplingParams(max_tokens=4, temperature=1.0, top_k=3, ignore_eos=True)
SAMPLES = 1200


def warped(engine: Engine, context: list[int]) -> torch.Tensor:
    logits = engine.runner.prefill(torch.tensor(context))
    return warp_probs(logits[None], SAMPLING)[0]  # [vocab]


def informative_prompt(engine: Engine, candidates: int = 12) -> list[int]:
    """A prompt where the first round's n-gram guess is right about half the time: pairs
    (first token, the target's favourite next token) for each likely first token, then a
    random tail; scored by sum_f P(f) * a(f) * (1 - a(f)), a = P(the guess is accepted)."""
    g = torch.Generator().manual_seed(7)

    def build(tail: list[int]) -> list[int]:
        prompt = list(tail)
        for _ in range(3):  # a few rounds towards a fixed point
            pairs = []
            for f in warped(engine, prompt).nonzero().flatten().tolist():
                pairs += [f, int(warped(engine, prompt + [f]).argmax())]
            prompt = pairs + tail
        return prompt

    def score(prompt: list[int]) -> float:
        first = warped(engine, prompt)
        total = 0.0
        for f in first.nonzero().flatten().tolist():
            proposer = NgramProposer()
            proposer.begin(prompt)
            guesses, _ = proposer.draft(prompt + [f], 1)
            if guesses:
                a = float(warped(engine, prompt + [f])[guesses[0]])
                total += float(first[f]) * a * (1 - a)
        return total

    prompts = [build(torch.randint(1, 300, (8,), generator=g).tolist()) for _ in range(candidates)]
    return max(prompts, key=score)


def first_tokens(engine: Engine, prompt: list[int], seeds: range) -> tuple[Counter, int, int]:
    """Counts of (x1, x2, x3) over the seeds, and the total drafted and accepted."""
    counts: Counter = Counter()
    drafted = accepted = 0
    for seed in seeds:
        out = engine.generate(prompt, SamplingParams(**{**SAMPLING.__dict__, "seed": seed}))
        counts[tuple(out.token_ids[:3])] += 1
        drafted += out.stats.drafted
        accepted += out.stats.accepted
    return counts, drafted, accepted


def homogeneity_pvalue(a: Counter, b: Counter, min_expected: float = 5.0) -> float:
    """chi2_contingency on the 2 x cells table; cells whose expected count is below
    `min_expected` in either row are pooled (into the smallest other cell if still small)."""
    cells = sorted(set(a) | set(b), key=lambda c: -(a[c] + b[c]))
    table = np.array([[a[c] for c in cells], [b[c] for c in cells]], dtype=np.float64)
    share = table.sum(1, keepdims=True) / table.sum()  # [2, 1]
    small = (table.sum(0, keepdims=True) * share).min(0) < min_expected
    kept = table[:, ~small]
    if small.any():
        pooled = table[:, small].sum(1, keepdims=True)
        if (pooled.sum() * share).min() >= min_expected or kept.shape[1] == 0:
            kept = np.concatenate([kept, pooled], axis=1)
        else:
            kept[:, -1:] += pooled  # cells are sorted by frequency: the last is the smallest
    if kept.shape[1] < 2:
        return 1.0
    return float(chi2_contingency(kept).pvalue)


@pytest.fixture(scope="module")
def sampling_setup(tiny_pair, plain, one_thread):
    engine = Engine.from_pretrained(target=tiny_pair[0], method="ngram", dtype="float32")
    prompt = informative_prompt(engine)
    baseline, _, _ = first_tokens(plain, prompt, range(SAMPLES))  # seeds: disjoint sets
    return engine, prompt, baseline


def test_sampling_matches_plain_distribution(sampling_setup):
    """(x1, x2, x3) under method="ngram" vs method="none": chi-squared homogeneity."""
    engine, prompt, baseline = sampling_setup
    counts, drafted, accepted = first_tokens(engine, prompt, range(SAMPLES, 2 * SAMPLES))
    assert drafted > SAMPLES / 2, drafted  # guesses in many first rounds
    assert 0.1 * drafted < accepted < 0.9 * drafted, (drafted, accepted)  # right and wrong
    pvalue = homogeneity_pvalue(counts, baseline)
    assert pvalue > ALPHA, f"p = {pvalue:.2e}"


def test_wrong_verifier_fails_the_same_test(sampling_setup, monkeypatch):
    """Mutation check: at a rejected one-hot guess, drawing the correction from p itself
    instead of the residual p - q (i.e. not removing the rejected token) is detected."""
    import understudy.engine.verdict as verdict_module
    from understudy.verify.chain import Verdict, verify_sampling
    from understudy.verify.sampling import sample

    def forgets_the_residual(draft_ids, draft_probs, target_probs, generator):
        verdict = verify_sampling(draft_ids, draft_probs, target_probs, generator)
        if verdict.accepted == draft_ids.shape[0]:
            return verdict
        p = target_probs[verdict.accepted : verdict.accepted + 1]  # WRONG: the guess stays in
        return Verdict(verdict.accepted, int(sample(p, generator)))

    engine, prompt, baseline = sampling_setup
    monkeypatch.setattr(verdict_module, "verify_sampling", forgets_the_residual)
    counts, _, _ = first_tokens(engine, prompt, range(2 * SAMPLES, 3 * SAMPLES))
    pvalue = homogeneity_pvalue(counts, baseline)
    assert pvalue < ALPHA, f"the wrong verifier was not detected (p = {pvalue:.3f})"


def test_homogeneity_helper():
    a = Counter({(1,): 500, (2,): 300, (3,): 200, (4,): 2})
    assert homogeneity_pvalue(a, Counter({(1,): 510, (2,): 290, (3,): 200})) > 0.5
    assert homogeneity_pvalue(a, Counter({(1,): 300, (2,): 500, (3,): 200})) < 1e-6


# -- CLI ---------------------------------------------------------------------------------------


def test_cli_accepts_method_ngram(tiny_pair):
    target, _ = tiny_pair
    result = subprocess.run(
        [sys.executable, "-m", "understudy.cli.main", "generate", "def add(a, b):", "--target",
         target, "--method", "ngram", "--json", "--max-tokens", "8", "--dtype", "float32"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout.strip().splitlines()[-1])
    assert payload["stats"]["method"] == "ngram"
    assert 1 <= len(payload["token_ids"]) <= 8
