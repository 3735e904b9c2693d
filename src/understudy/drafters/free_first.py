"""Free guesses first: a round of a model drafter drafted from the text itself, where that pays.

Editing, summarising and answers that quote their context repeat runs of tokens already in
the text. A suffix trie (or n-gram lookup) finds such a run at no draft cost; a trained head
guesses it one token at a time, at c of a target pass a guess, and keeps fewer of it. So each
round, before the head drafts, the free drafter (drafters/suffix.py, drafters/ngram.py)
offers guesses g_1..g_f from a match of length m, and the round takes the first j of them
instead of the head's when their modelled rate beats the head's measured one:

    free rate   max over j of (1 + a + a^2 + ... + a^j) / T(j + 1)
                a: P(a free guess is kept | the bucket of m), learnt per request from the
                verdicts, from the priors of method="hybrid" (drafters/hybrid.py)
    head rate   tokens the head's own rounds emitted / their modelled cost, steps * c +
                T(rows + 1), decayed, learnt per request from a prior

(T: the engine's measured pass curve, policy/costs.py). The idea is SAM-decoding's (Hu et
al. 2024: a suffix automaton's drafts beside EAGLE's); the rule is ours.

Guesses declined teach `a` too: after the head's round, the guesses the round declined are
compared with the tokens it emitted, up to as many as it emitted. A free guess is one-hot, so
it is kept with probability p(guess), and the emitted token is the target's own draw at that
position: it equals the guess with that same probability (greedy: exactly when it would have
been kept). Without this, a head that wins most rounds leaves `a` at what the few free
rounds taken said, and a request never learns that its text repeats.

Lossless: free guesses are deterministic (q = one-hot) and verified like any chain; the
choice reads only verified history, and only the request's own (with "ngram"; "suffix" also
reads earlier requests' text): a seeded answer is the same whenever it is asked. A free round's Proposal says so (`free`), and the
round planner (automatic K, tree or chain) learns only from the head's own rounds.
"""

from __future__ import annotations

from typing import Literal, Protocol

from understudy.config import UnderstudyError
from understudy.drafters.hybrid import DECAY, FreeAcceptance, bucket
from understudy.drafters.ngram import NgramProposer
from understudy.drafters.suffix import SuffixProposer
from understudy.policy.costs import Costs

FreeKind = Literal["off", "suffix", "ngram"]
FREE_KINDS: tuple[FreeKind, ...] = ("off", "suffix", "ngram")
# the head's rate before it has drafted a round: tokens a pass-equivalent, weighed as one round
# (between a plain pass's 1 and the 2-2.6 tokens a pass the shipped head's rounds keep)
HEAD_PRIOR_RATE = 1.5


class FreeDrafter(Protocol):
    """What free-first drafting needs of a free drafter (NgramProposer, SuffixProposer)."""

    def begin(self, prompt_ids: list[int]) -> None: ...

    def draft(self, tokens: list[int], k: int) -> tuple[list[int], int]:
        """Up to k guesses for what follows `tokens`, and the length of their match."""
        ...

    def commit(self, tokens: list[int]) -> None: ...

    def for_seat(self, index: int) -> FreeDrafter: ...


def free_drafter(kind: FreeKind) -> FreeDrafter | None:
    """The free drafter `kind` names, with its method's defaults (None for "off")."""
    if kind not in FREE_KINDS:
        raise UnderstudyError(f"free_drafts must be one of {', '.join(FREE_KINDS)}, got {kind!r}")
    if kind == "suffix":
        return SuffixProposer()
    if kind == "ngram":
        return NgramProposer()
    return None


class FreeFirst:
    """The free drafter, what its guesses and the head's rounds have yielded, and the choice
    between them (module docstring). Call order per request: begin, then each round `offer`
    (and `head_round` when the head drafted instead), then `commit`."""

    def __init__(self, free: FreeDrafter, costs: Costs | None = None) -> None:
        self.free = free
        self.costs = costs or Costs()
        self.rounds = {"free": 0, "head": 0}  # rounds of each kind, all requests
        self._reset_estimates()
        # the round awaiting its verdict: free (start, guesses, bucket) or the head's
        # (start, modelled cost, the free guesses it declined, their bucket); at most one
        self._free_round: tuple[int, int, int] | None = None
        self._head_round: tuple[int, float, list[int], int] | None = None
        self._declined: tuple[list[int], int] = ([], 0)  # this round's offer, if declined

    def settle(self, costs: Costs) -> None:
        self.costs = costs

    def for_seat(self, index: int) -> FreeFirst:
        """Its own free drafter's request state (a suffix cache across requests stays
        shared) and the same costs."""
        return FreeFirst(self.free.for_seat(index), self.costs)

    def _reset_estimates(self) -> None:
        self.estimate = FreeAcceptance()
        self.head_tokens = HEAD_PRIOR_RATE  # decayed tokens the head's rounds emitted
        self.head_cost = 1.0  # decayed modelled cost of those rounds, in target passes

    def begin(self, prompt_ids: list[int]) -> None:
        self.free.begin(prompt_ids)
        self._reset_estimates()
        self._free_round = self._head_round = None
        self._declined = ([], 0)

    def head_rate(self) -> float:
        """Tokens a target-pass-equivalent of the head's rounds (decayed, with its prior)."""
        return self.head_tokens / self.head_cost

    def best_free(self, guesses: int, match_len: int) -> tuple[int, float]:
        """(j, rate): how many of `guesses` free guesses to draft for the most tokens a
        pass-equivalent, and that rate (j = 0: none, the rate of a plain pass)."""
        alpha = self.estimate.alpha(match_len)
        best, best_rate = 0, 1.0
        gain, reach = 1.0, 1.0
        for j in range(1, guesses + 1):
            reach *= alpha
            gain += reach
            rate = gain / self.costs.pass_cost(j)
            if rate > best_rate:
                best, best_rate = j, rate
        return best, best_rate

    def offer(self, tokens: list[int], k: int) -> list[int]:
        """The free guesses this round drafts instead of the head's (empty: the head drafts,
        then `head_round` says what it drafted)."""
        guesses, match_len = self.free.draft(tokens, k)
        j, rate = self.best_free(len(guesses), match_len)
        self._free_round = self._head_round = None
        if j and rate > self.head_rate():
            self._free_round = (len(tokens), j, bucket(match_len))
            self.rounds["free"] += 1
            self._declined = ([], 0)
            return guesses[:j]
        self._declined = (guesses, bucket(match_len))
        return []

    def head_round(self, tokens: list[int], rows: int, steps: int) -> None:
        """The head drafted this round: `rows` guesses (a tree's nodes) in `steps` steps."""
        cost = steps * self.costs.draft_step + self.costs.pass_cost(rows)
        self._head_round = (len(tokens), cost, *self._declined)
        self._declined = ([], 0)
        self.rounds["head"] += 1

    def commit(self, tokens: list[int]) -> None:
        """The round's verdict (`tokens`: the sequence as it now stands): learn from it."""
        self.free.commit(tokens)
        if self._head_round is not None:
            start, cost, declined, b = self._head_round
            emitted = tokens[start:]  # the kept guesses and the target's own token
            self.head_tokens = self.head_tokens * DECAY + len(emitted)
            self.head_cost = self.head_cost * DECAY + cost
            seen = min(len(declined), len(emitted))  # guesses whose verdict the text gives
            if seen:
                kept = next((i for i in range(seen) if declined[i] != emitted[i]), seen)
                self.estimate.observe(b, seen, kept)
        if self._free_round is not None:
            start, offered, b = self._free_round
            self.estimate.observe(b, offered, len(tokens) - start - 1)
        self._free_round = self._head_round = None
