"""Rotary position embeddings: the inverse frequencies of each scaling scheme, decided once.

The rotation of a query or key at position p is fixed by `inv_freq` [rotary_dim / 2] and a
cos/sin multiplier (`attention_factor`); the schemes below only change those two, never the
way they are applied, so the hot path has no branch on the scheme. The formulas follow
transformers' `modeling_rope_utils` (Su et al. 2021 RoFormer; Peng et al. 2023 YaRN; Ding et
al. 2024 LongRoPE; Meta's Llama 3.1 scaling), operation by operation in float32, so the
frequencies are those of the reference implementation.

Two schemes depend on the length of the sequence in transformers. "dynamic" (NTK) recomputes
the base from the length of each forward pass (its largest position + 1) once that passes
`max_position_embeddings`; "longrope" takes the long factors instead of the short ones for a
whole pass once it reaches past `original_max_position_embeddings`. Past that length the
frequencies belong to the pass, not to the position, and there is no single answer to be
exact to: transformers' own generate() keeps the keys it cached under the earlier frequencies
and rotates new ones under the later, while its forward over the same tokens rotates all of
them under the later; and a verification pass of K+1 rows would see another length than
plain decoding's one-row pass, so speculative output would stop being plain decoding's.
Below that length every pass of either scheme uses one fixed set of frequencies (plain rope
for "dynamic", the short factors for "longrope"), which is what is built here, and all those
paths agree. So `exact_positions` records that length, and the engine's context ends there
(engine/builder.py lowers max_context to it, with a warning naming it): a context that would
cross the switch is not decoded at all, rather than decoded unlike transformers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import torch

ROPE_KINDS = ("linear", "dynamic", "yarn", "llama3", "longrope")  # transformers' rope_type
# a GGUF file's own: llama.cpp divides each frequency by the file's rope_freqs (Llama 3.1+
# files carry their llama3 scaling so, and no rope_type transformers' reader would map)
FILE_KINDS = ("divisors",)


class UnsupportedRope(ValueError):
    pass


@dataclass(frozen=True)
class RopeScaling:
    """One scaling scheme and its parameters (None = the scheme's default)."""

    kind: str  # one of ROPE_KINDS
    factor: float | None = None
    original_max_positions: int | None = None  # the pretraining context (yarn, llama3, longrope)
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    beta_fast: float | None = None  # yarn: the extrapolation boundary (default 32)
    beta_slow: float | None = None  # yarn: the interpolation boundary (default 1)
    mscale: float | None = None  # yarn (DeepSeek-style attention factor)
    mscale_all_dim: float | None = None
    truncate: bool = True  # yarn: round the correction range to whole dimensions
    attention_factor: float | None = None  # cos/sin multiplier; None = the scheme's own
    short_factor: tuple[float, ...] | None = None  # longrope, one per frequency
    long_factor: tuple[float, ...] | None = None
    divisors: tuple[float, ...] | None = None  # divisors: one per frequency

    def __post_init__(self) -> None:
        if self.kind not in ROPE_KINDS + FILE_KINDS:
            raise UnsupportedRope(f"rope scaling {self.kind!r} is not supported")
        for name in ("short_factor", "long_factor", "divisors"):  # lists after a JSON round trip
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(float(v) for v in value))


def rope_scaling_from_hf(params: dict[str, Any] | None) -> RopeScaling | None:
    """A transformers `rope_parameters` dict -> RopeScaling (None for plain rope)."""
    params = params or {}
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind == "default":
        return None
    if kind not in ROPE_KINDS:
        raise UnsupportedRope(f"rope scaling {kind!r} is not supported")
    names = {f.name for f in fields(RopeScaling)}
    renamed = {"original_max_position_embeddings": "original_max_positions"}
    values = {renamed.get(k, k): v for k, v in params.items() if renamed.get(k, k) in names}
    values.pop("kind", None)
    return RopeScaling(kind=kind, **values)


def _base_freqs(theta: float, dim: int) -> torch.Tensor:
    """theta ** (2i / dim) for i < dim / 2, float32 [dim / 2] (transformers' exact ops)."""
    return theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)


def _yarn(theta: float, dim: int, s: RopeScaling, max_positions: int) -> tuple[torch.Tensor, float]:
    original = s.original_max_positions or max_positions
    factor = s.factor if s.factor is not None else max_positions / original

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention = s.attention_factor
    if attention is None:
        if s.mscale and s.mscale_all_dim:
            attention = float(get_mscale(factor, s.mscale) / get_mscale(factor, s.mscale_all_dim))
        else:
            attention = get_mscale(factor)
    beta_fast, beta_slow = s.beta_fast or 32, s.beta_slow or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singularity
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # share of each frequency left unscaled
    return interpolation * (1 - keep) + extrapolation * keep, attention


def _llama3(theta: float, dim: int, s: RopeScaling) -> torch.Tensor:
    inv_freq = 1.0 / _base_freqs(theta, dim)
    factor, low, high = s.factor, s.low_freq_factor, s.high_freq_factor
    old = s.original_max_positions
    assert factor is not None and low is not None and high is not None and old is not None
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) * ~(wavelen > old / low)
    return torch.where(medium, smoothed, scaled)


def _longrope(
    theta: float, dim: int, s: RopeScaling, max_positions: int
) -> tuple[torch.Tensor, float]:
    original = s.original_max_positions or max_positions
    factor = s.factor if s.factor is not None else max_positions / original
    attention = s.attention_factor
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    assert s.short_factor is not None
    short = torch.tensor(s.short_factor, dtype=torch.float32)  # [dim / 2]
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (short * theta**shape), attention


def rope_frequencies(
    theta: float, dim: int, scaling: RopeScaling | None, max_positions: int
) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim / 2] float32, attention_factor) for rotary dimension `dim`."""
    if scaling is None or scaling.kind == "dynamic":  # dynamic: plain below max_positions
        return 1.0 / _base_freqs(theta, dim), 1.0
    if scaling.kind == "linear":
        assert scaling.factor is not None
        return 1.0 / _base_freqs(theta, dim) / scaling.factor, 1.0
    if scaling.kind == "llama3":
        return _llama3(theta, dim, scaling), 1.0
    if scaling.kind == "divisors":
        assert scaling.divisors is not None and len(scaling.divisors) == dim // 2
        return 1.0 / _base_freqs(theta, dim) / torch.tensor(scaling.divisors), 1.0
    if scaling.kind == "yarn":
        return _yarn(theta, dim, scaling, max_positions)
    return _longrope(theta, dim, scaling, max_positions)


def exact_positions(scaling: RopeScaling | None, max_positions: int) -> int | None:
    """The context up to which these frequencies are transformers' for every pass (None: any)."""
    if scaling is None or scaling.kind not in ("dynamic", "longrope"):
        return None
    if scaling.kind == "dynamic":
        return max_positions
    return scaling.original_max_positions or max_positions


class Rotary:
    """cos/sin of one rope at given positions; applies it to the first `dim` features."""

    def __init__(
        self, theta: float, dim: int, scaling: RopeScaling | None, max_positions: int
    ) -> None:
        self.dim = dim
        with torch.device("cpu"):  # not a weight: real even when the model is built on "meta"
            freqs = rope_frequencies(theta, dim, scaling, max_positions)
        self.inv_freq, self.attention_factor = freqs  # [dim / 2] float32, cos/sin multiplier

    def __call__(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [R, dim] in `dtype`, for positions [R]."""
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None]  # [R, dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [R, dim]
        if self.attention_factor == 1.0:
            return emb.cos().to(dtype), emb.sin().to(dtype)
        f = self.attention_factor
        return (emb.cos() * f).to(dtype), (emb.sin() * f).to(dtype)
