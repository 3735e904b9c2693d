"""Each round's plan: how many guesses to draft, and whether they form a tree.

One object holds every choice the engine makes before it drafts, so the round itself only
carries out a plan. The plan never changes which tokens are emitted (verification decides
that), only how many rounds they take.

    K fixed (num_speculative_tokens=k)    every round drafts k guesses (or a depth-k tree)
    K "auto", a plain drafter             automatic K (policy/adaptive_k.py) picks each K
    K "auto", a drafter that stops on its own doubt
                                          automatic K only decides whether to draft at all;
                                          the drafter may then use the whole row budget
    K "auto", a drafter that plans its own length (hybrid)
                                          it gets the whole row budget as k every round
    tree "on" | "auto"                    a tree every round | where trees have paid
                                          (policy/tree_choice.py, learnt across requests)

A round never drafts more than the tokens still to emit, less the target's own token.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from understudy.config import TreeMode
from understudy.policy.adaptive_k import AdaptiveK
from understudy.policy.costs import Costs
from understudy.policy.tree_choice import TreeOrChain


@dataclass(frozen=True)
class Plan:
    k: int  # chain guesses, or a tree's depth; 0 = a plain target pass
    tree: bool
    nodes: int  # most nodes of a tree (its rows in the target pass)

    def capped(self, most: int) -> Plan:
        """A chain of at most `most` guesses (a batch's cap on greedy plans): a tree becomes
        the chain of its depth, capped."""
        return replace(self, k=min(self.k, most), tree=False)


@dataclass(frozen=True)
class PlanRules:
    """What every request's planner of one engine shares, fixed when it is built."""

    k: int | Literal["auto"]  # num_speculative_tokens: a fixed K, or "auto"
    rows: int  # the most rows of one sequence's target pass (the target's own token's too)
    tree_mode: TreeMode  # the drafter's: whether rounds may be trees
    costs: Costs  # measured at build
    plans_length: bool = False  # the drafter plans its own length (hybrid): k = the budget
    stops_by_confidence: bool = False  # a chain round ends on the drafter's own doubt

    def chains_only(self) -> PlanRules:
        """The same rules for a request whose rounds must be chains (a logits processor)."""
        return replace(self, tree_mode="off")


class RoundPlanner:
    """The plans of one request's rounds (a fresh one per request: determinism)."""

    def __init__(self, rules: PlanRules, shapes: TreeOrChain | None = None) -> None:
        self.k = rules.k
        self.k_max = rules.rows - 1  # the target's own token takes one row of the pass
        self.tree_mode = rules.tree_mode
        self.stops_by_confidence = rules.stops_by_confidence
        # tree="auto": which shape pays, shared across the engine's requests
        self.shapes = shapes if rules.tree_mode == "auto" else None
        automatic = rules.k == "auto" and not rules.plans_length
        self.adaptive = AdaptiveK(self.k_max, rules.costs) if automatic else None

    def plan(self, remaining: int) -> Plan:
        tree = self.tree_mode == "on" or (self.shapes is not None and self.shapes.choose())
        if self.adaptive is None:
            k = self.k_max if self.k == "auto" else int(self.k)
        else:  # a tree's depth plays K's part; a chain stopping on doubt gets the budget
            k = self.adaptive.choose()
            if k and self.stops_by_confidence and not tree:
                k = self.k_max
        return Plan(min(k, remaining - 1), tree, self.k_max)

    def expected_tokens(self, k: int) -> float:
        """Modelled tokens a chain round of k guesses yields (automatic K's estimates; with
        K fixed, the prior's)."""
        return self.expected_tokens_upto(k)[k]

    def expected_tokens_upto(self, k: int) -> list[float]:
        """[expected_tokens(0), ..., expected_tokens(k)], in one sweep."""
        if self.adaptive is None:
            return AdaptiveK(max(self.k_max, k, 1), Costs()).expected_tokens_upto(k)
        return self.adaptive.expected_tokens_upto(k)

    def expected_tree_tokens(self, depth: int) -> float:
        """Modelled tokens of a tree round of this depth: what this engine's tree rounds have
        emitted a round, and at least the estimate for a chain of that depth."""
        chain = self.expected_tokens(depth)
        return max(chain, self.shapes.tokens_per_round(True)) if self.shapes else chain

    def observe(self, tree: bool, drafted: int, accepted: int, depth: int) -> None:
        """A verified round: a tree or a chain of `drafted` guesses (nodes), `accepted` of
        them kept, `depth` its depth (a chain's is its length)."""
        if self.adaptive is not None:
            self.adaptive.observe(depth, accepted)
        if self.shapes is not None and drafted:
            self.shapes.observe(tree, accepted + 1, drafted, depth)
