"""Small, self-validating configuration dataclasses.

`SamplingParams` mirrors vLLM's names. Its defaults are the project's own (temperature 1.0,
top_k 0 = off, top_p 1.0, min_p 0.0, seed None) and are never taken from a model's
generation_config. `seed=0` is a seed like any other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

MAX_SPECULATIVE_TOKENS = 64
MAX_LOGPROBS = 20  # alternatives per token, as vLLM's default limit
# The smallest positive temperature: logits are divided by it in float32, and below the
# smallest normal float32 number the divisor would round to 0 (a NaN, not a distribution).
MIN_TEMPERATURE = 2.0**-126
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes 64 bits
# repetition_penalty divides positive logits: a divisor that rounds to 0 in float32 would
# make them inf (and the distribution NaN), so it stays within a factor 1e6 either way.
REPETITION_PENALTY_RANGE = (1e-6, 1e6)


# The string modes callers choose from, as types; each is checked where it enters (the CLI,
# the API, the builder) and tests hold each equal to the tuple its owner validates against.
BuiltMethod = Literal["none", "draft", "ngram", "suffix", "hybrid", "eagle"]  # engine/builder.py
# what a caller may ask for: a method, or "auto" (the default: engine/method_choice.py)
Method = Literal["auto", "none", "draft", "ngram", "suffix", "hybrid", "eagle"]
TreeMode = Literal["off", "on", "auto"]  # whether a drafter's rounds may draft token trees
TREE_MODES: tuple[TreeMode, ...] = ("off", "on", "auto")
DType = Literal["auto", "float32", "bfloat16", "float16"]  # auto: bf16 where native, else fp32
Quantization = Literal["auto", "none", "gguf"]  # how a GGUF model runs (models/loader.py)


class UnderstudyError(ValueError):
    """A user-facing error: its message is one clear line, shown without a traceback."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_unicode_text(text: str) -> bool:
    """True unless `text` holds a lone surrogate (JSON's "\\ud800" decodes to one): such a
    string is no Unicode text, and no tokenizer can encode it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_real(value: object) -> bool:
    """A finite int or float (not a bool)."""
    return _is_int(value) or (isinstance(value, float) and math.isfinite(value))


@dataclass(frozen=True)
class StructuredSpec:
    """Structured output: the generated text belongs to a language, given by exactly one of
    `json_schema` (a JSON schema, dict or JSON text), `json_object` (any JSON object or
    array), `regex`, `grammar` (EBNF in the GBNF dialect) or `choice` (one of the strings).
    understudy.constraints.grammar compiles it; generation ends with EOS when it is complete."""

    json_schema: dict[str, object] | str | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    choice: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        given = [
            name
            for name, value in (
                ("json_schema", self.json_schema),
                ("json_object", self.json_object or None),
                ("regex", self.regex),
                ("grammar", self.grammar),
                ("choice", self.choice),
            )
            if value is not None
        ]
        if len(given) != 1:
            raise UnderstudyError(
                "structured output takes exactly one of json_schema, json_object, regex, "
                f"grammar or choice, got {', '.join(given) or 'none'}"
            )
        if self.choice is not None and (
            not self.choice or any(not isinstance(c, str) or not c for c in self.choice)
        ):
            raise UnderstudyError("choice must be a non-empty list of non-empty strings")


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
    # log-probabilities of each generated token and of its `logprobs` most likely
    # alternatives (0..20), from the target's raw logits (before processors and warping)
    logprobs: int | None = None
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence among the generated tokens
    repetition_penalty: float = 1.0  # > 0, 1 = off; tokens of prompt or output, vLLM's rule
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (-100..100)
    min_tokens: int = 0  # EOS and stop_token_ids are impossible before this many tokens
    stop_token_ids: list[int] = field(default_factory=list)  # end generation like EOS
    include_stop_str_in_output: bool = False  # keep the stop string that ended the text
    structured: StructuredSpec | None = None  # the output follows a grammar

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise UnderstudyError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not _is_real(self.temperature) or self.temperature < 0:
            raise UnderstudyError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise UnderstudyError(
                f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:.4g} (the smallest "
                f"normal float32 number), got {self.temperature!r}"
            )
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise UnderstudyError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise UnderstudyError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise UnderstudyError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise UnderstudyError(
                f"seed must be an integer in 0..2**64-1 or None, got {self.seed!r}"
            )
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise UnderstudyError("stop strings must be non-empty")
        if any(not is_unicode_text(s) for s in self.stop):
            raise UnderstudyError("stop strings must be Unicode text, without lone surrogates")
        self._check_processors()

    def _check_processors(self) -> None:
        """The fields that become logits processors (understudy.constraints)."""
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise UnderstudyError(
                f"logprobs must be an integer in 0..{MAX_LOGPROBS} or None, got {self.logprobs!r}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2.0 <= value <= 2.0:
                raise UnderstudyError(f"{name} must be a number in [-2, 2], got {value!r}")
        low, high = REPETITION_PENALTY_RANGE
        if not _is_real(self.repetition_penalty) or not low <= self.repetition_penalty <= high:
            raise UnderstudyError(
                f"repetition_penalty must be a number in [{low:g}, {high:g}] (1 = off), "
                f"got {self.repetition_penalty!r}"
            )
        for token, bias in (self.logit_bias or {}).items():
            if not _is_int(token) or token < 0:
                raise UnderstudyError(f"logit_bias keys must be token ids >= 0, got {token!r}")
            if not _is_real(bias) or not -100.0 <= bias <= 100.0:
                raise UnderstudyError(f"logit_bias values must be in [-100, 100], got {bias!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise UnderstudyError(
                f"min_tokens must be an integer in 0..max_tokens ({self.max_tokens}), "
                f"got {self.min_tokens!r}"
            )
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise UnderstudyError(
                f"stop_token_ids must be token ids >= 0, got {self.stop_token_ids!r}"
            )
        if self.structured is not None and self.ignore_eos:
            raise UnderstudyError(
                "structured output ends with EOS once its grammar is complete: "
                "it cannot be combined with ignore_eos"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def parse_num_speculative_tokens(value: int | str) -> int | Literal["auto"]:
    """Validate K: an int in 1..64, or "auto"."""
    if isinstance(value, str):
        if value == "auto":
            return "auto"
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


def parse_option_value(text: str) -> object:
    """A drafter option's value as typed on a command line: true/false -> bool, none ->
    None, else an int, a float, or the text itself ("auto", "suffix", ...)."""
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_options(pairs: list[str], what: str = "--option") -> dict[str, object]:
    """["prompt_lookup_max=3", "hybrid_free=ngram"] -> {"prompt_lookup_max": 3, ...}: the one
    parser of drafter options, for the CLI's --option and the bench's method specs."""
    options: dict[str, object] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise UnderstudyError(f"{what} takes key=value, got {pair!r}")
        options[key] = parse_option_value(raw)
    return options
