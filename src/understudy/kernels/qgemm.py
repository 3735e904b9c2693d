"""Linear layers and embeddings that run from a GGUF file's own quantized blocks
(kernels/qgemm.c), row-invariant by construction.

Why: a 4-bit target reads ~0.9 GB of weights a pass instead of 6 GB of float32. qgemm.c
quantizes each activation row to int8 with its own scales, multiplies with exact integer
dot products block by block, and combines the float block scales in one fixed order, so a
row's output is bitwise the same whatever the number of rows in the call and however the
columns are split across threads: verification of K+1 rows agrees bitwise with plain
decoding's 1-row passes, with no padding (as kernels/rowgemm.py does for float32).

Kernel types (KERNEL_TYPES): the k-quants Q2_K to Q6_K and IQ4_XS (256 values a block); Q8_0,
Q5_0, Q5_1, Q4_0, Q4_1 and IQ4_NL (32); F16 and BF16, multiplied in float32 in one fixed
order (no activation quantization). A tensor of another type (F32, the IQ2/IQ3 families) is
dequantized to float32 once, at load, and runs through rowgemm (also row-invariant).
Each kernel tensor is repacked once, at load, into the kernel's panels of 16 columns (`pack`:
the file's bytes, rearranged, so a one-row pass streams no more than the file holds); the GGUF
rows stay mapped for `weight_rows`, their pages released.

The C source is compiled once per machine (kernels/build.py); `load()` is None where that
fails, and the engine then runs the model dense.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, dequantize
from torch import nn

from understudy.cache import cache_dir
from understudy.kernels import rowgemm
from understudy.kernels.build import NATIVE_FLAGS, compile_shared

SOURCE = Path(__file__).with_name("qgemm.c")
KERNEL_TYPES = frozenset(
    GGMLQuantizationType[name]
    for name in (
        *("Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K", "IQ4_XS"),  # 256 values a block
        *("Q8_0", "Q5_0", "Q5_1", "Q4_0", "Q4_1", "IQ4_NL"),  # 32
        *("F16", "BF16"),  # 2-byte floats, multiplied in float32 (qgemm_float.h)
    )
)


def bind(path: Path) -> ctypes.CDLL | None:
    """The compiled library at `path` with its entry points typed; None if it will not load."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError:
        return None
    ptr, long = ctypes.c_void_p, ctypes.c_long
    lib.understudy_qgemm.argtypes = [ctypes.c_int, ptr, ptr, ptr, ptr] + [long] * 4
    lib.understudy_qgemm.argtypes += [ctypes.c_int]
    lib.understudy_qgemm.restype = ctypes.c_int
    lib.understudy_qgemm_parts.argtypes = [long] + [ptr] * 7 + [long] * 3 + [ctypes.c_int]
    lib.understudy_qgemm_parts.restype = ctypes.c_int
    lib.understudy_qpack_bytes.argtypes = [ctypes.c_int, long, long]
    lib.understudy_qpack_bytes.restype = long
    lib.understudy_qpack.argtypes = [ctypes.c_int, ptr, long, long, long, ptr, ctypes.c_int]
    lib.understudy_qpack.restype = ctypes.c_int
    lib.understudy_qdequant_rows.argtypes = [ctypes.c_int, ptr, long, ptr, long, long, ptr]
    lib.understudy_qdequant_rows.restype = ctypes.c_int
    lib.understudy_requant_q4_0.argtypes = [ctypes.c_int, ptr, long, long, long, ptr, ctypes.c_int]
    lib.understudy_requant_q4_0.restype = ctypes.c_int
    return lib


@cache
def load(flags: tuple[str, ...] = NATIVE_FLAGS) -> ctypes.CDLL | None:
    """qgemm.c compiled with `flags` (default: for this CPU), building it if needed; None
    when it cannot be built."""
    built = compile_shared(SOURCE, cache_dir() / "kernels", flags)
    return None if built is None else bind(built)


def available() -> bool:
    """Whether models may run from GGUF blocks here: the kernel builds and rowgemm (for the
    other tensor types) is available, and $UNDERSTUDY_QGEMM is not "0"."""
    return (
        os.environ.get("UNDERSTUDY_QGEMM", "1") != "0"
        and load() is not None
        and rowgemm.available()
    )


@dataclass(frozen=True)
class GGUFTensor:
    """A 2-D GGUF tensor [rows, cols] (ours: [out, in]) as the file holds it: `data` is
    [rows, row_bytes] uint8 for block types and BF16, [rows, cols] float for F32/F16."""

    kind: GGMLQuantizationType
    data: np.ndarray
    rows: int
    cols: int

    @property
    def row_bytes(self) -> int:
        """Bytes from one row of `data` to the next (its rows are contiguous)."""
        return self.data.shape[1] * self.data.itemsize

    def dequantized(self, index: np.ndarray | None = None) -> torch.Tensor:
        """The rows `index` (all by default) as float32 [n, cols] (gguf's reference code)."""
        data = self.data if index is None else self.data[index]
        out = dequantize(data, self.kind)  # [n, cols] float32 (float16 for F16)
        return torch.from_numpy(np.array(out, dtype=np.float32).reshape(-1, self.cols))  # a copy

    def take_rows(self, index: np.ndarray) -> GGUFTensor:
        """This tensor with its rows reordered (a copy): rows are independent blocks."""
        return GGUFTensor(self.kind, np.ascontiguousarray(self.data[index]), len(index), self.cols)


def pack(lib: ctypes.CDLL, part: GGUFTensor) -> np.ndarray:
    """`part`'s blocks in the kernel's panel layout (qgemm.c, understudy_qpack): 16 columns'
    blocks side by side, the same bytes rearranged; a fresh 64-byte-aligned array."""
    size = lib.understudy_qpack_bytes(int(part.kind), part.cols, part.rows)
    assert size > 0, f"qgemm refused a {part.kind.name} tensor of {part.cols} columns"
    buffer = np.empty(size + 64, dtype=np.uint8)
    offset = -buffer.ctypes.data % 64
    packed = buffer[offset : offset + size]
    code = lib.understudy_qpack(
        int(part.kind), part.data.ctypes.data, part.row_bytes, part.cols, part.rows,
        packed.ctypes.data, torch.get_num_threads(),
    )  # fmt: skip
    assert code == 0, f"qgemm refused a {part.kind.name} tensor ({code}): rows cut short?"
    release_pages(part.data)
    return packed


MADV_DONTNEED = 4  # Linux's madvise advice: drop these pages; a later read faults them in


@cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def release_pages(data: np.ndarray) -> None:
    """Drop the whole pages under a read-only memory-mapped `data` from this process's
    resident memory, after packing: the panels are what the kernel reads, and the file's
    bytes stay readable (weight_rows), faulted in again from the page cache if touched.
    Only for memory maps (a Linux madvise): arrays of the process's own memory are kept."""
    array: object = data
    while isinstance(array, np.ndarray) and not isinstance(array, np.memmap):
        array = array.base  # a view's owner, up to the memory map (or None)
    libc = _libc()
    if not isinstance(array, np.memmap) or libc is None or data.flags.writeable:
        return
    page = os.sysconf("SC_PAGE_SIZE")
    start = -(-data.ctypes.data // page) * page  # the first whole page inside
    end = (data.ctypes.data + data.nbytes) // page * page
    if end > start:
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DONTNEED)


class QuantLinear(nn.Module):
    """y = x W^T + b, float32 on a CPU, W the concatenation (along out) of GGUF tensors in
    their own blocks: row-invariant (module docstring). Parts of types outside KERNEL_TYPES
    run dequantized through rowgemm."""

    def __init__(
        self, parts: list[GGUFTensor], bias: torch.Tensor | None, lib: ctypes.CDLL | None = None
    ) -> None:
        """`lib`: the qgemm build that packs and runs it (default: this CPU's, load()); a
        build's panel layout is its own."""
        super().__init__()
        lib = lib or load()
        assert lib is not None, "qgemm could not be built"
        self._fn = lib.understudy_qgemm
        self._dequant = lib.understudy_qdequant_rows
        self.in_features = parts[0].cols
        assert all(p.cols == self.in_features for p in parts), [p.cols for p in parts]
        assert all(p.data.flags["C_CONTIGUOUS"] for p in parts), "rows of blocks must be contiguous"
        self.parts = parts
        self.out_features = sum(p.rows for p in parts)
        self.bias = None if bias is None else bias.detach().float().contiguous().clone()  # [out]
        assert self.bias is None or self.bias.shape == (self.out_features,)
        self.dense = nn.ModuleDict()  # str(part index) -> RowInvariantLinear
        for i, part in enumerate(parts):
            if part.kind not in KERNEL_TYPES:
                linear = nn.Linear(part.cols, part.rows, bias=False)
                linear.weight.data = part.dequantized()
                self.dense[str(i)] = rowgemm.RowInvariantLinear(linear)
        # each block part repacked into the kernel's panels (the GGUF rows stay for
        # weight_rows), and the kernel's arguments worked out once (a decode pass makes
        # ~200 of these calls: per-call Python work is a visible share of it)
        self.packed: list[np.ndarray] = []
        self.kernel_calls: list[tuple[int, int, int, int, int]] = []  # kind, w, b, at, n
        start = 0
        for i, part in enumerate(parts):
            if str(i) not in self.dense:
                packed = pack(lib, part)
                self.packed.append(packed)
                bias = 0 if self.bias is None else self.bias.data_ptr() + 4 * start
                self.kernel_calls.append(
                    (int(part.kind), packed.ctypes.data, bias, 4 * start, part.rows)
                )
            start += part.rows

    def _part_rows(self, i: int, part: GGUFTensor, index: torch.Tensor) -> torch.Tensor:
        if str(i) in self.dense:
            return self.dense[str(i)].weight_rows(index)
        idx = index.to(torch.long).contiguous()
        out = torch.empty(idx.shape[0], part.cols, dtype=torch.float32)  # [n, in]
        code = self._dequant(
            int(part.kind), part.data.ctypes.data, part.row_bytes, idx.data_ptr(),
            idx.shape[0], part.cols, out.data_ptr(),
        )  # fmt: skip
        assert code == 0, code
        return out

    def weight_rows(self, index: torch.Tensor) -> torch.Tensor:
        """W[index] [n, in] float32 (a copy), dequantizing only those rows."""
        index = index.cpu().to(torch.long)
        out = torch.empty(index.shape[0], self.in_features, dtype=torch.float32)
        start = 0
        for i, part in enumerate(self.parts):
            inside = (index >= start) & (index < start + part.rows)
            if inside.any():
                out[inside] = self._part_rows(i, part, index[inside] - start)
            start += part.rows
        return out

    @property
    def weight(self) -> torch.Tensor:
        """The weight [out, in] dequantized: a COPY (for exporting, e.g. to transformers)."""
        return self.weight_rows(torch.arange(self.out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [R, in] -> [R, out]
        assert x.dtype == torch.float32 and x.device.type == "cpu", (x.dtype, x.device)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).contiguous()  # [M, in]
        rows = x2.shape[0]
        y = torch.empty(rows, self.out_features, dtype=torch.float32)  # [M, out]
        threads, x_at, y_at = torch.get_num_threads(), x2.data_ptr(), y.data_ptr()
        for kind, weight, bias, at, part_rows in self.kernel_calls:
            code = self._fn(kind, x_at, weight, bias, y_at + at, self.out_features, rows,
                            self.in_features, part_rows, threads)  # fmt: skip
            assert code == 0, f"qgemm refused a {GGMLQuantizationType(kind).name} part ({code})"
        if len(self.dense):
            start = 0
            for i, part in enumerate(self.parts):
                if str(i) in self.dense:
                    y[:, start : start + part.rows] = self.dense[str(i)](x2)
                    if self.bias is not None:
                        y[:, start : start + part.rows] += self.bias[start : start + part.rows]
                start += part.rows
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        kinds = "+".join(p.kind.name for p in self.parts)
        return f"in_features={self.in_features}, out_features={self.out_features}, {kinds}"


class QuantEmbedding(nn.Module):
    """Token embedding from GGUF blocks: a lookup dequantizes only the looked-up rows."""

    def __init__(self, table: GGUFTensor) -> None:
        super().__init__()
        self.table = QuantLinear([table], None)  # [vocab, hidden] as rows
        self.num_embeddings, self.embedding_dim = table.rows, table.cols

    @property
    def weight(self) -> torch.Tensor:
        """The table [vocab, hidden] dequantized: a COPY (for exporting)."""
        return self.table.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # [R] -> [R, hidden]
        return self.table.weight_rows(tokens.reshape(-1)).view(*tokens.shape, self.embedding_dim)
