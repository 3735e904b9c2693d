"""A request in flight, where it runs, and what a round's verification decided."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from understudy.config import SamplingParams
from understudy.constraints.base import LogitsProcessor
from understudy.drafters.base import Drafter, Proposal
from understudy.engine.emitter import Emitter
from understudy.models.runner import Runner


@dataclass(frozen=True)
class Seat:
    """Where a request runs: the target's runner (its region of the KV cache) and the drafter
    with that request's state. A solo engine has one; a batched one, one per sequence."""

    runner: Runner
    drafter: Drafter | None


@dataclass
class Request:
    """One request in flight (see the module docstring for the invariant on `tokens`)."""

    tokens: list[int]
    params: SamplingParams
    generator: torch.Generator
    emitter: Emitter
    processor: LogitsProcessor | None
    seat: Seat


@dataclass
class Verified:
    """What a round's verification decided: `kept` drafted tokens, then `next_token`."""

    proposal: Proposal
    kept: list[int]
    next_token: int
    bonus: bool
    depth: int  # a chain's length, a tree's depth
    raw_logits: torch.Tensor  # [len(kept) + 1, V] the target's rows of the emitted tokens
    path: list[int] | None = field(default=None)  # a tree round: indices into drafted
