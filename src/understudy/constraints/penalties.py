"""Presence, frequency and repetition penalties, as OpenAI and vLLM define them.

With c(t) = how often token t occurs among the GENERATED tokens before the position, and
seen(t) = t occurs in the prompt or among them:

    l(t) <- l(t) / r   if seen(t) and l(t) > 0     (repetition, vLLM's rule;
    l(t) <- l(t) * r   if seen(t) and l(t) <= 0     r = repetition_penalty, 1 = off)
    l(t) <- l(t) - frequency_penalty * c(t) - presence_penalty * [c(t) > 0]

in that order (vLLM's apply_penalties). Row i counts the drafted tokens before it as
generated, so every row is what plain decoding would compute at that position.
"""

from __future__ import annotations

import torch

from understudy.constraints.base import GeneratedTokens


class Penalties(GeneratedTokens):
    """The three penalties; counts follow `commit` incrementally, drafts count tentatively."""

    def __init__(self, vocab_size: int, presence: float, frequency: float, repetition: float):
        super().__init__()
        self.vocab_size = vocab_size
        self.presence = presence
        self.frequency = frequency
        self.repetition = repetition
        self.counts = torch.zeros(vocab_size)  # [V] occurrences among generated tokens
        self.in_prompt = torch.zeros(vocab_size, dtype=torch.bool)  # [V]
        self.counted = 0  # generated tokens already in `counts`

    def begin(self, prompt_ids: list[int]) -> None:
        super().begin(prompt_ids)
        self.counts.zero_()
        self.in_prompt.zero_()
        self.in_prompt[torch.tensor(prompt_ids, dtype=torch.long)] = True
        self.counted = 0

    def commit(self, tokens: list[int]) -> None:
        super().commit(tokens)
        for token in self.generated[self.counted :]:
            self.counts[token] += 1
        self.counted = len(self.generated)

    def process(self, logits: torch.Tensor, drafted: list[int]) -> torch.Tensor:
        out = torch.empty_like(logits)  # [R, V]
        counts = self.counts.clone()  # [V], tentatively advanced along `drafted`
        for i in range(logits.shape[0]):
            out[i] = self._penalise(logits[i], counts)
            if i < len(drafted):
                counts[drafted[i]] += 1
        return out

    def _penalise(self, row: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """row, counts: [V] -> the penalised row [V]."""
        present = counts > 0  # [V]
        if self.repetition != 1.0:
            seen = self.in_prompt | present
            scaled = torch.where(row > 0, row / self.repetition, row * self.repetition)
            row = torch.where(seen, scaled, row)
        if self.frequency != 0.0:
            row = row - self.frequency * counts
        if self.presence != 0.0:
            row = row - self.presence * present.float()
        return row
