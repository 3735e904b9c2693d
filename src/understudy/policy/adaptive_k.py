"""Automatic K: choose each round's speculation length from live measurements.

Leviathan et al. 2023 (Theorem 3.8): with per-token acceptance alpha and draft cost c (one
draft step / one target pass), a round of K guesses yields E(K) = (1 - alpha^(K+1)) / (1 - alpha)
tokens at a cost of K*c + 1 target passes. Acceptance is not one number in practice: the
i-th guess is accepted less often than the first, so we keep a running estimate of the
conditional acceptance a_i = P(guess i accepted | guesses 1..i-1 accepted) per position, with
a Beta prior, and c from measured times. Then E(K) = 1 + sum_j prod_{i<=j} a_i and we pick
K in 0..k_max maximising E(K) / (K*c + T(K + 1)). K = 0 is plain decoding (speculation does
not pay); we still probe with K = 1 every few rounds so the estimates can recover. T(n) is a
target pass of n rows in 1-row passes: 1 when every pass is padded to the same shape, else
the curve measured at build where there is one (the GGUF kernels share their weights among
4 rows: flat to 4, then a step), else 1 + (n - 1) v with v the slope at the row budget.

Determinism: c is measured once, when the engine is built (`Engine.from_pretrained`), and
the acceptance estimates start fresh for every request, so the K sequence depends only on
the request and its seed: seeded sampling stays reproducible.
"""

from __future__ import annotations

from understudy.policy.costs import Costs


class AdaptiveK:
    PRIOR_ACCEPT = 0.8  # a prior belief, worth PRIOR_WEIGHT observations
    PRIOR_WEIGHT = 2.0
    DECAY = 0.98  # older rounds count less: acceptance drifts with the text
    PROBE_EVERY = 8
    SEEN_ENOUGH = 1.0  # observations before a position's own estimate is used
    NEAR_TIE = 0.03  # rates this close to the best count as ties, won by the longer K

    def __init__(self, k_max: int, costs: Costs) -> None:
        self.k_max = k_max
        self.costs = costs  # c and the pass's cost by its rows, measured at engine build
        self.c = costs.draft_step
        self.hits = [self.PRIOR_ACCEPT * self.PRIOR_WEIGHT] * k_max  # accepted at position i
        self.tries = [self.PRIOR_WEIGHT] * k_max  # reached position i
        self.seen = [0.0] * k_max  # real (decayed) observations at position i, prior excluded
        self.rounds_without_draft = 0

    def acceptance(self, i: int) -> float:
        """Estimated P(guess i kept | guesses before it kept). A position never reached yet
        borrows the estimate of the deepest position seen (optimism: a draft that has been
        right so far tends to stay right, measured ~0.9-1.0 deep into a round on the default
        pair, above the prior), so K can grow past what has been tried and find out."""
        if self.seen[i] < self.SEEN_ENOUGH:
            deeper = [j for j in range(i) if self.seen[j] >= self.SEEN_ENOUGH]
            if deeper:
                j = deeper[-1]
                return self.hits[j] / self.tries[j]
        return self.hits[i] / self.tries[i]

    def expected_tokens(self, k: int) -> float:
        return self.expected_tokens_upto(k)[k]

    def expected_tokens_upto(self, k: int) -> list[float]:
        """[E(0), E(1), ..., E(k)]: modelled tokens of rounds of 0..k guesses, in one sweep."""
        table, reach = [1.0], 1.0
        for i in range(k):
            reach *= self.acceptance(i)
            table.append(table[-1] + reach)
        return table

    def pass_cost(self, k: int) -> float:
        """A target pass of k + 1 rows in 1-row passes: the measured curve, else 1 + k v."""
        return self.costs.pass_cost(k)

    def rate(self, k: int) -> float:
        """Modelled tokens per target-pass-equivalent of a round of k guesses."""
        return self.expected_tokens(k) / (k * self.c + self.pass_cost(k))

    def choose(self) -> int:
        tokens = self.expected_tokens_upto(self.k_max)  # one sweep: rate(k) for every k
        rates = [tokens[k] / (k * self.c + self.pass_cost(k)) for k in range(self.k_max + 1)]
        best = max(rates)
        # near the optimum the curve is flat, and real acceptance is burstier than the
        # per-position model (a draft that is right keeps being right), which understates
        # long rounds: take the longest K within NEAR_TIE of the best
        best_k = (
            0
            if best <= 1.0
            else max(k for k, r in enumerate(rates) if r >= best * (1 - self.NEAR_TIE))
        )
        if best_k == 0:
            self.rounds_without_draft += 1
            if self.rounds_without_draft >= self.PROBE_EVERY:
                self.rounds_without_draft = 0
                return 1
        return best_k

    def observe(self, drafted: int, accepted: int) -> None:
        """Record one round: `accepted` of `drafted` guesses kept."""
        for i in range(self.k_max):
            self.hits[i] *= self.DECAY
            self.tries[i] *= self.DECAY
            self.seen[i] *= self.DECAY
        for i in range(min(drafted, accepted + 1)):
            self.tries[i] += 1.0
            self.seen[i] += 1.0
            self.hits[i] += 1.0 if i < accepted else 0.0
