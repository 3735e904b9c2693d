"""The draft model's LM head over the first N token ids only (option draft_vocab).

A draft step on a CPU streams every weight of the draft once; the 0.5B default draft's head
(151,936 rows of 896, Q8_0 from its GGUF file) is about a third of those bytes. FR-Spec
(Zhao et al. 2025) drafts from the most frequent tokens only. A byte-level BPE vocabulary
lists its tokens in merge order, the commonest pairs first, so the first N ids stand in for
the most frequent ones: on the shipped code-completion prompts 3.4% of the target's tokens
lie past the first 32,768 ids (1.6% past 49,152).

Lossless: only the draft's proposals change. A token past N is never guessed, its draft
probability q is 0 (its logit is -inf, so every warp and softmax of the draft's logits is a
distribution over the first N ids), and verification against the target's full
distribution decides every token: greedy output and the sampling law are the target's.

Where: a draft whose head runs from GGUF blocks in one part (kernels/qgemm.py); its first N
rows are repacked on their own and the full head is released. "auto" takes AUTO_VOCAB ids
where the vocabulary has more than twice as many, else the whole head.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from understudy.config import UnderstudyError
from understudy.kernels.qgemm import QuantLinear
from understudy.models.hf_fallback import FallbackLM
from understudy.models.loader import LoadedModel
from understudy.models.transformer import Transformer

AUTO_VOCAB = 32768


class DraftVocabHead(nn.Module):
    """logits [R, vocab]: the head's first `rows` outputs, -inf after them."""

    def __init__(self, head: QuantLinear, rows: int) -> None:
        super().__init__()
        assert len(head.parts) == 1 and head.bias is None, "a one-part head without bias"
        self.vocab = head.out_features
        self.rows = rows
        self.head = QuantLinear([head.parts[0].take_rows(np.arange(rows))], None)  # [rows, in]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [R, in] -> [R, vocab]
        out = torch.full((x.shape[0], self.vocab), float("-inf"), dtype=torch.float32)
        out[:, : self.rows] = self.head(x)
        return out


def restrict_draft_vocab(draft: LoadedModel, value: object) -> int | None:
    """Apply draft_vocab ("auto", "all" or a count of ids) to `draft`'s head, in place.
    Returns the ids the draft now guesses from (None: all of them)."""
    if value == "all":
        return None
    if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise UnderstudyError(f"draft_vocab must be auto, all or an integer >= 1, got {value!r}")
    model = draft.model
    head = model.lm_head if isinstance(model, Transformer) else None
    if not (isinstance(head, QuantLinear) and len(head.parts) == 1 and head.bias is None):
        head = None  # only a one-part head from GGUF blocks, without bias, can be cut
    if value == "auto":
        if head is None or head.out_features <= 2 * AUTO_VOCAB:
            return None
        value = AUTO_VOCAB
    if head is None:
        raise UnderstudyError(
            f"draft_vocab={value} needs a draft whose LM head runs from GGUF blocks "
            f"(quantization='gguf'); {draft.name!r} does not: use draft_vocab='all'"
        )
    # a head was found on a Transformer; value is "auto" made AUTO_VOCAB or an int >= 1
    assert isinstance(model, Transformer) and isinstance(value, int)
    if value >= head.out_features:
        return None
    model.lm_head = DraftVocabHead(head, value)
    return value


def vocab_rows(model: Transformer | FallbackLM) -> int | None:
    """How many first ids a draft model guesses from (its logits past them are -inf): its
    DraftVocabHead's rows, None when its head scores every id."""
    head = model.lm_head if isinstance(model, Transformer) else None
    return head.rows if isinstance(head, DraftVocabHead) else None
