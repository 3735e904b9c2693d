"""Run a Transformer's layers through kernels/fused_layer: what of a Block its C calls take.

A Block is a candidate where its linears all run from GGUF blocks (kernels/qgemm.py). Its
tensors and sizes are handed to the kernel as plain values (the kernel knows nothing of our
modules): the norms' multipliers (a Gemma norm's 1 + w), q/k norms, the rotated share of
each head, the activation, and the gated MLP, or for a mixture's layer (Mixtral, Qwen3-MoE)
each expert's MLP, which `output` routes as SparseMoE does. A candidate the kernel cannot take
(a part of a type qgemm has no kernel for, an odd rotary width...) keeps the module path,
exact too, and the reason is logged once (models/refusals.py); quantization="gguf" refuses
such a model instead (models/loader.py, `kernel_refusals`).

Invariant (the kernel's): row-wise and row-invariant, and taken for every pass once
installed, so no token's bits depend on its pass.
"""

from __future__ import annotations

import torch
from torch import nn

from understudy.kernels import fused_layer
from understudy.kernels.fused_layer import LayerKernel, LayerShape, LayerStack, LayerTensors
from understudy.kernels.qgemm import QuantLinear
from understudy.models.moe import SparseMoE
from understudy.models.norms import OffsetRMSNorm, RMSNorm, norm_scale
from understudy.models.refusals import log_refusal
from understudy.models.transformer import Block, Transformer


def scale_of(norm: nn.Module) -> torch.Tensor | None:
    """The factor a norm multiplies by, float32 (None for a missing norm, nn.Identity)."""
    if isinstance(norm, nn.Identity):
        return None
    assert isinstance(norm, (RMSNorm, OffsetRMSNorm)), type(norm)
    return norm_scale(norm).float().contiguous()


def layer_parts(block: Block) -> tuple[LayerShape, LayerTensors] | None:
    """The block's sizes and tensors as the kernel takes them; None for a block that is not
    on GGUF blocks (some linear is not a QuantLinear)."""
    attn, mlp, cfg = block.attn, block.mlp, block.attn.cfg
    sparse = isinstance(mlp, SparseMoE)
    experts = list(mlp.experts) if sparse else [mlp]
    linears = [attn.wqkv, attn.wo, *(m.w_gate_up for m in experts), *(m.w_down for m in experts)]
    if not all(isinstance(m, QuantLinear) for m in linears):
        return None
    shape = LayerShape(
        cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
        cfg.rotary_dim or cfg.head_dim, 0 if sparse else cfg.intermediate_size,
        block.attn_norm.eps, cfg.hidden_act,
    )  # fmt: skip
    tensors = LayerTensors(
        attn.wqkv, attn.wo, scale_of(block.attn_norm), scale_of(block.mlp_norm),
        None if sparse else mlp.w_gate_up, None if sparse else mlp.w_down,
        scale_of(block.post_attn_norm), scale_of(block.post_mlp_norm), scale_of(attn.q_norm),
        scale_of(attn.k_norm),
    )  # fmt: skip
    return shape, tensors


def fused_refusal(block: Block) -> str | None:
    """Why the fused layer cannot take this block of a model on GGUF blocks (None: it can,
    or the block is not on GGUF blocks)."""
    parts = layer_parts(block)
    if parts is None:
        return None
    why = fused_layer.refusal(*parts)
    if why is None and isinstance(block.mlp, SparseMoE):
        for expert in block.mlp.experts:
            why = fused_layer.linear_refusal(expert.w_gate_up) or fused_layer.linear_refusal(
                expert.w_down
            )
            if why is not None:
                why = f"an expert's MLP has {why}"
                break
    return None if why is None else f"fused layer: {why}"


def span_refusal(model: Transformer) -> str | None:
    """Why span_attention cannot take the model's heads (None: it can)."""
    why = model.layers[0].attn.span_refusal
    return None if why is None else f"span_attention: {why}"


def kernel_refusals(model: Transformer) -> list[str]:
    """Every reason, one line each, why a kernel cannot take part of a model on GGUF blocks:
    what quantization="gguf" refuses and "auto" logs once."""
    reasons = [span_refusal(model)] + [fused_refusal(block) for block in model.layers]
    return list(dict.fromkeys(r for r in reasons if r is not None))


class FusedLayer:
    """A Block's fused form: its LayerKernel, and a mixture's experts as MLPKernels."""

    def __init__(self, block: Block, shape: LayerShape, tensors: LayerTensors) -> None:
        self.block = block  # keeps the weights, norms and the linears' blocks alive
        self.kernel = LayerKernel(shape, tensors)
        self.experts: list[fused_layer.MLPKernel] = []
        if isinstance(block.mlp, SparseMoE):
            self.experts = [
                fused_layer.MLPKernel(e.w_gate_up, e.w_down, shape.activation)
                for e in block.mlp.experts
            ]

    @classmethod
    def of(cls, block: Block) -> FusedLayer | None:
        """The fused form of a Block, or None where it is not on GGUF blocks or the kernel
        cannot take it (the reason then logged once)."""
        parts = layer_parts(block)
        if parts is None:
            return None
        why = fused_refusal(block)
        if why is not None:
            log_refusal(why)
            return None
        return cls(block, *parts)

    def attention_input(
        self,
        x: torch.Tensor,  # [R, hidden] float32
        cos: torch.Tensor,  # [R, rotary_dim]
        sin: torch.Tensor,  # [R, rotary_dim]
        slots: torch.Tensor,  # [R]
        k_cache: torch.Tensor,  # [Hkv, S, D], written at `slots`
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """The rows' queries [H, R, D] (LayerKernel.attention_input)."""
        return self.kernel.attention_input(x, cos, sin, slots, k_cache, v_cache)

    def output(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """x [R, hidden] after the attention output attn [R, H, D] and the MLP or experts."""
        if not self.experts:
            return self.kernel.output(x, attn)
        x, normed = self.kernel.mlp_input(x, attn)  # [R, hidden] each
        moe = self.block.mlp
        return x + self.block.post_mlp_norm(moe.mix(normed, self.experts))


class FusedStack:
    """Every layer of a model in one C call a pass (kernels/fused_layer.LayerStack), where
    no layer is a mixture (whose experts are routed here, in Python)."""

    def __init__(self, layers: list[FusedLayer], scale: float, softcap: float | None = None):
        self.layers = layers
        kernels = [layer.kernel for layer in layers]
        mixture = any(k.mixture for k in kernels)
        self.stack = None if mixture else LayerStack(kernels, scale, softcap)

    def run(
        self,
        x: torch.Tensor,  # [R, hidden] float32 contiguous, in place
        cos: torch.Tensor,  # [R, rotary_dim]
        sin: torch.Tensor,  # [R, rotary_dim]
        slots: torch.Tensor,  # [R]
        k_caches: list[torch.Tensor],  # each [Hkv, S, D]
        v_caches: list[torch.Tensor],
        mask: torch.Tensor,  # [R, L] bool: row r sees slot j
        layers: slice = slice(None),
    ) -> bool:
        """x after every layer (or the run `layers`); False (x unchanged) when the stack
        cannot take the pass: some row's keys are not one run, or a layer is a mixture."""
        if self.stack is None:
            return False
        return self.stack.run(x, cos, sin, slots, k_caches, v_caches, mask, layers)
