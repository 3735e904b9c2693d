"""Small, self-validating configuration dataclasses.

`SamplingParams` mirrors vLLM's names. Its defaults are the project's own (temperature 1.0,
top_k 0 = off, top_p 1.0, min_p 0.0, seed None) and are never taken from a model's
generation_config. `seed=0` is a seed like any other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_SPECULATIVE_TOKENS = 64


class UnderstudyError(ValueError):
    """A user-facing error: its message is one clear line, shown without a traceback."""


@dataclass
class SamplingParams:
    """How tokens are chosen. temperature 0 means greedy (argmax)."""

    max_tokens: int = 128
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # nucleus mass in (0, 1]
    min_p: float = 0.0  # keep tokens with p >= min_p * p_max; 0 = off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # generation ends after a stop string
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise UnderstudyError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise UnderstudyError(f"temperature must be >= 0, got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise UnderstudyError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise UnderstudyError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            raise UnderstudyError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise UnderstudyError(f"seed must be a non-negative integer or None, got {self.seed!r}")
        if any(not s for s in self.stop):
            raise UnderstudyError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def parse_num_speculative_tokens(value: int | str) -> int | str:
    """Validate K: an int in 1..64, or "auto"."""
    if isinstance(value, str):
        if value == "auto":
            return value
        try:
            value = int(value)
        except ValueError:
            raise UnderstudyError(
                f"num_speculative_tokens must be an integer in 1..{MAX_SPECULATIVE_TOKENS} "
                f"or 'auto', got {value!r}"
            ) from None
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or not (1 <= value <= MAX_SPECULATIVE_TOKENS)
    ):
        raise UnderstudyError(
            f"num_speculative_tokens must be an integer in 1..{MAX_SPECULATIVE_TOKENS} "
            f"or 'auto', got {value!r}"
        )
    return value
