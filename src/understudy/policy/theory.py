"""The theory of speculative decoding: how many tokens a round yields, and what that buys.

Leviathan, Kalman and Matias 2023, "Fast Inference from Transformers via Speculative
Decoding" (ICML). Vocabulary as in engine/stats.py:

- alpha (α): the expected per-token acceptance, the chance that a drafted token is kept.
- K: tokens drafted per round. Every round emits accepted + 1 tokens (the +1 is the
  corrected token at the first rejection, or the bonus token when all K were kept).
- c: the cost of one drafter step divided by the cost of one target pass.

If each drafted token is accepted independently with probability α, the accepted prefix
stops at the first rejection, so (Leviathan et al. 2023, eq. 1)

    E[tokens per round] = 1 + α + α² + ... + α^K = (1 − α^(K+1)) / (1 − α),

which is exactly K + 1 at α = 1. A round costs K drafter steps plus one target pass, i.e.
K·c + 1 target-pass units, against 1 unit per token for plain decoding; so the expected
walltime improvement factor is (Theorem 3.8)

    speedup = E[tokens per round] / (K·c + 1).

`monte_carlo` checks that formula by simulation, and shows what happens when α varies from
round to round: E is a polynomial in α with positive coefficients, hence convex, so by
Jensen's inequality a per-round α' with mean α yields at least E(α) tokens per round on
average (easy and hard stretches of text do not cancel out).

Pure Python and numpy: importing this module must never import torch.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import numpy as np

from understudy.config import MAX_SPECULATIVE_TOKENS, UnderstudyError

MAX_ROUNDS = 10_000_000
_CHUNK_ROUNDS = 65_536  # rounds simulated per numpy batch (bounds memory at K = 64)
_TIE_RTOL = 1e-12  # speedups this close count as equal; the smaller K wins


# --- validation ------------------------------------------------------------------------------


def _real(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise UnderstudyError(f"{name} must be a number, got {value!r}")
    result = float(value)
    if not math.isfinite(result):
        raise UnderstudyError(f"{name} must be a finite number, got {value!r}")
    return result


def _integer(name: str, value: object, low: int, high: int) -> int:
    message = f"{name} must be an integer in {low}..{high}, got {value!r}"
    if isinstance(value, bool):
        raise UnderstudyError(message)
    try:
        result = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise UnderstudyError(message) from None
    if not low <= result <= high:
        raise UnderstudyError(message)
    return result


def _check_alpha(alpha: object) -> float:
    value = _real("alpha", alpha)
    if not 0.0 <= value <= 1.0:
        raise UnderstudyError(f"alpha must be in [0, 1], got {alpha!r}")
    return value


def _check_c(c: object) -> float:
    value = _real("c", c)
    if value < 0.0:
        raise UnderstudyError(f"c must be >= 0, got {c!r}")
    return value


def _check_k(k: object, name: str = "K") -> int:
    return _integer(name, k, 1, MAX_SPECULATIVE_TOKENS)


# --- analytic --------------------------------------------------------------------------------


def expected_tokens_per_round(alpha: float, k: int) -> float:
    """E[tokens per round] = (1 − α^(K+1)) / (1 − α); exactly K + 1 at α = 1.

    Leviathan et al. 2023, eq. 1. Evaluated as the finite sum 1 + α + ... + α^K (Horner),
    which equals the closed form, is exact at α = 1 and has no cancellation as α → 1.
    """
    a = _check_alpha(alpha)
    k = _check_k(k)
    total = 1.0
    for _ in range(k):
        total = 1.0 + a * total
    return total


def expected_acceptance_rate(alpha: float, k: int) -> float:
    """E[accepted] / K = (E[tokens per round] − 1) / K: the share of drafted tokens kept.

    Lower than α for K > 1, because a rejection discards every later drafted token.
    """
    return (expected_tokens_per_round(alpha, k) - 1.0) / k


def expected_speedup(alpha: float, k: int, c: float) -> float:
    """Walltime improvement factor E[tokens per round] / (K·c + 1) (Leviathan Thm 3.8)."""
    cost = _check_c(c)
    return expected_tokens_per_round(alpha, k) / (k * cost + 1.0)


def speedup_curve(alpha: float, c: float, k_max: int = MAX_SPECULATIVE_TOKENS) -> list[float]:
    """Analytic speedup for K = 1..k_max; element i is the speedup at K = i + 1."""
    k_max = _check_k(k_max, "k_max")
    return [expected_speedup(alpha, k, c) for k in range(1, k_max + 1)]


def optimal_k(alpha: float, c: float, k_max: int = MAX_SPECULATIVE_TOKENS) -> tuple[int, float]:
    """The K in 1..k_max with the highest analytic speedup (ties -> smaller K), and that speedup."""
    curve = speedup_curve(alpha, c, k_max)
    best_k, best = 1, curve[0]
    for k, value in enumerate(curve[1:], start=2):
        if value > best * (1.0 + _TIE_RTOL):
            best_k, best = k, value
    return best_k, best


# --- Monte Carlo -----------------------------------------------------------------------------


def _beta_parameters(alpha: float, spread: float) -> tuple[float, float] | None:
    """Beta(a, b) with mean alpha and standard deviation spread, or None when no such Beta
    exists (spread² >= α(1 − α)): then the caller uses its limit, α' ~ Bernoulli(α)."""
    concentration = alpha * (1.0 - alpha) / (spread * spread) - 1.0
    if concentration <= 0.0:
        return None
    return alpha * concentration, (1.0 - alpha) * concentration


def _per_round_alpha(
    rng: np.random.Generator, alpha: float, spread: float, n: int
) -> np.ndarray:  # [n]
    if spread == 0.0 or alpha in (0.0, 1.0):
        return np.full(n, alpha)
    params = _beta_parameters(alpha, spread)
    if params is None:
        return (rng.random(n) < alpha).astype(np.float64)
    return np.clip(rng.beta(params[0], params[1], size=n), 0.0, 1.0)


def _effective_spread(alpha: float, spread: float) -> float:
    """The standard deviation of α' actually simulated (capped at sqrt(α(1 − α)))."""
    return min(spread, math.sqrt(alpha * (1.0 - alpha)))


def monte_carlo(
    alpha: float,
    c: float,
    k: int,
    *,
    rounds: int = 20_000,
    spread: float = 0.1,
    seed: int = 0,
) -> dict[str, Any]:
    """Simulate `rounds` rounds of drafting K tokens and verifying them.

    Each round draws its own acceptance α' from a Beta distribution with mean alpha and
    standard deviation `spread` (spread 0: α' = alpha; a spread too wide for any Beta falls
    back to the limit α' ~ Bernoulli(alpha)). Drafted token i is accepted with probability α'
    while every earlier one was; the round emits accepted + 1 tokens. Returns the mean tokens
    per round and its standard error, the implied speedup (Leviathan Thm 3.8 cost model),
    acceptance_rate = accepted / drafted, mean_accepted_length = (accepted + rounds) / rounds
    and per_position_acceptance, as engine/stats.py defines them.
    """
    a = _check_alpha(alpha)
    cost = _check_c(c)
    k = _check_k(k)
    rounds = _integer("rounds", rounds, 2, MAX_ROUNDS)
    spread = _real("spread", spread)
    if spread < 0.0:
        raise UnderstudyError(f"spread must be >= 0, got {spread!r}")
    seed = _integer("seed", seed, 0, 2**63 - 1)

    rng = np.random.default_rng(seed)
    accepted_sum = 0
    accepted_sq_sum = 0
    per_position = np.zeros(k, dtype=np.int64)  # [k]
    done = 0
    while done < rounds:
        n = min(_CHUNK_ROUNDS, rounds - done)
        alpha_r = _per_round_alpha(rng, a, spread, n)  # [n]
        kept = rng.random((n, k)) < alpha_r[:, None]  # [n, k]
        prefix = np.cumprod(kept, axis=1, dtype=np.int64)  # [n, k]: 1 until first rejection
        accepted = prefix.sum(axis=1)  # [n]
        accepted_sum += int(accepted.sum())
        accepted_sq_sum += int((accepted * accepted).sum())
        per_position += prefix.sum(axis=0)
        done += n

    # tokens per round = accepted + 1, so it shares the variance of `accepted`.
    mean_accepted = accepted_sum / rounds
    variance = max(0.0, (accepted_sq_sum - accepted_sum * mean_accepted) / (rounds - 1))
    stderr = math.sqrt(variance / rounds)
    tokens_per_round = mean_accepted + 1.0
    round_cost = k * cost + 1.0
    return {
        "rounds": rounds,
        "spread": spread,
        "spread_effective": _effective_spread(a, spread),
        "seed": seed,
        "tokens_per_round": tokens_per_round,
        "stderr": stderr,
        "speedup": tokens_per_round / round_cost,
        "speedup_stderr": stderr / round_cost,
        "acceptance_rate": accepted_sum / (rounds * k),
        "mean_accepted_length": (accepted_sum + rounds) / rounds,
        "per_position_acceptance": (per_position / rounds).tolist(),
    }


# --- report ----------------------------------------------------------------------------------


def simulate_report(
    alpha: float,
    c: float,
    k: int | None = None,
    *,
    rounds: int = 20_000,
    spread: float = 0.1,
    seed: int = 0,
) -> dict[str, Any]:
    """Everything `understudy simulate` shows, as a JSON-ready dict.

    `k` None means "use the optimal K". `speedup_by_k[i]` is the analytic speedup at K = i + 1
    for K = 1..64, so a UI can draw the curve.
    """
    a = _check_alpha(alpha)
    cost = _check_c(c)
    best_k, best_speedup = optimal_k(a, cost)
    chosen_k = best_k if k is None else _check_k(k)
    return {
        "alpha": a,
        "c": cost,
        "k": chosen_k,
        "k_source": "optimal" if k is None else "given",
        "expected_tokens_per_round": expected_tokens_per_round(a, chosen_k),
        "expected_acceptance_rate": expected_acceptance_rate(a, chosen_k),
        "speedup": expected_speedup(a, chosen_k, cost),
        "optimal_k": best_k,
        "optimal_speedup": best_speedup,
        "monte_carlo": monte_carlo(a, cost, chosen_k, rounds=rounds, spread=spread, seed=seed),
        "speedup_by_k": speedup_curve(a, cost),
    }
