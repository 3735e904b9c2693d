"""draft_quantization="q4_0" for a draft that runs from its GGUF blocks: its Q5_0 tensors
requantized to Q4_0 at load.

Why: a draft step on a CPU streams every weight of the draft once, and one-row kernel calls
read about as many bytes a second whatever their type; the default 0.5B draft's Q4_K_M file
holds most of its layers in Q5_0 (their 896-value rows are not a multiple of the k-quants'
256), 22 bytes for 32 weights, where Q4_0 takes 18. Its head stays Q8_0: requantized too, it
kept fewer guesses on the shipped code prompts.

Lossless: only the draft's proposals change; verification against the target decides every
token, so greedy output and the sampling law are the target's.

How: qgemm.c's understudy_requant_q4_0, bitwise what gguf's reference quantizer
(gguf.quants: each 32-value block's scale from its largest magnitude, round to nearest)
makes of the values gguf dequantizes, on the OpenMP threads: the default draft in ~1 s with
its repacking, where gguf's numpy code took ~7 s.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from understudy.kernels.qgemm import GGUFTensor, QuantLinear, load

SCHEME = "q4_0"
REQUANTIZED = {GGMLQuantizationType.Q5_0: GGMLQuantizationType.Q4_0}


def requantized(part: GGUFTensor, lib: ctypes.CDLL) -> GGUFTensor:
    """`part` in its REQUANTIZED type (itself where it has none); `lib`: qgemm's build."""
    kind = REQUANTIZED.get(part.kind)
    if kind is None:
        return part
    block, size = GGML_QUANT_SIZES[kind]
    out = np.empty((part.rows, part.cols // block * size), dtype=np.uint8)
    data = np.ascontiguousarray(part.data)
    code = lib.understudy_requant_q4_0(
        int(part.kind), data.ctypes.data, data.shape[1], part.cols, part.rows, out.ctypes.data,
        torch.get_num_threads(),
    )  # fmt: skip
    assert code == 0, f"qgemm cannot requantize a {part.kind.name} tensor of {part.cols} columns"
    return GGUFTensor(kind, out, part.rows, part.cols)


def requantize_linears(model: nn.Module) -> int:
    """Replace every QuantLinear of `model` holding a part of a REQUANTIZED type by one of
    the same parts requantized (and repacked). Returns the count replaced."""
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, QuantLinear) and any(p.kind in REQUANTIZED for p in module.parts)
    ]
    lib = load()
    assert lib is not None, "qgemm could not be built"
    for name, module in targets:
        new = QuantLinear([requantized(p, lib) for p in module.parts], module.bias)
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, new)
    return len(targets)
