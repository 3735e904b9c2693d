"""Prepacked CPU linear layers for the target: a verification pass of several rows at the
price of little more than one.

`F.linear` on a CPU runs a matrix-vector kernel for 1-3 rows and switches to a general
matmul from 4 rows on, which repacks the weight on every call: on the 1.5B target a pass of
4 rows costs ~1.8x a pass of 3 (docs/design.md, section 2). oneDNN can
pack each weight ONCE, in the blocked layout its matmul wants, and then a pass of 4-6 rows
costs about what 3 rows cost unpacked. We pack the target's linears at load when its row
budget is >= 4.

Invariant kept: within one call of a fixed number of rows, a row's result does not depend on
the other rows (tests/test_exactness.py proves it through the engine), so the fixed-rows
design of runner.py holds with packed weights as well.
"""

from __future__ import annotations

import torch
from torch import nn

PACK_FROM_ROWS = 4  # below this F.linear's matrix-vector path is as fast (measured)


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN can prepack this dtype here: float32 on any CPU; bfloat16 only where
    its bf16 reorder runs (AVX512-BW/VL/DQ or AVX-NE-CONVERT; it raises elsewhere)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return (
            cpu_flags() >= {"avx512bw", "avx512vl", "avx512dq"} or "avx_ne_convert" in cpu_flags()
        )
    return dtype == torch.float32


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


class PackedLinear(nn.Module):
    """y = x W^T + b with W held in oneDNN's blocked layout (packed for `rows`-row calls)."""

    def __init__(self, linear: nn.Linear, rows: int) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)  # [out, in], mkldnn
        self.bias = None if linear.bias is None else linear.bias.detach()  # [out]

    @property
    def weight(self) -> torch.Tensor:
        """The weight [out, in] as a dense tensor: a COPY (for exporting, e.g. to transformers)."""
        return self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [R, in] -> [R, out]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears(model: nn.Module, rows: int) -> int:
    """Replace every nn.Linear of `model` by a PackedLinear, in place; returns how many.
    Idempotent: layers packed already are left alone. The other tensors (embedding, norms,
    biases) are copied too, so nothing refers to the loaded, memory-mapped checkpoint any more
    and its pages are released (measured on the 1.5B target: RSS 12.8 GB -> 7.5 GB)."""
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, name, PackedLinear(child, rows))
                count += 1
    if count:
        for param in model.parameters():
            param.data = param.data.clone()
        for module in model.modules():
            if isinstance(module, PackedLinear) and module.bias is not None:
                module.bias = module.bias.clone()
    return count
