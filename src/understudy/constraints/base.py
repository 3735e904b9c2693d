"""Logits processors: the target's logits, changed as a function of the tokens before them.

A processor turns the target's distribution p into another law p' (penalties, a bias, a
grammar's mask). Speculation stays lossless for p' because the engine applies the processor
to the target's verify logits before verification: every row i of a round is processed as
if plain decoding had reached that position, so greedy speculative output equals greedy plain
output under the same processor bit for bit, and rejection sampling yields p' exactly
(a drafted token that p' forbids has p'(x) = 0 and is always rejected). The drafter's q may
be anything: exactness never depends on it.

Protocol, per request:

    proc.begin(prompt_ids)
    row = proc.process(prefill_logits[None], [])[0]   # the first generated token
    loop:  proc.commit(tokens)                         # prompt + generated, after each step
           rows = proc.process(verify_logits, drafted) # [R, V]; R <= len(drafted) + 1

Row i of `process` is the position after (committed tokens + drafted[:i]); the committed
state is unchanged when `process` returns (a grammar matcher advances along `drafted`
tentatively and rolls back). `commit` may be called with the same tokens more than once.
"""

from __future__ import annotations

import torch


class LogitsProcessor:
    """The three hooks; the defaults do nothing, so a processor overrides only what it needs."""

    def begin(self, prompt_ids: list[int]) -> None:
        """A request starts with these prompt tokens; forget any earlier request."""

    def process(self, logits: torch.Tensor, drafted: list[int]) -> torch.Tensor:
        """logits: [R, V] float32, row i after committed + drafted[:i]. Returns a new [R, V]
        (masked entries -inf); `logits` itself is left as it was."""
        return logits.clone()

    def commit(self, tokens: list[int]) -> None:
        """The request's tokens so far: prompt + generated (a prefix of the next call's)."""


class GeneratedTokens(LogitsProcessor):
    """A processor that needs to know how many tokens have been generated: keeps the prompt's
    length and the committed sequence."""

    def __init__(self) -> None:
        self.prompt_len = 0
        self.tokens: list[int] = []

    def begin(self, prompt_ids: list[int]) -> None:
        self.prompt_len = len(prompt_ids)
        self.tokens = list(prompt_ids)

    def commit(self, tokens: list[int]) -> None:
        self.tokens = list(tokens)

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]


class Composite(LogitsProcessor):
    """Several processors applied in order, each to the previous one's output."""

    def __init__(self, parts: list[LogitsProcessor]) -> None:
        self.parts = parts

    def begin(self, prompt_ids: list[int]) -> None:
        for part in self.parts:
            part.begin(prompt_ids)

    def process(self, logits: torch.Tensor, drafted: list[int]) -> torch.Tensor:
        for part in self.parts:
            logits = part.process(logits, drafted)
        return logits

    def commit(self, tokens: list[int]) -> None:
        for part in self.parts:
            part.commit(tokens)
