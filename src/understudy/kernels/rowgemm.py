"""A row-invariant float32 matmul for CPUs, compiled on first use (kernels/rowgemm.c).

Why: torch's CPU matmuls pick their kernel and blocking by the number of rows, so a row's
logits scored among K others differ in the last bits from the same row scored alone, and a
verifier's near-ties can flip (README, "Identical output by construction"). rowgemm.c
computes every output as one sequential chain of fused multiply-adds over the reduction
dimension, whatever the number of rows: a row's result is bitwise independent of its
companions by construction. So the target needs no padding: plain decoding scores 1 row,
verification K+1, and both agree bitwise.

The C source is compiled once per machine with the system C compiler (`cc`, or `$CC`),
`-O3 -march=native`, into the understudy cache, keyed by a hash of the source, the compiler
and the CPU's flags. Without a compiler, or off x86/ARM Linux-like systems where that fails,
`load()` returns None and the engine falls back to padded passes (factory.py), as it does
with UNDERSTUDY_ROWGEMM=0.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch
from torch import nn

from understudy.models.fetch import cache_dir

SOURCE = Path(__file__).with_name("rowgemm.c")
LANES = 16  # output columns per packed block (rowgemm.c)


def _cpu_signature() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
        flags = next(line for line in text.splitlines() if line.startswith(("flags", "Features")))
    except (OSError, StopIteration):
        flags = platform.processor()
    return f"{platform.machine()} {flags}"


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def build(compiler: str, folder: Path) -> Path | None:
    """Compile rowgemm.c into `folder` (once: the file name holds a hash of the source, the
    compiler and the CPU's flags); None if the compiler fails."""
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + compiler.encode() + _cpu_signature().encode()).hexdigest()[:16]
    target = folder / f"rowgemm-{key}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        built = Path(tmp) / target.name
        command = [
            compiler,
            "-O3",
            "-march=native",
            "-fopenmp",
            "-fPIC",
            "-shared",
            "-o",
            str(built),
            str(SOURCE),
            "-lm",
        ]
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired):
            return None
        if result.returncode != 0:
            return None
        os.replace(built, target)  # atomic: concurrent builders never see a partial file
    return target


@cache
def load() -> ctypes.CDLL | None:
    """The compiled kernel library, building it if needed; None when it cannot be built."""
    compiler = _compiler()
    built = None if compiler is None else build(compiler, cache_dir() / "kernels")
    if built is None:
        return None
    try:
        lib = ctypes.CDLL(str(built))
    except OSError:
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
