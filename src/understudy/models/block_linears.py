"""draft_quantization="q8_0" or "q4_0" for method=eagle's head: its dense linears quantized
to GGUF blocks at load and run by kernels/qgemm, the target's own kernels.

Why: a head step reads each of the head's weights once, about 42M of them for the packaged
target's head, so it should cost what streaming them costs: ~24 MB in Q4_0, against the ~1 GB
of a target pass. torch's int4 kernel (models/quant.py) at one row spent ~0.5 ms a call on a
2-core CPU, two thirds of a head step; qgemm's calls stream at the memory's rate.

Lossless: the head only drafts. The target verifies every guess, so greedy output and the
sampling law are the target's whatever the head's weights hold.

How: gguf's reference quantizer (gguf.quants.quantize: each 32-value block's scale from its
largest magnitude, round to nearest) on the float32 weights, then QuantLinear packs the
blocks into the kernel's panels. Linears whose input width is not a multiple of 32 stay.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from torch import nn

from understudy.kernels.qgemm import GGUFTensor, QuantLinear

BLOCK_SCHEMES = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0}
BLOCK = 32  # values per Q8_0 / Q4_0 block


def block_linear(linear: nn.Linear, kind: GGMLQuantizationType) -> QuantLinear:
    """`linear` [out, in] with its weight in `kind`'s blocks (its bias kept in float32)."""
    weight = linear.weight.detach().float().cpu().numpy()  # [out, in]
    blocks = np.ascontiguousarray(quantize(weight, kind))  # [out, in / 32 * block bytes]
    part = GGUFTensor(kind, blocks, weight.shape[0], weight.shape[1])
    bias = None if linear.bias is None else linear.bias.detach().float().cpu()
    return QuantLinear([part], bias)


def block_linears(model: nn.Module, scheme: str) -> int:
    """Replace every nn.Linear of `model` whose input width is a multiple of 32 by its
    BLOCK_SCHEMES[scheme] QuantLinear, in place. Returns the count replaced."""
    kind = BLOCK_SCHEMES[scheme]
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if type(module) is nn.Linear and module.in_features % BLOCK == 0
    ]
    with torch.inference_mode():
        for name, module in targets:
            parent_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent_name), attr, block_linear(module, kind))
    return len(targets)
