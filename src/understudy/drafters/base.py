"""One interface for every drafter (DESIGN.md section 4): proposing is separate from verifying.

A Proposer sees the request's tokens so far (prompt + generated; the last one not yet
scored by the target) and returns up to k guesses, with the distribution each was drawn
from (q, after the same warping as the target's p) or None when the guesses are
deterministic (q = one-hot). After the verifier has spoken, `commit` tells it which tokens
really follow, so it can roll back whatever state it keeps.

Drafter classes register themselves in DRAFTERS by method name; the engine looks the class
up once, when it is built, never in the decode loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from understudy.config import SamplingParams


@dataclass
class Proposal:
    draft_ids: torch.Tensor  # [k'] int64, k' <= k (may be 0: nothing worth guessing)
    draft_probs: torch.Tensor | None  # [k', vocab] float32 q, or None for q = one-hot
    # A token tree (understudy.verify.token_tree) instead of a chain: [k'] int64, draft i follows draft
    # parents[i] (-1 = the last committed token), parents[i] < i; a chain is parents[i] = i - 1.
    # Tree drafts are deterministic (draft_probs is None): siblings are verified one by one.
    parents: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return int(self.draft_ids.shape[0])


EMPTY = Proposal(torch.zeros(0, dtype=torch.long), None)


class Proposer(Protocol):
    def begin(self, prompt_ids: list[int]) -> None:
        """A new request starts with these prompt tokens."""

    def propose(
        self, tokens: list[int], k: int, params: SamplingParams, generator: torch.Generator
    ) -> Proposal:
        """Guess up to k tokens that follow `tokens`."""

    def commit(self, tokens: list[int]) -> None:
        """The round is over: `tokens` is the sequence as it now stands."""


DRAFTERS: dict[str, type] = {}


def register(method: str):
    """Class decorator: make a drafter available as Engine method `method`."""

    def wrap(cls: type) -> type:
        DRAFTERS[method] = cls
        return cls

    return wrap
