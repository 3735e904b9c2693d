"""logit_bias: a fixed number added to chosen tokens' logits at every position (OpenAI's
definition; -100 all but bans a token, +100 all but forces it)."""

from __future__ import annotations

import torch

from understudy.config import UnderstudyError
from understudy.constraints.base import LogitsProcessor


class LogitBias(LogitsProcessor):
    """Adds bias[t] to logit t in every row; the same at every position, so no state."""

    def __init__(self, bias: dict[int, float], vocab_size: int) -> None:
        outside = sorted(t for t in bias if not 0 <= t < vocab_size)
        if outside:
            raise UnderstudyError(
                f"logit_bias names token ids outside the vocabulary 0..{vocab_size - 1}: "
                f"{outside[:5]}"
            )
        self.bias = torch.zeros(vocab_size)  # [V]
        for token, value in bias.items():
            self.bias[token] = float(value)

    def process(self, logits: torch.Tensor, drafted: list[int]) -> torch.Tensor:
        return logits + self.bias  # [R, V]
