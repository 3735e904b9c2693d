"""One interface for every drafter: every hook the engine and the builder call, declared here.

Proposing is separate from verifying. A drafter sees the request's tokens so far (prompt +
generated; the last one not yet scored by the target) and returns up to k guesses, with the
distribution each was drawn from (q, after the same warping as the target's p) or None when
the guesses are deterministic (q = one-hot). After the verifier has spoken, `commit` tells it
which tokens really follow, so it can roll back whatever state it keeps.

What a drafter IS is declared once, in its class's `traits` (the builder and the planner
read them; nothing probes a drafter). What it DOES are the hooks below, each with a one-line
contract; every optional hook has a default body (as llama.cpp's common/speculative.h
declares its drafter's), so the engine calls each one unconditionally. The order of calls:

    settle(costs, automatic_k)                          # once, when the engine is built
    for_seat(i)                                          # once per extra seat of a batch
    per request:  begin(prompt_ids)
                  observe_hidden(prompt's hidden, 0)     # only with traits.wants_hidden
                  repeat:  propose_batch([...]) -> propose / propose_tree per sequence
                           observe_hidden(kept rows' hidden, start)   # wants_hidden
                           commit(tokens)                # not after the last round
                  end(tokens)

Drafter classes register themselves in DRAFTERS by method name; the builder looks the class
up once, when the engine is built, never in the decode loop.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from understudy.config import SamplingParams, TreeMode, UnderstudyError
from understudy.measure.passes import runner_step

if TYPE_CHECKING:
    from understudy.models.loader import LoadedModel
    from understudy.models.runner import Runner
    from understudy.policy.costs import Costs


@dataclass(frozen=True)
class Traits:
    """What a kind of drafter is, declared on its class."""

    needs_draft_model: bool = False  # the builder loads a draft model and passes it in
    draft_names_head: bool = False  # `draft=DIR` names a trained head's folder (eagle)
    # it decides its own round length (hybrid): with automatic K the engine hands it the
    # whole row budget as k instead of automatic K's choice
    plans_length: bool = False
    wants_hidden: bool = False  # the engine feeds it the target's hidden states
    batches: bool = True  # `for_seat` works: it runs in a batched engine


@dataclass
class Proposal:
    draft_ids: torch.Tensor  # [k'] int64, k' <= k (may be 0: nothing worth guessing)
    draft_probs: torch.Tensor | None  # [k', vocab] float32 q, or None for q = one-hot
    # A token tree (verify/token_tree.py) instead of a chain: [k'] int64, draft i follows
    # draft parents[i] (-1 = the last committed token), parents[i] < i; a chain is
    # parents[i] = i - 1. Tree drafts are deterministic (draft_probs is None): siblings are
    # verified one by one.
    parents: torch.Tensor | None = None
    # guesses read off the text itself in place of the drafter's own (drafters/free_first.py):
    # the round planner learns only from the drafter's rounds
    free: bool = False

    @property
    def size(self) -> int:
        return int(self.draft_ids.shape[0])


EMPTY = Proposal(torch.zeros(0, dtype=torch.long), None)


@dataclass(frozen=True)
class DraftRequest:
    """One sequence's part of a round's drafting (Drafter.propose_batch): up to k guesses
    after `tokens` by its own drafter, as a chain or, with `tree`, a tree of at most `nodes`
    nodes and depth k; with its own sampling parameters and generator."""

    drafter: Drafter
    tokens: list[int]
    k: int
    params: SamplingParams
    generator: torch.Generator
    tree: bool = False
    nodes: int = 0


class Drafter:
    """The base of every drafter. Subclasses implement `from_models` and `propose`; every
    other hook's default body is what a drafter without that ability should do."""

    traits: Traits = Traits()  # of the class; an instance may narrow it (batches)
    tree: TreeMode = "off"  # an option of the instance: whether its rounds may be trees

    @classmethod
    def from_models(
        cls,
        target: LoadedModel,
        draft: LoadedModel | None,
        max_context: int,
        **options: object,
    ) -> Drafter:
        """Build the drafter for `target` (and `draft`, when it needs a draft model).
        Unknown options are refused with their names (`take_options`)."""
        raise NotImplementedError

    def settle(self, costs: Costs, automatic_k: bool) -> None:
        """Take the costs measured at build, and settle options left at "auto" now that the
        engine knows whether K is automatic."""

    def for_seat(self, index: int) -> Drafter:
        """A drafter of this kind for seat `index` (>= 1) of a batched engine: its own
        per-request state (and, with a draft model, its own region of the draft's KV cache),
        sharing what is shared across requests (weights, a cache of outputs)."""
        raise UnderstudyError(f"{type(self).__name__} does not run in a batch (max_num_seqs > 1)")

    def begin(self, prompt_ids: list[int]) -> None:
        """A new request starts with these prompt tokens."""

    def observe_hidden(self, hidden: torch.Tensor, start: int) -> None:
        """The target's hidden states [n, hidden] of positions start..start+n-1 (only called
        with traits.wants_hidden)."""

    def propose(
        self, tokens: list[int], k: int, params: SamplingParams, generator: torch.Generator
    ) -> Proposal:
        """Guess up to k tokens that follow `tokens`."""
        raise NotImplementedError

    def propose_tree(
        self,
        tokens: list[int],
        depth: int,
        nodes: int,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> Proposal:
        """A token tree of at most `nodes` nodes and `depth` levels after `tokens` (a
        Proposal with parents). Called only when `tree` is not "off"."""
        raise UnderstudyError(f"{type(self).__name__} cannot draft trees")

    @classmethod
    def propose_batch(cls, requests: list[DraftRequest]) -> list[Proposal]:
        """Every sequence's proposal of a round, each exactly what its drafter's propose or
        propose_tree returns alone. The default drafts one after another; a drafter with a
        model steps its chains in shared passes."""
        return [propose_one(r) for r in requests]

    def commit(self, tokens: list[int]) -> None:
        """The round is over: `tokens` is the sequence as it now stands."""

    def end(self, tokens: list[int]) -> None:
        """The request is over with these tokens (e.g. a cache across requests learns them)."""

    @property
    def stops_by_confidence(self) -> bool:
        """Whether a chain round ends on the drafter's own doubt (then automatic K only
        decides whether to draft at all, and the drafter how far)."""
        return False

    def quantize(self, scheme: str) -> None:
        """Quantize a network the drafter holds itself (draft_quantization); a draft model
        is quantized by the builder before it gets here."""

    def draft_runner(self) -> Runner | None:
        """The runner of the draft model whose step is this drafter's cost, if any."""
        return None

    def timed_step(self) -> Callable[[], None] | None:
        """One drafting step (one guess) for understudy/measure/ to time, leaving the
        drafter as it was; None when a guess costs nothing. Default: a one-token pass of
        the draft model."""
        runner = self.draft_runner()
        return None if runner is None else runner_step(runner)


def propose_one(request: DraftRequest) -> Proposal:
    """One sequence's proposal by its own drafter: a tree or a chain, as planned."""
    r = request
    if r.k <= 0:
        return EMPTY
    if r.tree:
        return r.drafter.propose_tree(r.tokens, r.k, r.nodes, r.params, r.generator)
    return r.drafter.propose(r.tokens, r.k, r.params, r.generator)


DRAFTERS: dict[str, type[Drafter]] = {}


def register(method: str) -> Callable[[type[Drafter]], type[Drafter]]:
    """Class decorator: make a drafter available as Engine method `method`."""

    def wrap(cls: type[Drafter]) -> type[Drafter]:
        DRAFTERS[method] = cls
        return cls

    return wrap


def take_options(
    method: str, options: Mapping[str, object], defaults: Mapping[str, object]
) -> dict[str, Any]:
    """`defaults` updated with `options`; an option not in `defaults` is an error (fail early:
    a misspelt option silently ignored would quietly benchmark the wrong configuration).
    The values are Any: the caller's, unchecked, each validated by the drafter that takes it
    (its constructor, positive_int, threshold), which refuses a value of the wrong type."""
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        raise UnderstudyError(
            f"method {method!r} does not take option(s) {', '.join(unknown)}; "
            f"it takes {', '.join(sorted(defaults)) or 'none'}"
        )
    return {**defaults, **{k: v for k, v in options.items() if v is not None}}


def positive_int(method: str, name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UnderstudyError(f"{name} must be an integer >= {minimum} (method {method!r})")
    return value


def threshold(name: str, value: object) -> float | None:
    """A probability threshold option: "auto" -> None (settled by the engine), else [0, 1]."""
    if value == "auto":
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise UnderstudyError(f"{name} must be auto or a number in [0, 1], got {value!r}")
    return float(value)
