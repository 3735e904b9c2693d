"""How long each sequence's chain is in a round of a batch: speculation that keeps paying.

Alone, a round of K guesses costs a draft step per guess and a target pass of K + 1 rows,
and a pass of a few rows costs about what a pass of one does (it is memory-bound). In a
batch every sequence's rows share ONE target pass, and a pass of many rows is compute-bound:
its cost grows with its rows. So the lengths that pay alone stop paying as the batch grows.

Each round, every sequence's own planner says how far it would draft alone (`want`), and
one cap c for the whole batch is chosen to maximise the modelled throughput

    tokens(c) / (T(rows(c)) + draft(c)),   rows(c) = sum over sequences of min(want, c) + 1

where a sequence's expected tokens for k guesses come from its own acceptance estimates
(policy/adaptive_k.py), T is the target pass's measured cost by rows and draft(c) the draft
passes (one per guess depth, all sequences still drafting sharing it). The first of those
passes also feeds each drafting sequence's draft model what it has not seen yet (its lag:
the tokens kept since it last drafted; a sequence that just joined, its whole prompt). A
lag is paid once and serves every later round of the sequence, so a round is charged the
share of it that its expected tokens are of the sequence's remaining budget. c = 0 is plain
batched decoding, chosen when no speculation pays. The plan never changes which tokens are
emitted (verification decides that), only how many rounds they take.

A greedy tree is capped too: a tree of n nodes costs n rows of the shared pass, and under
load those rows are what the pass cannot afford. The plans as made (trees whole) are one
option, and each cap c another, where a capped tree becomes a chain of min(depth, c) guesses;
the choice is whichever models faster (a tree's tokens: what the engine's tree rounds have
emitted a round, at least its chain's estimate at its depth). Verification keeps a greedy answer the same either way.

A sampled sequence keeps its own planner's length and shape (it is not capped), and steps
its draft in passes of its own: its random draws then happen exactly as in its solo run, so
a seeded request gives the same text batched as alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from understudy.policy.costs import PassCurve


@dataclass(frozen=True)
class BatchCosts:
    target: PassCurve  # one target pass, by its rows (all sequences together)
    draft: PassCurve | None  # one draft step, by the sequences sharing it (None: free)

    def draft_seconds(self, lengths: list[int], first_rows: list[float]) -> float:
        """Draft passes for chains of these lengths, one pass per depth shared by all the
        chains that reach it; the first holds first_rows[i] rows of each drafting chain."""
        if self.draft is None or not lengths or max(lengths) == 0:
            return 0.0
        draft = self.draft
        first = sum(rows for k, rows in zip(lengths, first_rows, strict=True) if k > 0)
        return draft.seconds_at(first) + sum(
            draft.seconds_at(sum(1 for k in lengths if k >= depth))
            for depth in range(2, max(lengths) + 1)
        )


@dataclass(frozen=True)
class Wish:
    """One sequence's view of the round: its own planner's length (a tree's depth), whether
    it is capped (greedy sequences are), its expected tokens for k guesses, its draft model's
    lag (tokens to feed before it can guess; 0 for a drafter without a model), its remaining
    budget (0: unknown, the whole lag is this round's) and, for a tree, its nodes and its
    expected tokens whole."""

    want: int
    capped: bool
    expected_tokens: Callable[[int], float]
    lag: int = 0
    remaining: int = 0
    tree_rows: int = 0  # a tree's nodes, its rows in the pass (0: a chain)
    tree_tokens: float = 0.0  # a whole tree's expected tokens

    def rows(self, k: int, whole: bool) -> int:
        """Its guesses' rows in the pass at length k: a tree's nodes while it stays whole."""
        return self.tree_rows if whole and self.tree_rows else k

    def tokens(self, k: int, whole: bool) -> float:
        """Its expected tokens at length k: a tree's own while it stays whole."""
        return self.tree_tokens if whole and self.tree_rows else self.expected_tokens(k)

    def first_rows(self, k: int) -> float:
        """This sequence's rows in the round's first draft pass when it drafts k guesses:
        one, plus the round's share of the rest of its lag."""
        if self.lag <= 1 or k == 0:
            return 1.0
        share = 1.0 if self.remaining <= 0 else min(1.0, self.expected_tokens(k) / self.remaining)
        return 1.0 + (self.lag - 1) * share


def choose_cap(wishes: list[Wish], costs: BatchCosts) -> int | None:
    """The cap on capped sequences' lengths (a capped tree: a chain) maximising modelled
    tokens per second; None where the plans as made, trees whole, model faster than any cap
    (only a batch with a capped tree has that option apart from the top cap)."""
    top = max((w.want for w in wishes if w.capped), default=0)
    options: list[int | None] = [None] if any(w.capped and w.tree_rows for w in wishes) else []
    best_cap: int | None = 0
    best_rate = -1.0
    for cap in [*options, *range(top + 1)]:
        rate = _rate(wishes, costs, cap)
        if rate > best_rate * (1 + 1e-6):
            best_cap, best_rate = cap, rate
    return best_cap


def _rate(wishes: list[Wish], costs: BatchCosts, cap: int | None) -> float:
    """Modelled tokens per second of the round under `cap` (None: the plans as made)."""
    whole = [cap is None or not w.capped for w in wishes]  # trees kept whole
    lengths = [w.want if cap is None or not w.capped else min(w.want, cap) for w in wishes]
    tokens = sum(w.tokens(k, t) for w, k, t in zip(wishes, lengths, whole, strict=True))
    rows = sum(w.rows(k, t) for w, k, t in zip(wishes, lengths, whole, strict=True))
    seconds = costs.target.seconds_at(rows + len(wishes))
    shared = [(k, w.first_rows(k)) for w, k in zip(wishes, lengths, strict=True) if w.capped]
    seconds += costs.draft_seconds([k for k, _ in shared], [r for _, r in shared])
    for w, k in zip(wishes, lengths, strict=True):  # a sampled sequence steps its draft alone
        if not w.capped:
            seconds += costs.draft_seconds([k], [w.first_rows(k)])
    return tokens / max(seconds, 1e-9)
