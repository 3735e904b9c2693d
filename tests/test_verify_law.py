"""The verifier's sampling law (understudy.verify.chain.verify_sampling), by statistics.

The tests run the whole speculative procedure on toy "language models" and check the one
property that matters (docs/design.md): the emitted tokens are distributed exactly as the
target's own samples. Threshold and sizes:

- Chi-squared goodness of fit (stats_helpers.chisquare_pvalue) of the empirical joint of the
  first two emitted tokens against the exact target joint p(x1) p(x2 | x1): V = 6, so 36
  cells; cells with expected count < 5 are pooled; impossible cells must stay empty.
- A correct verifier must give p-value > ALPHA = 0.001 with N_SAMPLES = 15_000 simulated
  generations (fixed seeds, so each run is deterministic).
- Each deliberately wrong verifier (bottom of this file) must give p-value < ALPHA at the
  same N_SAMPLES: the proof that the test has the power to catch a lossy verifier. The
  subtlest one (20% of corrections drawn from p instead of the residual) sets the size:
  N = 15_000 catches it for every seed tried (p < 1e-9), N = 12_000 only barely (p ~ 1e-4).
- Simulating 15_000 generations takes ~1.5 s; the whole file runs in ~25 s on 2 cores.

The greedy tables and the cases with a certain outcome: test_verify.py.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from stats_helpers import ALPHA, chisquare_pvalue
from understudy.config import SamplingParams
from understudy.verify.chain import Verdict, verify_sampling
from understudy.verify.sampling import warp_probs

# --------------------------------------------------------------------------------------------
# Toy language models and the simulated speculative procedure
# --------------------------------------------------------------------------------------------

V = 6  # toy vocabulary
BOS = V  # row index of the start-of-text context in a [V+1, V] next-token table
N_SAMPLES = 15_000

Verifier = Callable[
    [torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Generator | None], Verdict
]


def toy_tables(params: SamplingParams, seed: int = 1234) -> tuple[torch.Tensor, torch.Tensor]:
    """(p_table, q_table), each [V+1, V] float32: row t is the next-token distribution after
    token t, row BOS the first token's. A bigram model makes p(x2 | x1) depend on x1 and keeps
    every later round well defined. The draft is a noisy, sharper (overconfident) copy of
    the target. Both are warped with the SAME params, as the engine does."""
    g = torch.Generator().manual_seed(seed)
    target_logits = 1.2 * torch.randn(V + 1, V, generator=g)
    draft_logits = 1.5 * target_logits + 1.0 * torch.randn(V + 1, V, generator=g)
    return warp_probs(target_logits, params), warp_probs(draft_logits, params)


def exact_joint(p_table: torch.Tensor) -> np.ndarray:
    """The target's own joint of its first two tokens: p(x1) p(x2 | x1), [V, V] float64."""
    p = p_table.double().numpy()
    return p[BOS][:, None] * p[:V]


def simulate(
    p_table: torch.Tensor,
    q_table: torch.Tensor,
    *,
    k: int,
    n_samples: int = N_SAMPLES,
    seed: int = 0,
    verifier: Verifier = verify_sampling,
    drafter: str = "sampled",
    reported_q: torch.Tensor | None | str = "auto",
) -> tuple[np.ndarray, list[Verdict]]:
    """Generate n_samples independent texts by speculative decoding with K = k drafts per
    round, and count the first two emitted tokens. Returns (counts [V, V], every verdict).

    drafter "sampled": x_1 ~ q(. | ctx), x_2 ~ q(. | x_1), ...; the verifier gets q.
    drafter "deterministic": x_i = argmax q(. | previous) (an n-gram-like lookup); the
    verifier gets draft_probs=None. reported_q (a [V+1, V] table or None) overrides what
    the verifier is told q is: the mutation checks use it to make the drafter lie.
    """
    if isinstance(reported_q, str):
        reported_q = q_table if drafter == "sampled" else None
    draft_gen = torch.Generator().manual_seed(seed)
    verify_gen = torch.Generator().manual_seed(seed + 1)
    n_rounds = 2  # a round emits >= 1 token, so two rounds always reach two tokens
    # Pre-draw every chain a sample could need: chain_codes[r][n, ctx] encodes the K tokens
    # drafted in round r of sample n if that round starts after token ctx (BOS for round 0).
    chain_codes = []
    for _ in range(n_rounds):
        cur = torch.arange(V + 1).expand(n_samples, V + 1)  # [N, V+1]
        code = torch.zeros(n_samples, V + 1, dtype=torch.int64)  # [N, V+1]
        for _ in range(k):
            if drafter == "sampled":
                cur = torch.multinomial(q_table[cur.reshape(-1)], 1, generator=draft_gen)
                cur = cur.reshape(n_samples, V + 1)
            else:
                cur = q_table.argmax(-1)[cur]
            code = code * V + cur
        chain_codes.append(code.numpy())
    inputs: dict[tuple[int, int], tuple] = {}  # (ctx, code) -> (chain, verifier arguments)

    def decode(ctx: int, code: int) -> tuple[list[int], tuple]:
        if (ctx, code) not in inputs:
            chain = [code // V ** (k - 1 - i) % V for i in range(k)]
            ids = torch.tensor(chain)  # [K]
            q = None if reported_q is None else reported_q[[ctx, *chain[:-1]]]  # [K, V]
            p = p_table[[ctx, *chain]]  # [K+1, V]
            inputs[ctx, code] = (chain, (ids, q, p))
        return inputs[ctx, code]

    counts = np.zeros((V, V), dtype=np.int64)
    verdicts = []
    for n in range(n_samples):
        emitted: list[int] = []
        ctx = BOS
        for r in range(n_rounds):
            chain, args = decode(ctx, int(chain_codes[r][n, ctx]))
            verdict = verifier(*args, verify_gen)
            verdicts.append(verdict)
            emitted += chain[: verdict.accepted] + [verdict.next_token]
            if len(emitted) >= 2:
                break
            ctx = emitted[-1]
        counts[emitted[0], emitted[1]] += 1
    return counts, verdicts


def joint_pvalue(params: SamplingParams, **simulate_kwargs) -> float:
    p_table, q_table = toy_tables(params)
    counts, _ = simulate(p_table, q_table, **simulate_kwargs)
    return chisquare_pvalue(counts, exact_joint(p_table))


WARPS = {
    "raw": SamplingParams(),
    "temperature_top_k": SamplingParams(temperature=0.8, top_k=3),
    "temperature_top_p": SamplingParams(temperature=1.3, top_p=0.7),
    "min_p": SamplingParams(min_p=0.15),
}


@pytest.mark.parametrize("warp", list(WARPS), ids=list(WARPS))
def test_sampled_drafter_is_lossless(warp: str) -> None:
    """K = 2, sampled drafter: the first two emitted tokens ~ p(x1) p(x2 | x1).
    N_SAMPLES = 15_000, pass iff chi-squared p-value > 0.001."""
    pvalue = joint_pvalue(WARPS[warp], k=2)
    assert pvalue > ALPHA, f"emitted tokens are not distributed as the target's (p={pvalue:.3g})"


@pytest.mark.parametrize("warp", ["raw", "temperature_top_k"])
def test_deterministic_drafter_is_lossless(warp: str) -> None:
    """K = 2, deterministic drafter (q one-hot, draft_probs=None). N_SAMPLES = 15_000,
    pass iff chi-squared p-value > 0.001."""
    pvalue = joint_pvalue(WARPS[warp], k=2, drafter="deterministic")
    assert pvalue > ALPHA, f"emitted tokens are not distributed as the target's (p={pvalue:.3g})"


def test_bonus_token_is_lossless() -> None:
    """K = 1: when the draft is accepted the second emitted token is the bonus token from
    p_{K+1}, so this covers the bonus path the K = 2 tests never reach in two tokens.
    N_SAMPLES = 15_000, pass iff chi-squared p-value > 0.001."""
    pvalue = joint_pvalue(WARPS["raw"], k=1)
    assert pvalue > ALPHA, f"emitted tokens are not distributed as the target's (p={pvalue:.3g})"


def test_simulation_exercises_every_branch() -> None:
    """The statistical tests only mean something if rejections at each position, full
    acceptance, and second rounds all occur often."""
    p_table, q_table = toy_tables(WARPS["raw"])
    _, verdicts = simulate(p_table, q_table, k=2, n_samples=2_000)
    accepted = np.bincount([v.accepted for v in verdicts], minlength=3)
    assert (accepted / accepted.sum() > 0.1).all(), accepted
    assert len(verdicts) > 2_000 * 1.05  # about 12% of samples need a second round


def test_seeded_verification_is_deterministic() -> None:
    """Same seeds -> identical verdicts; a different seed -> different verdicts."""
    p_table, q_table = toy_tables(WARPS["temperature_top_p"])
    counts_a, verdicts_a = simulate(p_table, q_table, k=2, n_samples=300, seed=7)
    counts_b, verdicts_b = simulate(p_table, q_table, k=2, n_samples=300, seed=7)
    _, verdicts_c = simulate(p_table, q_table, k=2, n_samples=300, seed=8)
    assert verdicts_a == verdicts_b
    assert (counts_a == counts_b).all()
    assert verdicts_a != verdicts_c


def test_verify_sampling_uses_only_its_generator() -> None:
    """With a private generator the global RNG is untouched, and re-seeding the generator
    replays the same verdicts."""
    p_table, q_table = toy_tables(WARPS["raw"])
    ids = torch.tensor([2, 4, 1])
    q, p = q_table[[BOS, 2, 4]], p_table[[BOS, 2, 4, 1]]
    state = torch.random.get_rng_state()
    first = [verify_sampling(ids, q, p, torch.Generator().manual_seed(3)) for _ in range(5)]
    gen = torch.Generator().manual_seed(3)
    replay = [verify_sampling(ids, q, p, gen) for _ in range(50)]
    gen.manual_seed(3)
    assert [verify_sampling(ids, q, p, gen) for _ in range(50)] == replay
    assert first == replay[:1] * 5
    assert torch.equal(torch.random.get_rng_state(), state)


# --------------------------------------------------------------------------------------------
# Mutation checks: the same statistical test must reject deliberately wrong verifiers
# --------------------------------------------------------------------------------------------


def reference_verify(
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
    *,
    accept_prob: Callable[[float, float], float] = lambda p_x, q_x: min(1.0, p_x / q_x),
    replacement: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = (
        lambda p, q: (p - q).clamp_min(0.0)
    ),
) -> Verdict:
    """A plain, loop-based Algorithm 1 whose two rules can be swapped for wrong ones.
    Run with the defaults it is correct (and test_reference_verify_is_lossless says so), so
    a mutant's failure is due to its mutation, not to this scaffolding."""
    k = draft_ids.shape[0]
    q_rows = draft_probs
    if q_rows is None:
        q_rows = torch.nn.functional.one_hot(draft_ids, target_probs.shape[-1]).float()
    for i in range(k):
        x = int(draft_ids[i])
        p, q = target_probs[i], q_rows[i]
        if float(torch.rand((), generator=generator)) < accept_prob(float(p[x]), float(q[x])):
            continue
        residual = replacement(p, q)
        return Verdict(i, inverse_cdf_sample(residual, generator))
    return Verdict(k, inverse_cdf_sample(target_probs[k], generator))


def inverse_cdf_sample(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from weights / weights.sum() ([vocab], unnormalised): a second, independent
    sampler (not understudy.sampling.sample), and faster than torch.multinomial here."""
    cdf = weights.cumsum(-1)  # [vocab]
    u = torch.rand((1,), generator=generator) * cdf[-1]
    return min(int(torch.searchsorted(cdf, u, right=True)), weights.shape[-1] - 1)


def mutant_resample_from_p(draft_ids, draft_probs, target_probs, generator) -> Verdict:
    """WRONG: on rejection sample from p instead of norm(max(0, p - q))."""
    return reference_verify(
        draft_ids, draft_probs, target_probs, generator, replacement=lambda p, q: p
    )


def mutant_accept_with_p(draft_ids, draft_probs, target_probs, generator) -> Verdict:
    """WRONG: accept with probability p(x) instead of min(1, p(x) / q(x))."""
    return reference_verify(
        draft_ids, draft_probs, target_probs, generator, accept_prob=lambda p_x, q_x: p_x
    )


def mutant_residual_contaminated(draft_ids, draft_probs, target_probs, generator) -> Verdict:
    """WRONG, subtly: the correction comes 80% from the residual and 20% from p itself."""

    def replacement(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        residual = (p - q).clamp_min(0.0)
        return 0.8 * residual / residual.sum() + 0.2 * p

    return reference_verify(
        draft_ids, draft_probs, target_probs, generator, replacement=replacement
    )


def test_reference_verify_is_lossless() -> None:
    """Control for the mutants: the unmutated scaffolding passes (N_SAMPLES, p > 0.001)."""
    pvalue = joint_pvalue(WARPS["raw"], k=2, verifier=reference_verify)
    assert pvalue > ALPHA, f"reference verifier rejected (p={pvalue:.3g})"


@pytest.mark.parametrize(
    "mutant",
    [mutant_resample_from_p, mutant_accept_with_p, mutant_residual_contaminated],
    ids=lambda f: f.__name__,
)
def test_statistical_test_rejects_wrong_verifier(mutant: Verifier) -> None:
    """Power: a lossy verifier is caught at the same N_SAMPLES (p-value < 0.001)."""
    pvalue = joint_pvalue(WARPS["raw"], k=2, verifier=mutant)
    assert pvalue < ALPHA, f"the test failed to catch {mutant.__name__} (p={pvalue:.3g})"


def mutant_bonus_from_last_draft_row(draft_ids, draft_probs, target_probs, generator):
    """WRONG: the bonus token is drawn from p_K (the last draft's row) instead of p_{K+1}."""
    k = draft_ids.shape[0]
    shifted = torch.cat([target_probs[:k], target_probs[k - 1 : k]])  # [K+1, V]
    return verify_sampling(draft_ids, draft_probs, shifted, generator)


def test_bonus_test_rejects_bonus_from_wrong_row() -> None:
    """Power of test_bonus_token_is_lossless: same K = 1 set-up and N_SAMPLES, p < 0.001."""
    pvalue = joint_pvalue(WARPS["raw"], k=1, verifier=mutant_bonus_from_last_draft_row)
    assert pvalue < ALPHA, f"the test failed to catch a misplaced bonus row (p={pvalue:.3g})"


def test_statistical_test_rejects_argmax_drafter_that_reports_q() -> None:
    """Power: a drafter that proposes argmax q but hands the real verify_sampling the soft q
    (a q its tokens were never drawn from) is lossy, and caught at the same N_SAMPLES
    (p < 0.001). Its honest twin (draft_probs=None) passes in
    test_deterministic_drafter_is_lossless."""
    p_table, q_table = toy_tables(WARPS["raw"])
    counts, _ = simulate(p_table, q_table, k=2, drafter="deterministic", reported_q=q_table)
    pvalue = chisquare_pvalue(counts, exact_joint(p_table))
    assert pvalue < ALPHA, f"the test failed to catch the argmax drafter (p={pvalue:.3g})"


def test_statistical_test_rejects_mismatched_warping() -> None:
    """Power against a subtler bug: the drafter samples from its top-k/temperature-warped q
    but reports its unwarped softmax to the real verify_sampling (p and q must be
    warped the same way). Same N_SAMPLES, p < 0.001."""
    p_table, q_table = toy_tables(WARPS["temperature_top_k"])
    _, q_unwarped = toy_tables(WARPS["raw"])
    counts, _ = simulate(p_table, q_table, k=2, reported_q=q_unwarped)
    pvalue = chisquare_pvalue(counts, exact_joint(p_table))
    assert pvalue < ALPHA, f"the test failed to catch mismatched warping (p={pvalue:.3g})"
