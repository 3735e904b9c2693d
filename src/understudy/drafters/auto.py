"""method="auto": each request, the drafter that pays on this machine: the target's own head
(as method "eagle" drafts), the draft model (as method "draft"), or neither (plain decoding).

Both are built with the engine: the draft model always, the head where one is found for
this target (drafters/eagle.py `find_head`: one trained into the cache, or the package's
own, bound by sha256 to the file it was trained on). Without a head the choice is between
the draft model and plain decoding.

Which part serves a request is learnt from the requests before it: tokens a second of the
decoding each part has done, from the request's first round to its end (policy/
part_choice.py). A request's decoding is one part's alone, as its own method would draft
it: its doubt rules settled with its own c (the draft model's as the builder timed it, the
head's timed against it) and calibrated on the request's own rounds, which is why the choice
is not made round by round: a head that drafts one round in several never learns its own
doubt, and its rounds then yielded 45-71 tokens a second against ~80 alone (2-core Zen 4,
editing prompts). A request the head serves never pays for the draft model's prefill, which
on long prompts is most of what the head saves.

Exact: a request's proposals are one part's own, with their own q (None under greedy), and
which part serves it reads only earlier requests, never this one's draws, so verification
is unchanged (verify/). Chains only: on the GGUF blocks path the head's chains ran faster
than its trees (docs/eagle.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from understudy.config import SamplingParams, UnderstudyError
from understudy.drafters.base import EMPTY, Drafter, Proposal, Traits, register, take_options
from understudy.drafters.draft_model import DraftModelProposer
from understudy.drafters.eagle import EagleProposer
from understudy.measure.passes import step_ratio
from understudy.models.loader import LoadedModel
from understudy.models.runner import Runner
from understudy.models.transformer import Transformer
from understudy.policy.costs import Costs
from understudy.policy.part_choice import Part, PartChoice

log = logging.getLogger(__name__)


@register("auto")
class AutoProposer(Drafter):
    """Options: head (a trained head's folder or a packed head's file; default: the one
    found for the target, else none)."""

    # an instance that found a head asks for the target's hidden states (__init__)
    traits = Traits(needs_draft_model=True, plans_length=True)

    @classmethod
    def from_models(
        cls, target: LoadedModel, draft: LoadedModel | None, max_context: int, **options: object
    ) -> AutoProposer:
        opts = take_options("auto", options, {"head": None})
        model = DraftModelProposer.from_models(target, draft, max_context)
        head: EagleProposer | None = None
        if isinstance(target.model, Transformer):  # a head reads hidden states (FallbackLM: none)
            try:
                head = EagleProposer.from_models(
                    target, None, max_context, head=opts["head"], tree="off"
                )
            except UnderstudyError as why:
                if opts["head"] is not None:
                    raise  # a head asked for by name is used or refused, never skipped
                log.info(
                    "method auto: no head for %s (%s): the draft model alone", target.name, why
                )
        return cls(model, head)

    def __init__(
        self,
        model: DraftModelProposer,
        head: EagleProposer | None,
        choice: PartChoice | None = None,
    ) -> None:
        self.model = model
        self.head = head
        self.traits = replace(
            type(self).traits, wants_hidden=head is not None, batches=model.traits.batches
        )
        parts: tuple[Part, ...] = ("head", "model", "none") if head else ("model", "none")
        self.choice = choice or PartChoice(parts)  # shared by the seats of a batched engine
        self.requests = dict.fromkeys(parts, 0)  # requests each part served, on this seat
        self.part: Part = "none"  # the request's
        self.prompt_length = 0
        self.started: float | None = None  # the request's first round

    # -- what the builder and the engine call -------------------------------------------------

    def draft_runner(self) -> Runner:
        return self.model.runner

    def timed_step(self) -> Callable[[], None] | None:
        return self.model.timed_step()

    def quantize(self, scheme: str) -> None:
        """The head's own network (the draft model is quantized by the builder)."""
        if self.head is not None:
            self.head.quantize(scheme)

    def settle(self, costs: Costs, automatic_k: bool) -> None:
        """The builder's costs are the draft model's; the head's step is timed against the
        model's (the best of sweeps of one each in turn), so c_head = c_model * their ratio.
        Each part settles its own doubt rules with its own c."""
        self.costs = costs
        self.model.settle(costs, automatic_k)
        if self.head is not None:
            step, model_step = self.head.timed_step(), self.model.timed_step()
            assert model_step is not None  # a draft model's step always costs something
            self.head_step = costs.draft_step * step_ratio(step, model_step)
            self.head.settle(replace(costs, draft_step=self.head_step), automatic_k)

    def for_seat(self, index: int) -> AutoProposer:
        """Each part's own seat (its own caches); the same costs and the same choice."""
        head = None if self.head is None else self.head.for_seat(index)
        seat = AutoProposer(self.model.for_seat(index), head, self.choice)
        seat.costs, seat.head_step = self.costs, self.head_step
        return seat

    def begin(self, prompt_ids: list[int]) -> None:
        self.part = self.choice.choose()
        self.requests[self.part] += 1
        drafter = self.drafter_of(self.part)
        if drafter is not None:
            drafter.begin(prompt_ids)
        self.prompt_length = len(prompt_ids)
        self.started = None

    def drafter_of(self, part: Part) -> Drafter | None:
        return {"model": self.model, "head": self.head, "none": None}[part]

    def observe_hidden(self, hidden: torch.Tensor, start: int) -> None:
        if self.head is not None and self.part == "head":
            self.head.observe_hidden(hidden, start)

    @property
    def stops_by_confidence(self) -> bool:
        """Under automatic K (both parts settle their doubt rules alike): k is then the row
        budget (traits.plans_length) and each part ends its chain on its own doubt."""
        return self.model.stops_by_confidence

    # -- the request's rounds -------------------------------------------------------------

    def propose(
        self, tokens: list[int], k: int, params: SamplingParams, generator: torch.Generator
    ) -> Proposal:
        if self.started is None:
            self.started = time.perf_counter()
        drafter = self.drafter_of(self.part)
        return EMPTY if drafter is None else drafter.propose(tokens, k, params, generator)

    def commit(self, tokens: list[int]) -> None:
        drafter = self.drafter_of(self.part)
        if drafter is not None:
            drafter.commit(tokens)

    def end(self, tokens: list[int]) -> None:
        """Credit the request's part with the tokens it decoded, in their wall time."""
        if self.started is not None:
            decoded = len(tokens) - self.prompt_length
            self.choice.observe(self.part, decoded, time.perf_counter() - self.started)
        drafter = self.drafter_of(self.part)
        if drafter is not None:
            drafter.end(tokens)
