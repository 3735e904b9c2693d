"""tree="auto": each round, draft a tree or a chain, whichever has yielded more per cost.

A tree adds accepted length over a chain of the same depth (siblings catch some of the
chain's misses), but it costs more: every node is a row of the target's pass, and on the
row-invariant CPU path a tree pass also gathers each node's keys (models/runner.py); the measured
answer differs by machine (docs/design.md, section 6: slower on a 2-core CPU's float32
path). So the engine keeps, over its requests, the tokens each shape has emitted per round
and what its rounds cost in target passes, with the costs measured when the engine was
built:

    chain round: 1 + rows * v      + draft passes * c
    tree round:  1 + nodes * v_tree + depth * c

(v: one more row of a chain pass, v_tree: one more node of a tree pass, c: a draft pass; all
as fractions of a 1-row target pass; measured on the default pair, a depth-8 tree of 15
nodes took 0.90 + 1.49 passes against 0.88 + 1.64 modelled). `choose()` tries each shape
MIN_TRIES times, then picks the one with the higher decayed tokens-per-cost rate, and
retries the losing shape every PROBE_EVERY rounds so its estimate can recover; every
FAR_FACTOR x PROBE_EVERY rounds while its rate is under FAR of the winner's (measured with
method="eagle" on padded bf16 passes: trees 2.2-2.9 tokens per modelled pass against
chains 1.5-2.1, yet one round in 8 went to a chain).

Why across requests: a 64-token request is often under 10 rounds, too few to learn which
shape pays (measured: learning afresh per request, tree="auto" spent most rounds on trees
after one unlucky chain round and ran 9% slower than chains alone over 12 prompts).
Consequence, as with the suffix drafter's cross-request cache: a seeded sampled output can
depend on the requests the engine served before (its law is the target's all the same);
greedy output never changes. Lossless: each round is verified exactly whatever its shape
(verify/chain.py, verify/tree.py), and the choice reads only verified history.
"""

from __future__ import annotations

from understudy.policy.costs import Costs


class TreeOrChain:
    MIN_TRIES = 3  # rounds of each shape before the rates decide
    PROBE_EVERY = 8  # rounds between tries of the shape that is losing
    FAR = 0.8  # a loser whose rate is under this fraction of the winner's ...
    FAR_FACTOR = 4  # ... is tried this many times less often
    DECAY = 0.95  # older rounds of a shape count less

    def __init__(self, costs: Costs) -> None:
        self.c = costs.draft_step
        self.v = costs.row
        self.v_tree = costs.tree_node
        self.tokens = {False: 0.0, True: 0.0}  # decayed tokens emitted, per shape (True: tree)
        self.cost = {False: 0.0, True: 0.0}  # decayed modelled cost, per shape
        self.tries = {False: 0, True: 0}  # rounds observed, per shape
        self.rounds = {False: 0.0, True: 0.0}  # decayed rounds, per shape
        self.rounds_since_probe = 0

    def rate(self, tree: bool) -> float:
        """Tokens per target-pass-equivalent of this shape's rounds so far (0: untried)."""
        return self.tokens[tree] / self.cost[tree] if self.cost[tree] else 0.0

    def tokens_per_round(self, tree: bool) -> float:
        """Tokens a round of this shape has emitted, decayed as its rate (0: untried)."""
        return self.tokens[tree] / self.rounds[tree] if self.rounds[tree] else 0.0

    def choose(self) -> bool:
        """True: draft this round as a tree; False: as a chain."""
        if min(self.tries.values()) < self.MIN_TRIES:  # alternate, a chain first
            return self.tries[False] > self.tries[True]
        best = self.rate(True) > self.rate(False)
        far = self.rate(not best) < self.FAR * self.rate(best)
        self.rounds_since_probe += 1
        if self.rounds_since_probe >= self.PROBE_EVERY * (self.FAR_FACTOR if far else 1):
            self.rounds_since_probe = 0
            return not best
        return best

    def round_cost(self, tree: bool, rows: int, draft_passes: int) -> float:
        """A round's modelled cost in target passes: `rows` guessed rows (chain) or nodes
        (tree), `draft_passes` draft passes (chain: its guesses; tree: its depth)."""
        if rows == 0:
            return 1.0
        return 1.0 + rows * (self.v_tree if tree else self.v) + draft_passes * self.c

    def observe(self, tree: bool, emitted: int, rows: int, draft_passes: int) -> None:
        """A verified round of this shape emitted `emitted` tokens (kept guesses + 1)."""
        self.tries[tree] += 1
        self.rounds[tree] = self.rounds[tree] * self.DECAY + 1
        self.tokens[tree] = self.tokens[tree] * self.DECAY + emitted
        self.cost[tree] = self.cost[tree] * self.DECAY + self.round_cost(tree, rows, draft_passes)
