"""Tests of logits -> probabilities warping and seeded sampling (src/understudy/sampling.py).

Hand-made cases use distributions whose values are exact in binary (0.5, 0.25, 0.125), given
as logits = log(probs): softmax reproduces them exactly, so the top-p and min-p boundaries
can be tested at equality. The one statistical test (test_sample_follows_probs) draws
N = 20_000 tokens and passes iff the chi-squared p-value > ALPHA = 0.001.
"""

from __future__ import annotations

import math

import pytest
import torch

from stats_helpers import ALPHA, chisquare_pvalue
from understudy.config import SamplingParams
from understudy.verify.sampling import make_generator, sample, warp_probs

BINARY = [0.5, 0.25, 0.125, 0.125]  # exact in float32
PERM = [2, 0, 3, 1]  # a vocabulary order that is not sorted by probability


def logits_of(probs: list[float], perm: list[int] | None = None) -> torch.Tensor:
    """Logits [1, vocab] whose softmax is `probs`, placed at vocabulary ids `perm`."""
    logits = torch.tensor([math.log(x) for x in probs])
    if perm is not None:
        logits = torch.empty_like(logits).index_copy_(0, torch.tensor(perm), logits)
    return logits[None]


def in_vocab_order(values: list[float], perm: list[int]) -> torch.Tensor:
    """values[i] belongs to vocabulary id perm[i]: return them indexed by vocabulary id."""
    out = torch.zeros(len(values))
    out[torch.tensor(perm)] = torch.tensor(values)
    return out[None]


def test_softmax_of_binary_logits_is_exact() -> None:
    """Precondition of the equality-boundary cases below."""
    probs = warp_probs(logits_of(BINARY), SamplingParams())
    assert probs.tolist() == [BINARY]


# --- greedy and temperature -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_greedy_is_one_hot_at_argmax(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 32, generator=g).to(dtype)
    # top-k / top-p / min-p are irrelevant when greedy
    probs = warp_probs(logits, SamplingParams(temperature=0.0, top_k=3, top_p=0.5, min_p=0.2))
    assert probs.dtype == torch.float32 and probs.shape == (5, 32)
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 32).float())


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_temperature_divides_logits(temperature: float) -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 16, generator=g)
    probs = warp_probs(logits, SamplingParams(temperature=temperature))
    torch.testing.assert_close(probs, torch.softmax(logits / temperature, -1))


def test_lower_temperature_is_sharper() -> None:
    logits = logits_of(BINARY)
    top = [warp_probs(logits, SamplingParams(temperature=t))[0, 0] for t in (0.5, 1.0, 2.0)]
    assert top[0] > top[1] > top[2]
    assert top[1] == 0.5


# --- top-k ----------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 5, 31])
def test_top_k_keeps_exactly_k(k: int) -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 32, generator=g)  # distinct values
    probs = warp_probs(logits, SamplingParams(top_k=k))
    assert ((probs > 0).sum(-1) == k).all()
    kept = torch.topk(logits, k, dim=-1).indices
    assert (probs.gather(-1, kept) > 0).all()
    masked = logits.masked_fill(probs == 0, float("-inf"))
    torch.testing.assert_close(probs, torch.softmax(masked, -1))  # renormalised softmax


@pytest.mark.parametrize("k", [0, 32, 100])
def test_top_k_zero_or_at_least_vocab_is_off(k: int) -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 32, generator=g)
    torch.testing.assert_close(
        warp_probs(logits, SamplingParams(top_k=k)), torch.softmax(logits, -1)
    )


def test_top_k_keeps_ties_with_the_kth() -> None:
    """Documented behaviour (as in transformers and vLLM): tokens tied with the k-th logit
    are all kept, so a tie can keep more than k."""
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]])
    probs = warp_probs(logits, SamplingParams(top_k=2))
    assert (probs[0] > 0).tolist() == [True, False, True, True, False]


# --- top-p ----------------------------------------------------------------------------------

TOP_P_CASES = [
    # (top_p, kept probabilities in sorted order, renormalised)
    (0.3, [1.0]),  # the top token alone (0.5) already exceeds top_p: it alone is kept
    (0.5, [1.0]),  # the top token alone reaches top_p exactly
    (0.6, [2 / 3, 1 / 3]),
    (0.74, [2 / 3, 1 / 3]),
    (0.75, [2 / 3, 1 / 3]),  # the prefix mass reaches top_p exactly: nothing more is kept
    (0.76, [4 / 7, 2 / 7, 1 / 7]),  # one of the two tied 0.125 tokens is enough
    (1.0, [0.5, 0.25, 0.125, 0.125]),  # off
]


@pytest.mark.parametrize(("top_p", "kept"), TOP_P_CASES, ids=[str(c[0]) for c in TOP_P_CASES])
def test_top_p_keeps_smallest_prefix_reaching_top_p(top_p: float, kept: list[float]) -> None:
    original = torch.tensor(BINARY)[torch.argsort(torch.tensor(PERM))]  # [vocab]
    probs = warp_probs(logits_of(BINARY, PERM), SamplingParams(top_p=top_p))[0]  # [vocab]
    expected = torch.tensor(kept + [0.0] * (len(BINARY) - len(kept)))
    torch.testing.assert_close(probs.sort(descending=True).values, expected)
    # what survives is a most-probable prefix (which of two tied tokens is not specified)
    dropped = torch.cat([original[probs == 0], torch.zeros(1)])
    assert original[probs > 0].min() >= dropped.max()
    torch.testing.assert_close(probs[probs > 0], original[probs > 0] / original[probs > 0].sum())


def test_top_p_is_per_row() -> None:
    logits = torch.cat([logits_of(BINARY), logits_of([0.25, 0.25, 0.25, 0.25])])
    probs = warp_probs(logits, SamplingParams(top_p=0.6))
    assert (probs > 0).sum(-1).tolist() == [2, 3]


# --- min-p ----------------------------------------------------------------------------------

MIN_P_CASES = [
    (0.3, [2 / 3, 1 / 3, 0.0, 0.0]),  # threshold 0.15
    (0.25, [0.5, 0.25, 0.125, 0.125]),  # threshold 0.125 exactly: p >= threshold is kept
    (0.26, [2 / 3, 1 / 3, 0.0, 0.0]),
    (1.0, [1.0, 0.0, 0.0, 0.0]),  # only the maximum survives
]


@pytest.mark.parametrize(("min_p", "expected"), MIN_P_CASES, ids=[str(c[0]) for c in MIN_P_CASES])
def test_min_p_keeps_tokens_above_fraction_of_max(min_p: float, expected: list[float]) -> None:
    probs = warp_probs(logits_of(BINARY, PERM), SamplingParams(min_p=min_p))
    torch.testing.assert_close(probs, in_vocab_order(expected, PERM))


# --- every warp: valid distributions, applied in the documented order ----------------------


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.05),
        SamplingParams(temperature=3.0, top_k=7),
        SamplingParams(top_p=0.01),
        SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05),
        SamplingParams(min_p=1.0),
    ],
    ids=["default", "greedy", "cold", "hot_top_k", "tiny_top_p", "all", "min_p_1"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_are_distributions(params: SamplingParams, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(8, 50, generator=g)).to(dtype)
    probs = warp_probs(logits, params)
    assert probs.dtype == torch.float32 and probs.shape == (8, 50)
    assert torch.isfinite(probs).all() and (probs >= 0).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(8))
    # a maximal token always survives every warp (bfloat16 logits may tie at the max)
    is_max = logits.float() == logits.float().max(-1, keepdim=True).values  # [8, 50]
    assert ((probs * is_max).sum(-1) > 0).all()


ORDER_CASES = [
    # (name, probs, params, number of surviving tokens in the documented order; the other
    # order would give a different count)
    # T first: T=2 flattens to (.37, .26, .18, .18), so top_p=0.7 keeps 3 (raw keeps 2)
    ("temperature_before_top_p", BINARY, SamplingParams(temperature=2.0, top_p=0.7), 3),
    # T first: ratios to the max become (1, .71, .5, .5), so min_p=0.4 keeps 4 (raw keeps 2)
    ("temperature_before_min_p", BINARY, SamplingParams(temperature=2.0, min_p=0.4), 4),
    # top-k first: (4/7, 3/7), and 4/7 alone reaches top_p=0.5 (top-p first would keep 2)
    ("top_k_before_top_p", [0.4, 0.3, 0.2, 0.1], SamplingParams(top_k=2, top_p=0.5), 1),
    # top-p first keeps (.4, .3) -> (4/7, 3/7), and min_p=0.5 keeps both
    # (min-p first would give (4/7, 3/7) and then top_p=0.5 would keep only 4/7)
    ("top_p_before_min_p", [0.4, 0.3, 0.15, 0.15], SamplingParams(top_p=0.5, min_p=0.5), 2),
]


@pytest.mark.parametrize(
    ("probs", "params", "n_kept"), [c[1:] for c in ORDER_CASES], ids=[c[0] for c in ORDER_CASES]
)
def test_warp_order_is_temperature_top_k_top_p_min_p(
    probs: list[float], params: SamplingParams, n_kept: int
) -> None:
    assert int((warp_probs(logits_of(probs), params) > 0).sum()) == n_kept


# --- sampling and generators ---------------------------------------------------------------


def test_sample_follows_probs() -> None:
    """N = 20_000 draws (one per row, vectorised); chi-squared p-value > 0.001, and the
    zero-probability token is never drawn."""
    probs = torch.tensor([0.05, 0.3, 0.0, 0.15, 0.4, 0.1])
    draws = sample(probs.expand(20_000, -1), torch.Generator().manual_seed(0))
    assert draws.dtype == torch.int64 and draws.shape == (20_000,)
    counts = torch.bincount(draws, minlength=6)
    assert counts[2] == 0
    assert chisquare_pvalue(counts.numpy(), probs.numpy()) > ALPHA


def test_sample_one_hot_is_certain() -> None:
    probs = torch.nn.functional.one_hot(torch.tensor([3, 0, 7]), 8).float()
    for _ in range(20):
        assert sample(probs, None).tolist() == [3, 0, 7]


@pytest.mark.parametrize("seed", [0, 1, 12345])
def test_same_seed_same_draws(seed: int) -> None:
    """seed=0 is a seed like any other."""
    probs = torch.full((50, 1000), 1e-3)
    assert torch.equal(sample(probs, make_generator(seed)), sample(probs, make_generator(seed)))


def test_different_or_no_seed_different_draws() -> None:
    probs = torch.full((50, 1000), 1e-3)
    assert not torch.equal(sample(probs, make_generator(0)), sample(probs, make_generator(1)))
    assert not torch.equal(sample(probs, make_generator(None)), sample(probs, make_generator(None)))


def test_private_generator_leaves_global_rng_alone() -> None:
    state = torch.random.get_rng_state()
    sample(torch.full((4, 10), 0.1), make_generator(3))
    assert torch.equal(torch.random.get_rng_state(), state)
