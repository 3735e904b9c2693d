"""Drive one Transformer through one token sequence: prefill, extend, roll back.

Invariant: the KV cache holds valid entries for exactly the first `length` tokens of the
sequence; everything past it is garbage that the next pass overwrites. Rolling back is
`truncate(n)`: position arithmetic, no copying (DESIGN.md section 4).

With `rows` set (the target), every decode pass scores exactly `rows` query rows, real
tokens first and filler after, over a fixed window of key slots chosen once per request
(`prefill(..., span=)`), so a real row's logits depend neither on how many other rows are
real nor on where the pass starts: verification is bitwise the same as decoding one token
at a time. (Measured: with a key window that grows with the pass, SDPA's key blocking changes
once the window crosses a block boundary and rows differ in the last bits.)
"""

from __future__ import annotations

import torch

from understudy.models.transformer import Transformer

PREFILL_CHUNK = 512
WINDOW_QUANTUM = 256  # key windows are multiples of this many slots


class Runner:
    def __init__(self, model: Transformer, max_context: int, rows: int | None = None) -> None:
        self.model = model
        self.rows = rows
        self.max_context = max_context
        self.length = 0
        self.slots = max_context + max(rows or 0, PREFILL_CHUNK)
        self.window: int | None = None  # fixed key window for this request (None: grows)
        model.allocate_cache(self.slots)

    @property
    def vocab_size(self) -> int:
        return self.model.cfg.vocab_size

    def truncate(self, length: int) -> None:
        """Forget every token from `length` on."""
        assert 0 <= length <= self.length, (length, self.length)
        self.length = length

    def _pass(self, tokens: torch.Tensor, rows: int, logit_rows: slice) -> torch.Tensor:
        """Score `tokens` [n] at positions length..length+n-1 in one pass of `rows` rows."""
        n, start, device = tokens.shape[0], self.length, self.model.device
        padded = torch.zeros(rows, dtype=torch.long, device=device)  # [rows], filler = id 0
        padded[:n] = tokens
        positions = torch.arange(start, start + rows, device=device)  # [rows]
        keys = max(self.window or 0, start + rows)
        mask = torch.arange(keys, device=device)[None, :] <= positions[:, None]  # [rows, L]
        logits = self.model(padded, positions, positions, mask, logit_rows)
        self.length = start + n
        return logits

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor, span: int | None = None) -> torch.Tensor:
        """Feed a whole prompt [n] from an empty cache; return the last row's logits [vocab].
        `span`: the most tokens this request will hold (prompt + budget); with `rows` set,
        every pass then attends over the same fixed window of key slots."""
        self.length = 0
        self.window = None
        if self.rows is not None:
            need = (span or self.max_context) + self.rows
            self.window = min(self.slots, -(-need // WINDOW_QUANTUM) * WINDOW_QUANTUM)
        for begin in range(0, tokens.shape[0], PREFILL_CHUNK):
            chunk = tokens[begin : begin + PREFILL_CHUNK]
            logits = self._pass(chunk, chunk.shape[0], slice(chunk.shape[0] - 1, chunk.shape[0]))
        return logits[0]

    @torch.inference_mode()
    def extend(self, tokens: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """Feed tokens [n] after the cache; return their logits [n, vocab] ([1, vocab] with
        last_only). With `rows` set the pass is padded to `rows` rows (the target's path)."""
        n = tokens.shape[0]
        if self.rows is None:
            return self._pass(tokens, n, slice(n - 1, n) if last_only else slice(0, n))
        assert n <= self.rows, f"a pass holds at most {self.rows} rows, got {n}"
        logits = self._pass(tokens, self.rows, slice(None))
        return logits[n - 1 : n] if last_only else logits[:n]
