"""RMS normalisation in the two forms the supported families use (Zhang & Sennrich 2019).

Both normalise in float32 and are row-wise (a row's output depends on that row alone). They
differ where the weight is applied, which matters in bfloat16 and so is kept as each family
does it:

- RMSNorm (Llama, Qwen, Mistral, Phi-3): weight * normed.to(dtype), the weight as stored;
- OffsetRMSNorm (Gemma): (normed * (1 + weight)).to(dtype), in float32, the stored weight
  being an offset from one (transformers' Gemma*RMSNorm).
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim]
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class OffsetRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim]
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).type_as(x)


def make_norm(dim: int, eps: float, unit_offset: bool) -> nn.Module:
    """The family's norm, chosen once at build time."""
    return OffsetRMSNorm(dim, eps) if unit_offset else RMSNorm(dim, eps)


def norm_scale(norm: nn.Module) -> torch.Tensor:
    """The per-dimension factor `norm` applies after normalising: its weight, or 1 + weight
    for OffsetRMSNorm (a copy)."""
    weight = norm.weight.detach()
    return 1.0 + weight if isinstance(norm, OffsetRMSNorm) else weight.clone()
