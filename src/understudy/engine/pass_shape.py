"""The shape of the target's passes, and the kernels that make any shape exact.

Chosen when an engine is built: row-invariant kernels (kernels/rowgemm, kernels/qgemm with
kernels/span_attention and kernels/fused_layer) where the model runs in float32 or from
GGUF blocks on a CPU, so passes hold only their real rows; elsewhere (CUDA, bfloat16) every
pass is padded to one fixed row budget (docs/design.md, section 2).
"""

from __future__ import annotations

import os

import torch

from understudy.kernels import rowgemm, span_attention
from understudy.models.fused import FusedLayer, FusedStack
from understudy.models.hardware import cpu_has_native_bf16
from understudy.models.hf_fallback import FallbackLM
from understudy.models.packed import PACK_FROM_ROWS, can_pack, pack_linears
from understudy.models.transformer import Block, Transformer

ROW_INVARIANT_ROWS = 16  # most rows of an unpadded pass (K <= 15) unless told otherwise


def row_invariant_kernels(model: Transformer | FallbackLM) -> bool:
    """Whether the target runs row-invariant kernels (kernels/rowgemm.py): float32 on a CPU
    where the kernel could be built. Then passes are not padded at all: plain decoding scores
    one row, verification K+1, and a row's logits are bitwise the same either way. A model
    running from GGUF blocks (kernels/qgemm.py, which needs rowgemm too) is one of these, and
    so is a transformers fallback model (models/hf_fallback.py) once its linears are swapped."""
    return model.device.type == "cpu" and model.dtype == torch.float32 and rowgemm.available()


def target_pass_shape(model: Transformer | FallbackLM) -> tuple[int, bool]:
    """(rows, pad) of the target's passes by default: (16, False) with row-invariant kernels,
    else (the hardware's padded budget, True)."""
    if row_invariant_kernels(model):
        return ROW_INVARIANT_ROWS, False
    return default_verify_rows(model.dtype, model.device), True


def install_row_invariant_kernels(model: Transformer | FallbackLM, rows: int) -> None:
    """Swap the target's linears for rowgemm and score each row of a pass of up to `rows`
    rows in its own attention call (models/transformer.py), so no op of a decode pass
    depends on how many rows it holds. Idempotent. A fallback model's attention is row by
    row already (models/row_attention.py): only its linears change."""
    if isinstance(model, FallbackLM):
        model.use_row_invariant_kernels()
        return
    rowgemm.use_row_invariant_linears(model)
    for layer in model.layers:
        assert isinstance(layer, Block)  # as every layer is (nn.ModuleList types bare modules)
        layer.attn.rows_apart_upto = max(layer.attn.rows_apart_upto, rows)
    use_span_attention(model, rows)
    use_fused_layers(model)


def use_span_attention(model: Transformer | FallbackLM, rows: int) -> None:
    """Score the decode rows of passes of up to `rows` rows with kernels/span_attention
    (float32 on a CPU, where it builds): one call a layer instead of a torch call a row."""
    if isinstance(model, FallbackLM) or model.device.type != "cpu":
        return
    if model.dtype != torch.float32 or not span_attention.available():
        return
    for layer in model.layers:
        assert isinstance(layer, Block)  # as every layer is (nn.ModuleList types bare modules)
        layer.attn.span_rows = max(layer.attn.span_rows, rows)


def use_fused_layers(model: Transformer | FallbackLM) -> None:
    """Run each layer of a model on GGUF blocks through kernels/fused_layer (two C calls a
    layer around its attention) where the layer is of a kind it computes; every pass then
    takes that path, so no token's bits depend on its pass; where every layer is fused (one
    rope, no window, no softcap), the passes attended by span_attention alone run all the
    layers in one call, the same calls in C. $UNDERSTUDY_FUSED_LAYERS=0: off."""
    if isinstance(model, FallbackLM) or os.environ.get("UNDERSTUDY_FUSED_LAYERS", "1") == "0":
        return
    blocks = [layer for layer in model.layers if isinstance(layer, Block)]
    assert len(blocks) == len(model.layers)  # every layer is one (nn.ModuleList types modules)
    for layer in blocks:
        if layer.fused is None:
            layer.fused = FusedLayer.of(layer)
    fused = [layer.fused for layer in blocks if isinstance(layer.fused, FusedLayer)]
    attn = blocks[0].attn
    one_call = len(fused) == len(model.layers) and not model.windowed and attn.softcap is None
    if one_call and span_attention.available():  # the attention it calls between layers
        model.fused_stack = FusedStack(fused, attn.row_scale)  # every layer in one call


def default_verify_rows(dtype: torch.dtype, device: torch.device) -> int:
    """Rows per padded target pass (every decode pass, plain included, has exactly this
    many) where row-invariant kernels are not available (CUDA, bfloat16, no C compiler).

    Chosen by measurement (docs/design.md, section 2): where matmuls are flat in rows (CUDA,
    CPUs with native bf16) a wide budget is nearly free. On a CPU without native bf16 (fp32,
    linears prepacked for oneDNN from 4 rows on) a 1.5B pass costs ~270 ms at 3 rows and
    ~320 ms at 6, and 6 rows gave the fastest draft and n-gram decoding (8 rows: no faster).
    """
    if device.type == "cuda" or (dtype == torch.bfloat16 and cpu_has_native_bf16()):
        return 16
    return 6


def prepare_target_kernels(model: Transformer | FallbackLM, rows: int) -> None:
    """Pack the target's linears for oneDNN when its passes hold >= 4 rows on a CPU (from 4
    rows on, F.linear repacks every weight on every call; models/packed.py). Our
    Transformer's only: a fallback model keeps transformers' own layers."""
    if isinstance(model, FallbackLM):
        return
    if rows >= PACK_FROM_ROWS and can_pack(model.device, model.dtype):
        pack_linears(model, rows)
