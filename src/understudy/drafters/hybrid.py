"""method="hybrid": a free drafter (suffix trie or n-gram lookup) and the draft model, per round.

Each round the free drafter offers guesses g_1..g_f from a match of length m; then one of
these plans runs (all deterministic given the text and the rounds so far):
- free:  g_1..g_f alone, at no draft cost;
- model: the draft model guesses K tokens (K * c of a target pass, c = draft/target cost);
- mixed: g_1..g_j, then the draft model extends them by K tokens (a short match extended);
- none:  a plain target pass.
The plan maximises expected tokens per unit of cost, E / (K * c + T(j + K)) (Leviathan et
al. 2023, Thm 3.8, with T(n) the cost of a target pass checking n guesses: the engine's
measured pass curve on unpadded passes, else 1 + n * v, v = 0 with padded passes; c measured
at build, then followed from the
rounds' own wall times, LiveCostRatio), with E = 1 + sum_i P(guesses 1..i all accepted) from
running acceptance estimates:
one per match-length bucket for free guesses, one per position for model guesses (the
estimator of automatic K, adaptive.AdaptiveK, so unseen positions borrow the deepest seen
one and K can grow), learnt from the verifier's verdicts (seen in `commit`), starting from
priors at every request. So a free draft is used when its match is confident enough to beat
the model, and hybrid is never expected to be slower than the better of its parts.

Hybrid plans its own round length (`plans_length`): with num_speculative_tokens="auto" the
engine hands it the whole row budget as k, not automatic K's choice, which would be learnt
from a mix of free and model rounds. The plan decides whether the model drafts; when the
draft model stops on its own doubt (draft_path_confidence, on under automatic K) it then
drafts up to the rest of the budget, as under method="draft", and its length is its own. After PROBE_EVERY plain rounds in a row it drafts one
model guess, so its estimates can recover.

Verification stays exact: free guesses are deterministic (q = one-hot), model guesses carry
their q. A mixed proposal's q is [j + K, vocab]: one-hot rows for g_1..g_j (exactly what
q = None means) and the model's rows after them. Greedy: q = None throughout.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

import torch

from understudy.config import SamplingParams, UnderstudyError
from understudy.drafters.base import DRAFTERS, Drafter, Proposal, Traits, register, take_options
from understudy.drafters.draft_model import DraftModelProposer
from understudy.drafters.ngram import NgramProposer
from understudy.drafters.suffix import SuffixProposer
from understudy.measure.live import LiveCostRatio
from understudy.models.loader import LoadedModel
from understudy.models.runner import Runner
from understudy.policy.adaptive_k import AdaptiveK
from understudy.policy.costs import Costs

FREE_METHODS = ("suffix", "ngram")
FREE_PRIOR = (0.2, 0.4, 0.6, 0.75, 0.85)  # P(free guess accepted) by bucket: m 1, 2-3, 4-7, ...
# the free estimates learn as automatic K's do (policy/adaptive_k.py): the same prior weight,
# decay per round and probing period (plain rounds in a row before one model guess)
PRIOR_WEIGHT = AdaptiveK.PRIOR_WEIGHT
DECAY = AdaptiveK.DECAY
PROBE_EVERY = AdaptiveK.PROBE_EVERY
MAX_MODEL_GUESSES = 64
CATCH_UP_ROUNDS = 8  # model rounds a catch-up is charged over (~ a 64-token request's rounds)


class FreeDrafter(Protocol):
    """What hybrid needs of a free drafter (NgramProposer, SuffixProposer)."""

    def begin(self, prompt_ids: list[int]) -> None: ...

    def draft(self, tokens: list[int], k: int) -> tuple[list[int], int]:
        """Up to k guesses for what follows `tokens`, and the length of their match."""
        ...

    def commit(self, tokens: list[int]) -> None: ...

    def for_seat(self, index: int) -> FreeDrafter: ...


def bucket(match_len: int) -> int:
    """Match lengths 1 | 2-3 | 4-7 | 8-15 | 16+ -> 0..4."""
    return min(max(match_len, 1).bit_length(), len(FREE_PRIOR)) - 1


class FreeAcceptance:
    """P(a free guess is kept | the guesses before it were), per match-length bucket: the
    prior FREE_PRIOR at PRIOR_WEIGHT guesses, then the verdicts, each round's estimate
    decayed by DECAY (hybrid's and free-first drafting's, drafters/free_first.py)."""

    def __init__(self) -> None:
        self.hits = [p * PRIOR_WEIGHT for p in FREE_PRIOR]
        self.tries = [PRIOR_WEIGHT] * len(FREE_PRIOR)

    def alpha(self, match_len: int) -> float:
        b = bucket(match_len)
        return self.hits[b] / self.tries[b]

    def observe(self, b: int, offered: int, kept: int) -> None:
        """A round drafted `offered` free guesses of bucket b and `kept` of them were kept:
        the kept ones count as hits, the first rejected one (if reached) as a miss."""
        self.hits[b] *= DECAY
        self.tries[b] *= DECAY
        for i in range(min(offered, kept + 1)):
            self.tries[b] += 1.0
            self.hits[b] += 1.0 if i < kept else 0.0


def mixed_q(free: torch.Tensor, model_q: torch.Tensor) -> torch.Tensor:
    """q of a mixed proposal: one-hot rows for the free guesses free [j] (what q = None
    means), then the draft model's rows model_q [K, vocab]. Returns [j + K, vocab]."""
    j = free.shape[0]
    full = model_q.new_zeros(j + model_q.shape[0], model_q.shape[1])  # [j + K, vocab]
    full[torch.arange(j), free] = 1.0
    full[j:] = model_q
    return full


@register("hybrid")
class HybridProposer(Drafter):
    """Options: hybrid_free ("suffix" | "ngram", default "suffix"), hybrid_cost_ratio (c;
    default: measured when the engine is built); the free drafter's own options pass through
    (suffix_decoding_*, prompt_lookup_*)."""

    traits = Traits(needs_draft_model=True, plans_length=True)  # k: the row budget

    @classmethod
    def from_models(
        cls, target: LoadedModel, draft: LoadedModel | None, max_context: int, **options: object
    ) -> HybridProposer:
        own = {name: options.pop(name) for name in list(options) if name.startswith("hybrid_")}
        opts = take_options("hybrid", own, {"hybrid_free": "suffix", "hybrid_cost_ratio": None})
        free_method = opts["hybrid_free"]
        if free_method not in FREE_METHODS:
            raise UnderstudyError(
                f"hybrid_free must be one of {', '.join(FREE_METHODS)}, got {free_method!r}"
            )
        free = DRAFTERS[free_method].from_models(target, None, max_context, **options)
        assert isinstance(free, NgramProposer | SuffixProposer)  # what FREE_METHODS name
        model = DraftModelProposer.from_models(target, draft, max_context)
        cost = opts["hybrid_cost_ratio"]
        if cost is None:  # measured by the builder (settle), then learnt from the rounds
            return cls(free, model, 0.0, learn_cost=True)
        return cls(free, model, cost)

    def __init__(
        self,
        free: FreeDrafter,
        model: DraftModelProposer,
        cost_ratio: float,
        learn_cost: bool = False,
        catch_up_ratio: float = 0.0,
    ) -> None:
        if isinstance(cost_ratio, bool) or not isinstance(cost_ratio, int | float):
            raise UnderstudyError(f"hybrid_cost_ratio must be a number >= 0, got {cost_ratio!r}")
        if cost_ratio < 0:
            raise UnderstudyError(f"hybrid_cost_ratio must be >= 0, got {cost_ratio}")
        self.free = free
        self.model = model  # not exposed as `.runner`: the engine's K stays the row budget
        self.cost_ratio = float(cost_ratio)
        # learn_cost: c follows the rounds' wall times (LiveCostRatio), else stays cost_ratio
        self.live_cost = LiveCostRatio(self.cost_ratio) if learn_cost else None
        self._proposed_at: float | None = None  # when propose() returned: the pass starts
        # a model round first feeds the draft every token it has not seen (after free rounds,
        # the whole prompt on its first use): catch_up_ratio target passes per token, shared
        # among the CATCH_UP_ROUNDS model rounds it serves
        self.catch_up_ratio = float(catch_up_ratio)
        self.costs = Costs()  # v and the pass curve, measured by the builder (settle)
        self.plans = {"free": 0, "model": 0, "mixed": 0, "none": 0}  # rounds, all requests
        self._reset_estimates()
        self._last: tuple[int, list[int], int, int, int] | None = None  # the round's plan
        self.prompt_length = 0  # the request's (begin)

    def draft_runner(self) -> Runner:
        return self.model.runner

    def timed_step(self) -> Callable[[], None] | None:
        return self.model.timed_step()

    def settle(self, costs: Costs, automatic_k: bool) -> None:
        """c (unless hybrid_cost_ratio fixed it), the catch-up cost and v, as measured; the
        draft model's doubt rules settled alike. c is followed from the rounds' wall times
        (LiveCostRatio) only on padded passes, where the build's one-step timing underrates
        it; where the pass curve was measured (unpadded passes, timed in sweeps), c stays
        the build's, as the draft method's floors do: one slow round would weigh a third of
        the live estimate, and plans that then leave the model out price it ever higher,
        since each round it sits out adds to the catch-up it must make."""
        if self.live_cost is not None:
            self.cost_ratio = costs.draft_step
            self.live_cost = None if costs.pass_curve else LiveCostRatio(costs.draft_step)
            self.catch_up_ratio = costs.catch_up
        self.costs = costs
        self.model.settle(costs, automatic_k)

    def for_seat(self, index: int) -> HybridProposer:
        """Its own free drafter's request state (a suffix cache across requests stays
        shared) and its own region of the draft model's cache; the same costs."""
        seat = HybridProposer(self.free.for_seat(index), self.model.for_seat(index),
                              self.cost_ratio, catch_up_ratio=self.catch_up_ratio)  # fmt: skip
        seat.costs = self.costs
        seat.live_cost = None if self.live_cost is None else LiveCostRatio(self.cost_ratio)
        return seat

    def _reset_estimates(self) -> None:
        self.free_estimate = FreeAcceptance()
        # P(model guess i accepted | the guesses before it were): only its estimates are used
        costs = replace(self.costs, draft_step=self.cost_ratio)
        self.model_estimate = AdaptiveK(MAX_MODEL_GUESSES, costs)
        self.plain_rounds = 0

    def pass_cost(self, guesses: int) -> float:
        """A target pass checking `guesses` guesses, in 1-row passes (Costs.pass_cost)."""
        return self.costs.pass_cost(guesses)

    def _model_accept(self, i: int) -> float:
        """P(model guess i accepted | the guesses before it were)."""
        return self.model_estimate.acceptance(i)

    def choose_mix(self, k: int, free_len: int, match_len: int, unseen: int = 0) -> tuple[int, int]:
        """(j, K): use the first j free guesses, then K model guesses, for the most expected
        tokens per unit of cost; (0, 0) (a plain pass) unless some plan beats it. `unseen`:
        tokens the draft model must catch up on before it guesses."""
        alpha = self.free_estimate.alpha(match_len)
        c = self.cost_ratio if self.live_cost is None else self.live_cost.value
        model_gain = [0.0]  # model_gain[K] = sum_{i<=K} prod_{t<=i} a_t
        reach = 1.0
        for i in range(k):
            reach *= self._model_accept(i)
            model_gain.append(model_gain[-1] + reach)
        best_rate, best = 1.0, (0, 0)
        free_gain, free_reach = 0.0, 1.0
        for j in range(free_len + 1):
            if j:
                free_reach *= alpha
                free_gain += free_reach
            for n_model in range(k - j + 1):
                cost = n_model * c + self.pass_cost(j + n_model)
                if n_model:
                    cost += unseen * self.catch_up_ratio / CATCH_UP_ROUNDS
                rate = (1.0 + free_gain + free_reach * model_gain[n_model]) / cost
                if rate > best_rate + 1e-12 and (j or n_model):
                    best_rate, best = rate, (j, n_model)
        return best

    def begin(self, prompt_ids: list[int]) -> None:
        self._proposed_at = None  # c's live estimate carries over between requests
        self.free.begin(prompt_ids)
        self.model.begin(prompt_ids)
        self.prompt_length = len(prompt_ids)
        self._reset_estimates()
        self._last = None

    def propose(
        self, tokens: list[int], k: int, params: SamplingParams, generator: torch.Generator
    ) -> Proposal:
        guesses, match_len = self.free.draft(tokens, k)
        # the prompt is read by the model's first round whatever the plans (as the draft
        # method's is), so the plans price only the generated tokens the draft has not seen:
        # priced, a long prompt's catch-up kept the model out of the first rounds, and every
        # free or plain round after them added to it
        unseen = len(tokens) - max(len(self.model.fed), self.prompt_length)
        j, n_model = self.choose_mix(min(k, MAX_MODEL_GUESSES), len(guesses), match_len, unseen)
        self.plain_rounds = self.plain_rounds + 1 if j == n_model == 0 else 0
        if self.plain_rounds >= PROBE_EVERY and k > 0:
            self.plain_rounds, n_model = 0, 1  # a probe: let the model estimates recover
        free = torch.tensor(guesses[:j], dtype=torch.long)  # [j]
        if n_model == 0:
            self.plans["free" if j else "none"] += 1
            proposal = Proposal(free, None)  # q = one-hot
        else:
            self.plans["mixed" if j else "model"] += 1
            context = tokens + guesses[:j] if j else tokens
            if self.model.stops_by_confidence:  # as method="draft": until doubt
                n_model = k - j
            self.model.catch_up(context)  # priced apart (catch_up_ratio): not timed
            started = time.perf_counter()
            extended = self.model.propose(context, n_model, params, generator)
            if self.live_cost is not None:
                self.live_cost.observe_draft(time.perf_counter() - started, extended.size)
            q = extended.draft_probs  # [K, vocab], or None (greedy)
            ids = torch.cat([free, extended.draft_ids])  # [j + K]
            if q is not None and j:
                q = mixed_q(free, q)
            proposal = Proposal(ids, q)
            n_model = extended.size  # fewer when the draft stopped on its own doubt
        self._last = (len(tokens), proposal.draft_ids.tolist(), j, n_model, bucket(match_len))
        self._proposed_at = time.perf_counter()
        return proposal

    def commit(self, tokens: list[int]) -> None:
        if self.live_cost is not None and self._proposed_at is not None:
            guesses = 0 if self._last is None else len(self._last[1])
            seconds = time.perf_counter() - self._proposed_at
            self.live_cost.observe_pass(seconds / self.pass_cost(guesses))  # a one-row pass's
        self._proposed_at = None
        if self._last is not None:
            self._observe(tokens, *self._last)
            self._last = None
        self.free.commit(tokens)
        self.model.commit(tokens)

    def _observe(
        self, tokens: list[int], start: int, ids: list[int], j: int, n_model: int, b: int
    ) -> None:
        """Learn from the verdict: how many of the proposed ids the sequence now starts with."""
        accepted = 0
        while (
            accepted < len(ids)
            and start + accepted < len(tokens)
            and tokens[start + accepted] == ids[accepted]
        ):
            accepted += 1
        if j:
            self.free_estimate.observe(b, j, accepted)
        if n_model and accepted >= j:  # the model's guesses were reached
            self.model_estimate.observe(n_model, accepted - j)
