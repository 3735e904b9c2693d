"""Decode rows' attention in one call, each row over its own run of keys (span_attention.c).

Why: a pass of R decode rows used to run R small torch attention calls per layer (each row
must see exactly its own keys, with the shapes of a one-row pass, for row invariance); at 16
rows that was ~13% of a target pass on a 2-core CPU, and ~10% of a one-row pass. The C
kernel scores every (row, head) pair by one fixed sequence of float operations, so a row's
output is bitwise the same alone or among others, and however the pairs are split over
threads (the kernel's header comment). Float32 on a CPU only; elsewhere models/attention.py
keeps its torch path.
"""

from __future__ import annotations

import ctypes
import os
from functools import cache
from pathlib import Path

import torch

from understudy.cache import cache_dir
from understudy.kernels.build import VECTOR_FLAGS, open_library

SOURCE = Path(__file__).with_name("span_attention.c")


@cache
def load(flags: tuple[str, ...] = VECTOR_FLAGS) -> ctypes.CDLL | None:
    """span_attention.c compiled with `flags` (default: for this CPU), building it if needed;
    None when it cannot be built."""
    lib = open_library(SOURCE, cache_dir() / "kernels", flags)
    if lib is None:
        return None
    ptr, long = ctypes.c_void_p, ctypes.c_long
    lib.understudy_span_attention.argtypes = (
        [ptr, long, long, ptr, ptr, long, long, long, ctypes.c_int, ptr, long, long]
        + [long] * 4
        + [ctypes.c_float, ctypes.c_float, ptr, ctypes.c_int]
    )
    lib.understudy_span_attention.restype = ctypes.c_int
    return lib


def available() -> bool:
    """Whether models use the kernel: it builds here and $UNDERSTUDY_SPAN_ATTENTION is not "0"."""
    return os.environ.get("UNDERSTUDY_SPAN_ATTENTION", "1") != "0" and load() is not None


NOT_ONE_RUN = 4  # the kernel's answer when a row's visible keys are not one run
LANES = 16  # the kernel sums a head's features 16 at a time: a head size is a multiple of it


def refusal(heads: int, kv_heads: int, dim: int) -> str | None:
    """Why the kernel cannot take heads of this shape, in a few words (None: it can)."""
    if dim % LANES:
        return f"head size {dim} is not a multiple of span_attention's {LANES} lanes"
    if heads % kv_heads:
        return f"{heads} query heads do not split evenly over {kv_heads} kv heads"
    return None


def span_attention(
    q: torch.Tensor,  # [H, R, D] float32 (any strides, D contiguous)
    keys: torch.Tensor,  # [B, Hkv, L, D], B = 1 (shared by all rows) or R (one per row)
    values: torch.Tensor,  # [B, Hkv, L, D], the strides of keys
    mask: torch.Tensor,  # [R, L] bool: row r sees key j
    scale: float,
    lib: ctypes.CDLL | None = None,  # default: load()
    softcap: float | None = None,  # scores capped to softcap * tanh(s / softcap) (Gemma 2)
) -> torch.Tensor | None:
    """softmax(q k^T * scale) v for each row over the keys its mask row shows -> [R, H, D]
    float32; None, having computed nothing, when some row's visible keys are not one run.
    Heads of a shape `refusal` names are the caller's to keep away."""
    lib = lib or load()
    assert lib is not None, "span_attention could not be built"
    heads, rows, dim = q.shape
    batch, kv_heads, length, _ = keys.shape
    assert q.dtype == keys.dtype == values.dtype == torch.float32, (q.dtype, keys.dtype)
    assert q.stride(-1) == keys.stride(-1) == 1 and keys.stride() == values.stride()
    assert batch in (1, rows) and mask.shape == (rows, length) and mask.dtype == torch.bool
    if mask.stride(-1) != 1:
        mask = mask.contiguous()
    out = torch.empty(rows, heads, dim, dtype=torch.float32)
    code = lib.understudy_span_attention(
        q.data_ptr(), q.stride(1), q.stride(0),
        keys.data_ptr(), values.data_ptr(), keys.stride(0), keys.stride(1), keys.stride(2),
        int(batch > 1), mask.data_ptr(), mask.stride(0), length,
        rows, heads, kv_heads, dim, scale, softcap or 0.0, out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    if code == NOT_ONE_RUN:
        return None
    assert code == 0, f"span_attention refused its arguments ({code})"
    return out
