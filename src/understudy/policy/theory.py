"""The theory of speculative decoding: how many tokens a round yields, and what that buys.

Leviathan, Kalman and Matias 2023, "Fast Inference from Transformers via Speculative
Decoding" (ICML). Vocabulary as in engine/stats.py:

- alpha (α): the expected per-token acceptance, the chance that a drafted token is kept.
- K: tokens drafted per round. Every round emits accepted + 1 tokens (the +1 is the
  corrected token at the first rejection, or the bonus token when all K were kept).
- c: the cost of one drafter step divided by the cost of one target pass of one row.
- T(n): the cost of a target pass of n rows, in one-row passes (`PassCost`).

If each drafted token is accepted independently with probability α, the accepted prefix
stops at the first rejection, so (Leviathan et al. 2023, eq. 1)

    E[tokens per round] = 1 + α + α² + ... + α^K = (1 − α^(K+1)) / (1 − α),

which is exactly K + 1 at α = 1. A round costs K drafter steps plus one target pass of K + 1
rows (every drafted token is a row: the target scores them all before it knows which it
keeps), i.e. K·c + T(K+1) one-row passes, against 1 per token for plain decoding; so

    speedup = E[tokens per round] / (K·c + T(K+1)).

Leviathan et al.'s Theorem 3.8, E / (K·c + 1), is the case T = 1: a pass costs the same
whatever its rows, as on an accelerator far from its compute bound, or with passes padded to
one shape. A CPU's pass grows with its rows; where it does, the K that pays is smaller and
the speedup lower than the flat formula says.

`monte_carlo` checks that formula by simulation, and shows what happens when α varies from
round to round: E is a polynomial in α with positive coefficients, hence convex, so by
Jensen's inequality a per-round α' with mean α yields at least E(α) tokens per round on
average (easy and hard stretches of text do not cancel out).

Pure Python and numpy: importing this module must never import torch.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
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


# --- what a pass of n rows costs --------------------------------------------------------------


@dataclass(frozen=True)
class PassCost:
    """T(n): a target pass of n rows, in one-row passes.

    `curve[n − 1]` is t(n) / t(1) for n = 1..len(curve) where measured (the engine measures
    it when it is built: engine.costs.pass_curve.ratios); past the curve, or without one,
    T(n) = 1 + (n − 1)·`row`. The same reading as the engine's round planner
    (policy/adaptive_k.py), so the theory predicts what the engine weighs. The default,
    row 0 and no curve, is a flat pass: Leviathan et al.'s cost model.
    """

    row: float = 0.0  # v: one more row of a pass / a one-row pass
    curve: tuple[float, ...] = ()  # t(n) / t(1), n = 1, 2, ...; starts at 1, never falls

    def __post_init__(self) -> None:
        row = _real("row_cost", self.row)
        if row < 0.0:
            raise UnderstudyError(f"row_cost must be >= 0, got {self.row!r}")
        curve = tuple(_real("pass_curve", t) for t in self.curve)
        if curve and curve[0] != 1.0:
            raise UnderstudyError(
                f"pass_curve must start at 1 (a one-row pass over itself), got {curve[0]!r}"
            )
        for n in range(1, len(curve)):
            if curve[n] < curve[n - 1]:
                raise UnderstudyError(
                    f"pass_curve must never fall (more rows cost no less), "
                    f"got {curve[n]!r} at {n + 1} rows after {curve[n - 1]!r}"
                )
        object.__setattr__(self, "row", row)
        object.__setattr__(self, "curve", curve)

    @classmethod
    def from_curve(cls, curve: tuple[float, ...]) -> PassCost:
        """The curve, continued past its end by the line from (1, 1) to its last point (the
        slope the engine calls v)."""
        curve = cls(curve=curve).curve  # checked first
        slope = (curve[-1] - 1.0) / (len(curve) - 1) if len(curve) > 1 else 0.0
        return cls(row=slope, curve=curve)

    def rows(self, n: int) -> float:
        """T(n), n >= 1."""
        return self.curve[n - 1] if n <= len(self.curve) else 1.0 + (n - 1) * self.row

    @property
    def flat(self) -> bool:
        """Whether every pass costs one one-row pass (Leviathan et al.'s model)."""
        return self.row == 0.0 and all(t == 1.0 for t in self.curve)

    def describe(self) -> str:
        """The model in one line, for people."""
        line = f"1 + (n − 1)·{self.row:.4g}"
        if self.curve:
            return f"T(n) from the pass curve for n <= {len(self.curve)} rows, {line} past it"
        return (
            "T(n) = 1, rows are free (v = 0: Leviathan et al.)" if self.flat else f"T(n) = {line}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {"row_cost": self.row, "pass_curve": list(self.curve), "flat": self.flat}


FLAT = PassCost()


def parse_pass_curve(text: str) -> tuple[float, ...]:
    """Read "1,1.01,1.06" as (1.0, 1.01, 1.06), a checked pass curve; a clear error if not."""
    try:
        curve = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise UnderstudyError(
            f"pass_curve must be numbers separated by commas (t(n)/t(1) for n = 1, 2, ...), "
            f"got {text!r}"
        ) from None
    return PassCost(curve=curve).curve


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


def round_cost(k: int, c: float, passes: PassCost = FLAT) -> float:
    """K·c + T(K+1): a round of K drafter steps and one target pass of K + 1 rows."""
    return _check_k(k) * _check_c(c) + passes.rows(k + 1)


def expected_speedup(alpha: float, k: int, c: float, passes: PassCost = FLAT) -> float:
    """Walltime improvement factor E[tokens per round] / (K·c + T(K+1)); with the default
    flat pass, E / (K·c + 1) (Leviathan Thm 3.8)."""
    return expected_tokens_per_round(alpha, k) / round_cost(k, c, passes)


def speedup_curve(
    alpha: float, c: float, k_max: int = MAX_SPECULATIVE_TOKENS, passes: PassCost = FLAT
) -> list[float]:
    """Analytic speedup for K = 1..k_max; element i is the speedup at K = i + 1."""
    k_max = _check_k(k_max, "k_max")
    return [expected_speedup(alpha, k, c, passes) for k in range(1, k_max + 1)]


def optimal_k(
    alpha: float, c: float, k_max: int = MAX_SPECULATIVE_TOKENS, passes: PassCost = FLAT
) -> tuple[int, float]:
    """The K in 1..k_max with the highest analytic speedup (ties -> smaller K), and that speedup."""
    curve = speedup_curve(alpha, c, k_max, passes)
    best_k, best = 1, curve[0]
    for k, value in enumerate(curve[1:], start=2):
        if value > best * (1.0 + _TIE_RTOL):
            best_k, best = k, value
    return best_k, best


def alpha_from_acceptance_rate(rate: float, k: int) -> float:
    """The α whose expected accepted / drafted at K is `rate` (bisection: the rate grows
    with α), so a run's measured acceptance can be read as the model's α."""
    rate = _real("acceptance_rate", rate)
    if not 0.0 <= rate <= 1.0:
        raise UnderstudyError(f"acceptance_rate must be in [0, 1], got {rate!r}")
    k = _check_k(k)
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        if expected_acceptance_rate(mid, k) < rate:
            low = mid
        else:
            high = mid
    return (low + high) / 2


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
    passes: PassCost = FLAT,
) -> dict[str, Any]:
    """Simulate `rounds` rounds of drafting K tokens and verifying them.

    Each round draws its own acceptance α' from a Beta distribution with mean alpha and
    standard deviation `spread` (spread 0: α' = alpha; a spread too wide for any Beta falls
    back to the limit α' ~ Bernoulli(alpha)). Drafted token i is accepted with probability α'
    while every earlier one was; the round emits accepted + 1 tokens, and is charged what it
    ran: K drafter steps at c each and one target pass of K + 1 rows at `passes` (rejected
    rows included: the target scored them). speedup = tokens emitted / one-row passes
    charged, against plain decoding's one pass per token. Returns that, the mean tokens per
    round and their standard errors, acceptance_rate = accepted / drafted,
    mean_accepted_length = (accepted + rounds) / rounds and per_position_acceptance, as
    engine/stats.py defines them.
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
    charged = 0.0  # one-row passes the rounds cost
    pass_of = np.array([0.0] + [passes.rows(n) for n in range(1, k + 2)])  # [k + 2]: T(n) at n
    per_position = np.zeros(k, dtype=np.int64)  # [k]
    done = 0
    while done < rounds:
        n = min(_CHUNK_ROUNDS, rounds - done)
        alpha_r = _per_round_alpha(rng, a, spread, n)  # [n]
        kept = rng.random((n, k)) < alpha_r[:, None]  # [n, k]
        prefix = np.cumprod(kept, axis=1, dtype=np.int64)  # [n, k]: 1 until first rejection
        accepted = prefix.sum(axis=1)  # [n]
        rows = np.full(n, k + 1)  # [n]: the drafted tokens and the row that scores past them
        charged += float((k * cost + pass_of[rows]).sum())
        accepted_sum += int(accepted.sum())
        accepted_sq_sum += int((accepted * accepted).sum())
        per_position += prefix.sum(axis=0)
        done += n

    # tokens per round = accepted + 1, so it shares the variance of `accepted`.
    mean_accepted = accepted_sum / rounds
    variance = max(0.0, (accepted_sq_sum - accepted_sum * mean_accepted) / (rounds - 1))
    stderr = math.sqrt(variance / rounds)
    tokens_per_round = mean_accepted + 1.0
    cost_per_round = charged / rounds  # every round has the same rows, so its cost is fixed
    return {
        "rounds": rounds,
        "spread": spread,
        "spread_effective": _effective_spread(a, spread),
        "seed": seed,
        "tokens_per_round": tokens_per_round,
        "stderr": stderr,
        "round_cost": cost_per_round,
        "speedup": (accepted_sum + rounds) / charged,
        "speedup_stderr": stderr / cost_per_round,
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
    passes: PassCost = FLAT,
    rounds: int = 20_000,
    spread: float = 0.1,
    seed: int = 0,
) -> dict[str, Any]:
    """Everything `understudy simulate` shows, as a JSON-ready dict.

    `k` None means "use the optimal K" (under `passes`). `speedup_by_k[i]` is the analytic
    speedup at K = i + 1 for K = 1..64, so a UI can draw the curve; `leviathan_*` are the
    same with a flat pass (v = 0), to show what the rows' cost takes away.
    """
    a = _check_alpha(alpha)
    cost = _check_c(c)
    best_k, best_speedup = optimal_k(a, cost, passes=passes)
    flat_k, flat_speedup = optimal_k(a, cost)
    chosen_k = best_k if k is None else _check_k(k)
    mc = monte_carlo(a, cost, chosen_k, rounds=rounds, spread=spread, seed=seed, passes=passes)
    return {
        "alpha": a,
        "c": cost,
        "pass_cost": {**passes.to_dict(), "model": passes.describe()},
        "k": chosen_k,
        "k_source": "optimal" if k is None else "given",
        "expected_tokens_per_round": expected_tokens_per_round(a, chosen_k),
        "expected_acceptance_rate": expected_acceptance_rate(a, chosen_k),
        "round_cost": round_cost(chosen_k, cost, passes),
        "speedup": expected_speedup(a, chosen_k, cost, passes),
        "optimal_k": best_k,
        "optimal_speedup": best_speedup,
        "monte_carlo": mc,
        "speedup_by_k": speedup_curve(a, cost, passes=passes),
        "leviathan_speedup": expected_speedup(a, chosen_k, cost),
        "leviathan_optimal_k": flat_k,
        "leviathan_optimal_speedup": flat_speedup,
        "leviathan_speedup_by_k": speedup_curve(a, cost),
    }
