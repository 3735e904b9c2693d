"""A row-invariant float32 matmul for CPUs, compiled on first use (kernels/rowgemm.c).

Why: torch's CPU matmuls pick their kernel and blocking by the number of rows, so a row's
logits scored among K others differ in the last bits from the same row scored alone, and a
verifier's near-ties can flip (docs/design.md, section 2). rowgemm.c
computes every output as one sequential chain of fused multiply-adds over the reduction
dimension, whatever the number of rows: a row's result is bitwise independent of its
companions by construction. So the target needs no padding: plain decoding scores 1 row,
verification K+1, and both agree bitwise.

The C source is compiled once per machine (kernels/build.py, `-O3 -march=native`). Without
a compiler, or where that fails, `load()` returns None and the engine falls back to padded
passes (engine/builder.py), as it does with UNDERSTUDY_ROWGEMM=0.
"""

from __future__ import annotations

import ctypes
import os
from functools import cache
from pathlib import Path

import torch
from torch import nn

from understudy.cache import cache_dir
from understudy.kernels.build import open_library

SOURCE = Path(__file__).with_name("rowgemm.c")
LANES = 16  # output columns per packed block (rowgemm.c)
FLAGS = ("-O3", "-march=native", "-fopenmp")  # its FMA chain is written out: no contract flag


@cache
def load() -> ctypes.CDLL | None:
    """The compiled kernel library, building it if needed; None when it cannot be built."""
    lib = open_library(SOURCE, cache_dir() / "kernels", FLAGS)
    if lib is None:
        return None
    lib.understudy_rowgemm.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int]
    lib.understudy_rowgemm.restype = ctypes.c_int
    return lib


def available() -> bool:
    """Whether engines use the kernel: it builds here and $UNDERSTUDY_ROWGEMM is not "0" (the
    switch back to padded passes, for comparison)."""
    return os.environ.get("UNDERSTUDY_ROWGEMM", "1") != "0" and load() is not None


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N/16), K, 16] float32 (zero columns pad the last block)."""
    n, k = weight.shape
    pad = (-n) % LANES
    w = weight.detach().float()
    if pad:
        w = torch.cat([w, w.new_zeros(pad, k)])
    return w.view(-1, LANES, k).transpose(1, 2).contiguous()


class RowInvariantLinear(nn.Module):
    """y = x W^T + b for float32 on a CPU, each output one FMA chain (see module docstring)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        lib = load()
        assert lib is not None, "rowgemm could not be built"
        self._fn = lib.understudy_rowgemm
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = pack_weight(linear.weight)  # [blocks, in, 16]
        self.bias = None if linear.bias is None else linear.bias.detach().float().clone()

    @property
    def weight(self) -> torch.Tensor:
        """The weight [out, in] as a dense tensor: a COPY (for exporting, e.g. to transformers)."""
        return self.packed.transpose(1, 2).reshape(-1, self.in_features)[: self.out_features]

    def weight_rows(self, index: torch.Tensor) -> torch.Tensor:
        """W[index] [n, in] (a copy), without densifying the whole weight."""
        index = index.cpu()
        return self.packed[index // LANES, :, index % LANES].clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [R, in] -> [R, out]
        assert x.dtype == torch.float32 and x.device.type == "cpu", (x.dtype, x.device)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).contiguous()  # [M, in]
        y = torch.empty(x2.shape[0], self.out_features, dtype=torch.float32)  # [M, out]
        bias = 0 if self.bias is None else self.bias.data_ptr()
        self._fn(
            x2.data_ptr(),
            self.packed.data_ptr(),
            bias,
            y.data_ptr(),
            x2.shape[0],
            self.in_features,
            self.out_features,
            torch.get_num_threads(),
        )
        return y.view(*lead, self.out_features)


def use_row_invariant_linears(model: nn.Module) -> int:
    """Replace every float32 CPU nn.Linear of `model` by a RowInvariantLinear, in place;
    returns how many. The model's other tensors are cloned so the loaded checkpoint's
    memory-mapped pages are released (as models/packed.py does)."""
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, name, RowInvariantLinear(child))
                count += 1
    if count:
        for param in model.parameters():
            param.data = param.data.clone()
    return count
