"""A live estimate of c from the rounds' own wall times (method="hybrid" on padded passes).

Where the pass curve cannot be measured (padded passes cost the same for 1 or 16 rows), the
build's one-step timing of c underrates what a guess costs in use: the draft attends over the
whole request and catches up on corrected tokens. There hybrid follows c from its rounds.
"""

from __future__ import annotations


class LiveCostRatio:
    """c = (seconds per draft-model guess) / (seconds per one-row target pass), from the
    rounds' own wall times: the model's time drafting per guess it made (its catch-up on
    tokens it has not seen is priced apart, catch_up_ratio, and timed apart), and the
    target's time between propose() returning and the next commit() (the engine's
    verification pass) over that pass's cost in one-row passes (pass_cost). Timed with
    the guesses, the catch-up on a prompt makes the first model round's c several times the
    measured one; the plans then turn to free guesses and plain passes, each probe of the
    model catches up on every token since the last, and the estimate never recovers.

    The estimate starts at `initial` (the build's c), which counts as PRIOR_ROUNDS
    observations; each observation decays by DECAY per round after it."""

    PRIOR_ROUNDS = 2.0
    DECAY = 0.9

    def __init__(self, initial: float) -> None:
        self.initial = initial
        self.seconds_per_guess: float | None = None  # running means, decayed
        self.seconds_per_pass: float | None = None
        self.weight = 0.0  # decayed count of model rounds seen

    @property
    def value(self) -> float:
        if self.seconds_per_guess is None or self.seconds_per_pass is None:
            return self.initial
        observed = self.seconds_per_guess / max(self.seconds_per_pass, 1e-9)
        prior = self.PRIOR_ROUNDS
        return (prior * self.initial + self.weight * observed) / (prior + self.weight)

    def observe_draft(self, seconds: float, guesses: int) -> None:
        if guesses <= 0:
            return
        per_guess = seconds / guesses
        old = self.seconds_per_guess
        self.seconds_per_guess = (
            per_guess if old is None else self.DECAY * old + (1 - self.DECAY) * per_guess
        )
        self.weight = self.DECAY * self.weight + 1.0

    def observe_pass(self, seconds: float) -> None:
        old = self.seconds_per_pass
        self.seconds_per_pass = (
            seconds if old is None else self.DECAY * old + (1 - self.DECAY) * seconds
        )
