"""What a request gives back: its rounds (for those who watch), its tokens, its output."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from understudy.engine.emitter import TokenEvent
from understudy.engine.stats import GenerationStats


@dataclass(frozen=True)
class RoundEvent:
    """One verification round, for those who want to see it (the Lab): every drafted token,
    rejected ones included, how many were accepted, and the target's own token."""

    round: int
    drafted: list[int]
    accepted: int
    next_token: int
    origin: str  # of next_token: "corrected", "bonus" or "target" (nothing drafted)
    parents: list[int] | None = None  # a tree round: drafted[i] follows drafted[parents[i]]
    path: list[int] | None = None  # a tree round: the indices into drafted that were kept
    free: bool = False  # the guesses were read off the text, not drafted (Proposal.free)


@dataclass
class GenerationOutput:
    text: str
    token_ids: list[int]
    stats: GenerationStats
    prompt_token_ids: list[int]


class TokenStream:
    """Iterate to get TokenEvents; afterwards `.output` holds the GenerationOutput."""

    def __init__(
        self, inner: Iterator[TokenEvent | GenerationOutput], prompt_ids: list[int]
    ) -> None:
        self._inner = inner
        self.prompt_ids = prompt_ids
        self.output: GenerationOutput | None = None

    def __iter__(self) -> Iterator[TokenEvent]:
        for item in self._inner:
            if isinstance(item, GenerationOutput):
                self.output = item
            else:
                yield item
