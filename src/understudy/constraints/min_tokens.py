"""min_tokens: the tokens that end generation (EOS, stop_token_ids) are impossible while
fewer than min_tokens tokens have been generated (vLLM's MinTokensLogitsProcessor)."""

from __future__ import annotations

import torch

from understudy.config import UnderstudyError
from understudy.constraints.base import GeneratedTokens


class MinTokens(GeneratedTokens):
    """Row i is the (g + i + 1)-th generated token, g = tokens committed after the prompt:
    its stop tokens get -inf while g + i < min_tokens."""

    def __init__(self, min_tokens: int, stop_ids: tuple[int, ...], vocab_size: int) -> None:
        super().__init__()
        outside = sorted(t for t in stop_ids if not 0 <= t < vocab_size)
        if outside:
            raise UnderstudyError(
                f"stop_token_ids names token ids outside the vocabulary 0..{vocab_size - 1}: "
                f"{outside[:5]}"
            )
        if len(set(stop_ids)) == vocab_size:  # every row would be -inf: no token to draw
            raise UnderstudyError(
                f"min_tokens ({min_tokens}) cannot be met: EOS and stop_token_ids together name "
                "every token of the vocabulary"
            )
        self.min_tokens = min_tokens
        self.stop_ids = torch.tensor(sorted(set(stop_ids)), dtype=torch.long)

    def process(self, logits: torch.Tensor, drafted: list[int]) -> torch.Tensor:
        out = logits.clone()  # [R, V]
        blocked = max(0, min(out.shape[0], self.min_tokens - len(self.generated)))
        if blocked:
            out[:blocked, self.stop_ids] = float("-inf")
        return out
