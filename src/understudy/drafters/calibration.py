"""How often does the target keep a guess the draft made with probability p? Learnt online.

The draft's own probability of its guess is an estimate of the chance the target keeps it,
and a biased one: on chat prompts the default int4 0.5B draft is under-confident at middling
probabilities (guesses it gave 0.4-0.5 were kept ~63% of the time, measured over all start
positions of 3 chat outputs), on code it is close to calibrated. `AcceptanceCalibration`
maps p to the rate at which the target actually kept such guesses in this request so far:
histogram binning (Zadrozny & Elkan 2001) with a prior that trusts the draft,

    estimate(p) = (kept_b + PRIOR_WEIGHT * p) / (seen_b + PRIOR_WEIGHT),  b = p's bin,

so an unseen bin answers p itself and a bin's own record takes over as it fills.

Invariants: only guesses the target actually judged are observed (those up to the first
rejection, that one included), so each observation is an honest draw of "kept, given the
guesses before it were kept". The calibration starts fresh for every request and reads only
the past: a round's length stays a function of the draft's own draws and of verified history,
which keeps verification exact under sampling, and seeded sampling reproducible.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from understudy.config import TREE_MODES, TreeMode, UnderstudyError
from understudy.drafters.base import Drafter, positive_int, take_options, threshold

if TYPE_CHECKING:
    from understudy.policy.costs import Costs


class AcceptanceCalibration:
    BINS = 10  # equal-width bins of the draft's probability over [0, 1]
    PRIOR_WEIGHT = 4.0  # the draft's own p counts as this many observations in its bin

    def __init__(self) -> None:
        self.kept = [0.0] * self.BINS  # guesses kept, per bin
        self.seen = [0.0] * self.BINS  # guesses judged, per bin

    def _bin(self, p: float) -> int:
        return min(max(int(p * self.BINS), 0), self.BINS - 1)

    def estimate(self, p: float) -> float:
        """The calibrated chance that a guess the draft made with probability p is kept."""
        b = self._bin(p)
        return (self.kept[b] + self.PRIOR_WEIGHT * p) / (self.seen[b] + self.PRIOR_WEIGHT)

    def highest_estimate(self) -> float:
        """An upper bound of estimate(p) over every p: each bin's estimate at its top edge
        (estimate grows with p inside a bin). A path whose product with it is below a
        threshold is below it whatever the next guess's p."""
        prior = self.PRIOR_WEIGHT
        return max(
            (self.kept[b] + prior * (b + 1) / self.BINS) / (self.seen[b] + prior)
            for b in range(self.BINS)
        )

    def observe_round(self, probabilities: list[float], kept: int) -> None:
        """A verified round: the draft's probabilities of its guesses in order, and how many
        of them the target kept (the first `kept` were; guess `kept`, if any, was not)."""
        for i, p in enumerate(probabilities[: kept + 1]):
            b = self._bin(p)
            self.seen[b] += 1.0
            self.kept[b] += 1.0 if i < kept else 0.0


# a round's context is checked this far back before its guesses count for calibration (the
# free guesses a hybrid round puts before the model's are fewer than a pass's rows)
CONTEXT_CHECKED = 64


class RoundRecord:
    """A drafter's latest chain round, kept until the target has judged it, and the
    calibration that learns from it (what a doubt-stopping drafter needs between rounds).

    Invariant: a round is observed at most once, and only if the context it continued was
    kept (under method="hybrid" that context may end in free guesses the target rejected);
    then its guesses up to the first rejected one count, as AcceptanceCalibration requires."""

    def __init__(self) -> None:
        self.calibration = AcceptanceCalibration()
        self.start = 0  # len(context) when the round was drafted
        self.tail: list[int] = []  # context[-CONTEXT_CHECKED:]
        self.ids: list[int] = []  # the round's guesses
        self.probs: list[float] = []  # the drafter's own probability of each

    def remember(self, context: list[int], ids: list[int], probs: list[float]) -> None:
        self.start, self.tail = len(context), context[-CONTEXT_CHECKED:]
        self.ids, self.probs = ids, probs

    def judge(self, tokens: list[int]) -> None:
        """The sequence after verification: count how many guesses were kept, once."""
        if not self.probs:
            return
        start, tail = self.start, self.tail
        if tokens[start - len(tail) : start] == tail:  # its context was kept: judged
            judged = tokens[start : start + len(self.ids)]
            kept = 0
            while kept < len(judged) and judged[kept] == self.ids[kept]:
                kept += 1
            self.calibration.observe_round(self.probs, kept)
        self.probs = []


class DoubtRules(Drafter):
    """The two round-ending rules a chain drafter may take (draft_confidence and
    draft_path_confidence, drafters/draft_model.py), shared by method="draft" and "eagle".
    Under automatic K, "auto" (None) becomes the subclass's `auto_path_confidence` or c + v,
    whichever is more: a guess costs its draft step and its target row, c + v target passes,
    and plain decoding earns one token a pass, so a guess whose round is kept with a lower
    chance than c + v earns less than plain decoding would in its time (settle). On a CPU
    where a draft step is half a target pass this ends rounds far earlier than the tuned
    value alone. Where the pass curve was measured, v is each guess's own row (path_doubt):
    the slope of the curve's lower convex hull there (policy/costs.py, hull_steps)."""

    auto_path_confidence = 0.0
    guess_cost = 0.0  # c + v, measured when the engine is built (settle)
    draft_step = 0.0  # c alone
    row_steps: tuple[float, ...] = ()  # the target row each guess adds, where measured
    path_floors: tuple[float, ...] = ()  # settled "auto": guess g + 1's threshold, by g
    confidence: float | None
    path_confidence: float | None
    record: RoundRecord

    def init_doubt(self, confidence: float | None, path_confidence: float | None) -> None:
        # stop a round at a guess the drafter doubts more (None: "auto", see default_confidence)
        self.confidence = confidence
        # ... or where the calibrated chance of keeping the whole round so far falls below this
        self.path_confidence = path_confidence
        self.record = RoundRecord()  # the latest chain round, until the target judges it

    def settle(self, costs: Costs, automatic_k: bool) -> None:
        """Take c and the row costs, then settle "auto": auto_path_confidence (or c + v) with
        automatic K, else off."""
        self.guess_cost = costs.draft_step + costs.row
        self.draft_step = costs.draft_step
        self.row_steps = costs.row_steps()
        if self.confidence is None:
            self.confidence = 0.0
        if self.path_confidence is None:
            auto = min(max(self.auto_path_confidence, self.guess_cost), 1.0)
            self.path_confidence = auto if automatic_k else 0.0
            floors = (max(self.auto_path_confidence, self.draft_step + s) for s in self.row_steps)
            self.path_floors = tuple(min(f, 1.0) for f in floors) if automatic_k else ()

    def settled_like(self, other: DoubtRules) -> None:
        """Take `other`'s settled thresholds (a seat's drafter, like the engine's own)."""
        self.confidence, self.path_confidence = other.confidence, other.path_confidence
        self.guess_cost, self.draft_step = other.guess_cost, other.draft_step
        self.row_steps, self.path_floors = other.row_steps, other.path_floors

    def path_doubt(self, guesses: int) -> float:
        """The calibrated chance of keeping the round below which the guess after `guesses`
        guesses ends it: with the measured pass curve, c plus what that guess's row costs
        (the curve's hull slope there), else the settled draft_path_confidence."""
        if guesses < len(self.path_floors):
            return self.path_floors[guesses]
        return self.path_confidence or 0.0

    def next_guess_doubted(self, path: float, guesses: int) -> bool:
        """Whether the path rule will end a chain of `guesses` guesses, whose calibrated
        chance of being kept is `path`, at its next guess whatever the draft gives it (the
        path times the highest calibrated estimate is under that guess's floor): the chain
        can end now, without the draft step that would only show it. The same guesses as
        drafting on: a round's proposal does not change, only its cost."""
        if not self.path_confidence:
            return False
        return path * self.calibration.highest_estimate() < self.path_doubt(guesses)

    @property
    def stops_by_confidence(self) -> bool:
        return bool(self.confidence or self.path_confidence)

    @property
    def calibration(self) -> AcceptanceCalibration:
        return self.record.calibration


def chain_and_tree_options(
    method: str, options: Mapping[str, object], defaults: Mapping[str, object]
) -> tuple[dict[str, Any], TreeMode, int, float | None, float | None]:
    """The options of a drafter that may draft trees and stop chains on doubt (draft, eagle):
    (all options, tree mode, tree_branching, draft_confidence, draft_path_confidence)."""
    opts = take_options(method, options, defaults)
    if opts["tree"] not in TREE_MODES:
        raise UnderstudyError(f"tree must be one of {', '.join(TREE_MODES)}, got {opts['tree']!r}")
    branching = positive_int(method, "tree_branching", opts["tree_branching"])
    confidence = threshold("draft_confidence", opts["draft_confidence"])
    path = threshold("draft_path_confidence", opts["draft_path_confidence"])
    tree: TreeMode = opts["tree"]
    return opts, tree, branching, confidence, path
