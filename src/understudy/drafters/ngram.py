"""method="ngram": prompt lookup decoding (Saxena 2023; vLLM's "ngram" method).

The last n tokens of the text (n from `prompt_lookup_max` down to `prompt_lookup_min`, longest
first) are looked up among the earlier positions of the prompt and the text generated so
far; the tokens that followed the most recent earlier occurrence are the guesses. When that
continuation runs into the end of the text (a pattern repeating right now), it continues
with its own guesses: after "x y x y" the guesses are "x y x y ...".

Index: one dict from n-gram (a tuple) to the position just after its most recent occurrence
whose continuation is known. It is updated incrementally, for the new tokens only, so a round
costs O(max - min + 1) dict operations per new token plus one lookup per n: never a rescan.

Guesses are a deterministic function of the text, so they are verified with q = one-hot
(`draft_probs=None`): lossless under sampling as well as greedy (verify/chain.py).
Wrong guesses cost little here: a guessed row adds ~3.5% to a target pass with unpadded
row-invariant passes, nothing with padded ones (models/runner.py), which is why
`prompt_lookup_min` defaults to 1 (vLLM's default of 5 is for batched GPU serving, where each
extra row takes compute from other requests).
"""

from __future__ import annotations

import torch

from understudy.config import SamplingParams, UnderstudyError
from understudy.drafters.base import Drafter, Proposal, positive_int, register, take_options
from understudy.models.loader import LoadedModel

DEFAULT_PROMPT_LOOKUP_MAX = 5
DEFAULT_PROMPT_LOOKUP_MIN = 1


class NgramIndex:
    """Most recent occurrence of every n-gram (min_n <= n <= max_n) of one growing sequence."""

    def __init__(self, min_n: int, max_n: int) -> None:
        assert 1 <= min_n <= max_n
        self.min_n = min_n
        self.max_n = max_n
        self.seq: list[int] = []  # the text so far (our own copy, appended to)
        self.table: dict[tuple[int, ...], int] = {}  # n-gram -> start of its continuation
        self.indexed = 0  # n-grams ending before this position are in `table`

    def reset(self, tokens: list[int]) -> None:
        self.seq = list(tokens)
        self.table = {}
        self.indexed = 0
        self._index()

    def sync(self, tokens: list[int]) -> None:
        """Catch up with `tokens`, which extends what we have seen (the engine only appends;
        anything else, e.g. a different request, rebuilds the index)."""
        n = len(self.seq)
        if len(tokens) < n or (n and tokens[n - 1] != self.seq[n - 1]):
            self.reset(tokens)
            return
        if len(tokens) > n:
            self.seq.extend(tokens[n:])
            self._index()

    def _index(self) -> None:
        """Index the n-grams ending at e for every e whose continuation (e + 1) is known."""
        seq, table, lo, hi = self.seq, self.table, self.min_n, self.max_n
        for e in range(self.indexed, len(seq) - 1):
            for n in range(lo, min(hi, e + 1) + 1):
                table[tuple(seq[e - n + 1 : e + 1])] = e + 1
        self.indexed = max(self.indexed, len(seq) - 1)

    def lookup(self, k: int) -> tuple[list[int], int]:
        """Up to k guesses for what follows the sequence, and the length n of the match they
        come from (0: no match). Longest n first; for that n, the most recent occurrence."""
        seq, table = self.seq, self.table
        length = len(seq)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            start = table.get(tuple(seq[length - n :]))
            if start is None:
                continue
            guesses: list[int] = []
            for j in range(k):
                i = start + j  # past the end of the text, the guesses continue themselves
                guesses.append(seq[i] if i < length else guesses[i - length])
            return guesses, n
        return [], 0


@register("ngram")
class NgramProposer(Drafter):
    """Prompt lookup. Options: prompt_lookup_max (default 5), prompt_lookup_min (default 1)."""

    @classmethod
    def from_models(
        cls, target: LoadedModel, draft: LoadedModel | None, max_context: int, **options: object
    ) -> NgramProposer:
        opts = take_options(
            "ngram", options, {"prompt_lookup_max": None, "prompt_lookup_min": None}
        )
        return cls(opts["prompt_lookup_max"], opts["prompt_lookup_min"])

    def __init__(self, prompt_lookup_max: int | None = None, prompt_lookup_min: int | None = None):
        # a bound left unset takes its default, moved where needed to fit the one given
        hi = prompt_lookup_max
        lo = prompt_lookup_min
        if hi is None:
            hi = max(DEFAULT_PROMPT_LOOKUP_MAX, lo or 0)
        if lo is None:
            lo = min(DEFAULT_PROMPT_LOOKUP_MIN, hi)
        hi = positive_int("ngram", "prompt_lookup_max", hi)
        lo = positive_int("ngram", "prompt_lookup_min", lo)
        if lo > hi:
            raise UnderstudyError(
                f"prompt_lookup_min ({lo}) must not exceed prompt_lookup_max ({hi})"
            )
        self.index = NgramIndex(lo, hi)

    def begin(self, prompt_ids: list[int]) -> None:
        self.index.reset(prompt_ids)

    def for_seat(self, index: int) -> NgramProposer:
        return NgramProposer(self.index.max_n, self.index.min_n)

    def draft(self, tokens: list[int], k: int) -> tuple[list[int], int]:
        """Free guesses (no tensors): (up to k token ids, match length). Used by hybrid."""
        self.index.sync(tokens)
        return self.index.lookup(k)

    def propose(
        self, tokens: list[int], k: int, params: SamplingParams, generator: torch.Generator
    ) -> Proposal:
        guesses, _ = self.draft(tokens, k)
        return Proposal(torch.tensor(guesses, dtype=torch.long), None)  # q = one-hot

    def commit(self, tokens: list[int]) -> None:
        self.index.sync(tokens)
