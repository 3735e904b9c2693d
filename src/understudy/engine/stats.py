"""The vocabulary of speculative decoding, defined and computed in one place.

- round: one draft -> verify -> accept cycle (a decode pass with nothing drafted is a round
  with drafted = 0; plain decoding is all such rounds). target pass: one target forward,
  the prefill included (it emits the first token), so plain decoding has
  tokens_per_pass == 1.0 exactly.
- acceptance_rate = accepted / drafted (0.0 when nothing was drafted).
- mean_accepted_length = (accepted + rounds) / rounds: the bonus/corrected token included.
- per_position_acceptance[i] = share of rounds whose i-th drafted token was accepted.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from understudy.config import Method


@dataclass
class GenerationStats:
    """Field names are the `--json` "stats" keys, and keep their names."""

    method: Method
    k: int | Literal["auto"]
    tokens: int = 0
    target_passes: int = 0
    tokens_per_pass: float = 0.0
    acceptance_rate: float = 0.0
    mean_accepted_length: float = 0.0
    per_position_acceptance: list[float] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    wall_s: float = 0.0
    tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    prompt_tokens: int = 0
    finish_reason: str = ""
    exact: bool = True

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class StatsRecorder:
    """Accumulates per-round counts and times; `finish()` derives the ratios once."""

    def __init__(self, method: Method, k: int | Literal["auto"], exact: bool) -> None:
        self.stats = GenerationStats(method=method, k=k, exact=exact)
        self._accepted_at: list[int] = []  # rounds whose i-th drafted token was accepted
        self._start = time.perf_counter()

    def prefill(self, seconds: float, prompt_tokens: int) -> None:
        self.stats.prefill_s = seconds
        self.stats.prompt_tokens = prompt_tokens
        self.stats.target_passes += 1

    def round(self, drafted: int, accepted: int, draft_s: float, verify_s: float) -> None:
        s = self.stats
        s.rounds += 1
        s.target_passes += 1
        s.drafted += drafted
        s.accepted += accepted
        s.draft_s += draft_s
        s.verify_s += verify_s
        if len(self._accepted_at) < drafted:
            self._accepted_at.extend([0] * (drafted - len(self._accepted_at)))
        for i in range(accepted):
            self._accepted_at[i] += 1

    def finish(self, tokens: int, finish_reason: str) -> GenerationStats:
        s = self.stats
        s.tokens = tokens
        s.finish_reason = finish_reason
        s.wall_s = time.perf_counter() - self._start
        s.decode_s = max(s.wall_s - s.prefill_s, 0.0)
        s.tokens_per_pass = tokens / s.target_passes if s.target_passes else 0.0
        s.acceptance_rate = s.accepted / s.drafted if s.drafted else 0.0
        s.mean_accepted_length = (s.accepted + s.rounds) / s.rounds if s.rounds else 1.0
        s.per_position_acceptance = [n / s.rounds for n in self._accepted_at] if s.rounds else []
        s.tokens_per_s = tokens / s.wall_s if s.wall_s > 0 else 0.0
        s.decode_tokens_per_s = (tokens - 1) / s.decode_s if s.decode_s > 0 and tokens > 1 else 0.0
        return s
