"""Incremental detokenization: text deltas for a growing list of token ids.

Decoding token by token breaks multi-byte characters and merges (a byte-level BPE token can
be half a UTF-8 character), so each delta is the difference between decoding a short window
with and without the newest tokens, held back while it ends in an incomplete character.
"""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        assert self.tokenizer is not None  # push decodes nothing without one
        text: str = self.tokenizer.decode(ids, skip_special_tokens=True)
        return text

    def push(self, token_id: int) -> str:
        """Append one generated token; return the newly completed text (may be "")."""
        if self.tokenizer is None:
            return ""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix) :]
        return ""
