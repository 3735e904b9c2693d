"""Automatic K: the choice follows acceptance and cost as the theory says."""

from __future__ import annotations

import pytest

from understudy.policy.adaptive_k import AdaptiveK
from understudy.policy.costs import Costs, PassCurve
from understudy.policy.theory import optimal_k


def feed(policy: AdaptiveK, alpha: float, rounds: int = 200) -> None:
    """Rounds in which each guess is accepted with probability alpha (deterministic pattern)."""
    for r in range(rounds):
        k = policy.k_max
        accepted = 0
        while accepted < k and ((r * 7 + accepted * 13) % 100) < alpha * 100:
            accepted += 1
        policy.observe(k, accepted)


def test_high_acceptance_cheap_draft_uses_every_row():
    policy = AdaptiveK(15, Costs(draft_step=0.02))
    feed(policy, alpha=0.95)
    assert policy.choose() == 15


def test_expensive_draft_and_poor_acceptance_falls_back_to_plain_and_probes():
    policy = AdaptiveK(4, Costs(draft_step=0.9))
    for _ in range(100):
        policy.observe(2, 0)
    choices = [policy.choose() for _ in range(16)]
    assert choices.count(0) == 14 and choices.count(1) == 2  # a K=1 probe every 8 rounds


def test_choice_matches_theory_for_uniform_acceptance():
    """With a per-position acceptance of exactly alpha, the choice is Leviathan's optimal K
    or a longer K whose theoretical speedup is within NEAR_TIE of the optimum."""
    for alpha, c in [(0.9, 0.3), (0.8, 0.1), (0.6, 0.05), (0.95, 0.02)]:
        policy = AdaptiveK(64, Costs(draft_step=c))
        policy.hits = [alpha * 1e6] * 64
        policy.tries = [1e6] * 64
        policy.seen = [1e6] * 64
        best_k, best_speedup = optimal_k(alpha, c)
        chosen = policy.choose()
        assert chosen >= best_k
        assert policy.rate(chosen) == pytest.approx(policy.rate(best_k), rel=AdaptiveK.NEAR_TIE)
        assert policy.rate(best_k) == pytest.approx(best_speedup, rel=1e-9)


def test_estimates_are_per_position():
    policy = AdaptiveK(3, Costs(draft_step=0.1))
    for _ in range(300):
        policy.observe(3, 1)  # first guess always kept, second never
    assert policy.hits[0] / policy.tries[0] > 0.95
    assert policy.hits[1] / policy.tries[1] < 0.05
    assert policy.choose() == 1


def test_unseen_positions_borrow_the_deepest_estimate():
    """K can grow past what was tried: positions never reached take the deepest observed
    position's estimate, not the prior; once observed, their own estimate rules."""
    policy = AdaptiveK(15, Costs(draft_step=0.05))
    for _ in range(100):
        policy.observe(3, 3)  # three guesses, always all kept
    assert policy.acceptance(10) == policy.acceptance(2) > 0.99
    assert policy.choose() > 3
    for _ in range(300):
        policy.observe(15, 3)  # deeper guesses: the 4th is never kept
    assert policy.acceptance(3) < 0.05
    assert policy.choose() == 3


def test_a_step_in_the_pass_curve_caps_k_at_the_kernels_row_group():
    """Passes flat up to 4 rows and twice as dear from 5 (the GGUF kernels' row groups): with
    the curve, K stops at 3; with only the slope at 16 rows, the same acceptance drafts
    further. Acceptance 0.95, c = 0.1."""
    curve = (
        (1.0, 1.01, 1.02, 1.03)
        + tuple(2.0 + 0.01 * i for i in range(4))
        + tuple(3.0 + 0.01 * i for i in range(8))
    )
    slope = (curve[-1] - 1) / 15
    measured = PassCurve(tuple(range(1, 17)), curve)
    with_curve = AdaptiveK(15, Costs(draft_step=0.1, row=slope, pass_curve=measured))
    slope_only = AdaptiveK(15, Costs(draft_step=0.1, row=slope))
    for ak in (with_curve, slope_only):
        for i in range(15):
            ak.hits[i], ak.tries[i], ak.seen[i] = 95.0, 100.0, 100.0
    assert with_curve.choose() == 3
    assert slope_only.choose() > 3
    assert with_curve.pass_cost(3) == pytest.approx(1.03) and with_curve.pass_cost(4) == 2.0
