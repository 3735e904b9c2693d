"""One interface for every drafter: every hook the engine and the builder call, declared here.

Proposing is separate from verifying. A drafter sees the request's tokens so far (prompt +
generated; the last one not yet scored by the target) and returns up to k guesses, with the
distribution each was drawn from (q, after the same warping as the target's p) or None when
the guesses are deterministic (q = one-hot). After the verifier has spoken, `commit` tells it
which tokens really follow, so it can roll back whatever state it keeps.

Every optional hook has a default body here (as llama.cpp's common/speculative.h declares its
drafter hooks), so the engine calls each one unconditionally and never probes a drafter for
what it can do. The order of calls for one request:

    begin(prompt_ids)
    observe_hidden(prompt's hidden states, 0)          # only when wants_hidden
    repeat:  propose(...) or propose_tree(...)         # tree only when self.tree != "off"
             observe_hidden(kept rows' hidden, start)  # only when wants_hidden
             commit(tokens)                            # not after the last round
    end(tokens)

Drafter classes register themselves in DRAFTERS by method name; the builder looks the class
up once, when the engine is built, never in the decode loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from understudy.config import SamplingParams, UnderstudyError

if TYPE_CHECKING:
    from understudy.models.loader import LoadedModel
    from understudy.models.runner import Runner
    from understudy.policy.costs import Costs


@dataclass
class Proposal:
    draft_ids: torch.Tensor  # [k'] int64, k' <= k (may be 0: nothing worth guessing)
    draft_probs: torch.Tensor | None  # [k', vocab] float32 q, or None for q = one-hot
    # A token tree (verify/token_tree.py) instead of a chain: [k'] int64, draft i follows
    # draft parents[i] (-1 = the last committed token), parents[i] < i; a chain is
    # parents[i] = i - 1. Tree drafts are deterministic (draft_probs is None): siblings are
    # verified one by one.
    parents: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return int(self.draft_ids.shape[0])


EMPTY = Proposal(torch.zeros(0, dtype=torch.long), None)


@dataclass(frozen=True)
class ChainRequest:
    """One sequence's part of a batched draft (Drafter.propose_batch): up to k guesses
    after `tokens`, by its own drafter, with its own sampling parameters and generator."""

    drafter: Drafter
    tokens: list[int]
    k: int
    params: SamplingParams
    generator: torch.Generator


class Drafter:
    """The base of every drafter. Subclasses implement `from_models` and `propose`; every
    other hook's default body is what a drafter without that ability should do."""

    needs_draft_model: bool = False  # the builder loads a draft model and passes it in
    draft_names_head: bool = False  # `draft=DIR` names a trained head's folder (eagle)
    # the drafter decides its own round length (hybrid): with automatic K the engine hands it
    # the whole row budget as k instead of automatic K's choice
    plans_length: bool = False
    wants_hidden: bool = False  # the engine feeds it the target's hidden states
    tree: str = "off"  # "off" | "on" | "auto": whether rounds may draft trees
    batches: bool = False  # `for_seat` works: the drafter runs in a batched engine

    @classmethod
    def from_models(
        cls,
        target: LoadedModel,
        draft: LoadedModel | None,
        max_context: int,
        **options: object,
    ) -> Drafter:
        """Build the drafter for `target` (and `draft`, when needs_draft_model). Unknown
        options are refused with their names (`take_options`)."""
        raise NotImplementedError

    def begin(self, prompt_ids: list[int]) -> None:
        """A new request starts with these prompt tokens."""

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
        """A token tree of at most `nodes` nodes and `depth` levels after `tokens` (Proposal
        with parents). Called only when `tree` is not "off"."""
        raise UnderstudyError(f"{type(self).__name__} cannot draft trees")

    def commit(self, tokens: list[int]) -> None:
        """The round is over: `tokens` is the sequence as it now stands."""

    def for_seat(self, index: int) -> Drafter:
        """A drafter of this kind for seat `index` (>= 1) of a batched engine (engine/batch.py):
        its own per-request state (and, with a draft model, its own region of the draft's KV
        cache), sharing what is shared across requests (weights, a cache of outputs). Seat 0
        is this drafter itself. A drafter that cannot is refused here, at build."""
        raise UnderstudyError(
            f"{type(self).__name__} does not run in a batch yet (max_num_seqs > 1)"
        )

    @classmethod
    def propose_batch(cls, chains: list[ChainRequest]) -> list[Proposal]:
        """Chains for several sequences of a batch at once, one per ChainRequest, each
        exactly what its drafter's `propose` would return alone. The default drafts one
        sequence after another; a drafter with a model steps them all in shared passes."""
        return [
            c.drafter.propose(c.tokens, c.k, c.params, c.generator) if c.k > 0 else EMPTY
            for c in chains
        ]

    def end(self, tokens: list[int]) -> None:
        """The request is over with these tokens (e.g. a cache across requests learns them)."""

    def observe_hidden(self, hidden: torch.Tensor, start: int) -> None:
        """The target's final hidden states [n, hidden] of positions start..start+n-1 (only
        called when `wants_hidden`)."""

    @property
    def stops_by_confidence(self) -> bool:
        """Whether a chain round ends on the drafter's own doubt (then automatic K only
        decides whether to draft at all, and the drafter how far)."""
        return False

    def settle_confidence(self, automatic_k: bool) -> None:
        """Resolve thresholds left at "auto" once the engine knows whether K is automatic."""

    def quantize(self, scheme: str) -> None:
        """Quantize a network the drafter holds itself (draft_quantization); drafters with
        none ignore it, and a draft model is quantized by the builder before it gets here."""

    def draft_runner(self) -> Runner | None:
        """The runner of the draft model whose step is this drafter's cost, if any."""
        return None

    def step_seconds(self, repeats: int) -> float:
        """One drafting step (one guess), best of `repeats`: the numerator of c. A drafter
        with a draft model times one of its one-token passes; a free drafter costs 0."""
        runner = self.draft_runner()
        if runner is None:
            return 0.0
        context = torch.arange(1, 33, device=runner.model.device)
        runner.prefill(context, span=480)
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            runner.extend(context[:1])
            times.append(time.perf_counter() - t0)
            runner.truncate(context.shape[0])
        runner.truncate(0)
        return min(times[1:])  # the first is a warm-up

    def use_costs(self, costs: Costs) -> None:
        """The costs measured when the engine was built (a drafter that plans with them)."""


DRAFTERS: dict[str, type[Drafter]] = {}


def register(method: str):
    """Class decorator: make a drafter available as Engine method `method`."""

    def wrap(cls: type[Drafter]) -> type[Drafter]:
        DRAFTERS[method] = cls
        return cls

    return wrap


def take_options(method: str, options: dict[str, object], defaults: dict[str, object]) -> dict:
    """`defaults` updated with `options`; an option not in `defaults` is an error (fail early:
    a misspelt option silently ignored would quietly benchmark the wrong configuration)."""
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
