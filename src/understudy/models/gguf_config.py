"""What a GGUF file says about its model that transformers' GGUF reader leaves out.

The blocks path derives a file's TransformerConfig as the dense path does (transformers'
config -> models/convert.config_from_hf), then takes from the file what that reader drops
and llama.cpp computes with, so the model is the one the file describes:

- mixtures: llama.cpp writes Mixtral as architecture "llama" with `expert_count`, which
  transformers reads as a dense Llama; Qwen3-MoE's expert width and its renormalised top-k
  (llama.cpp always renormalises there) come back as transformers' defaults. The experts'
  count, width and the sparse layers are taken from the tensors, top-k from the metadata;
- a head size (`attention.key_length`) where the reader does not map it (Qwen3);
- Phi-3's rotated share of each head (`rope.dimension_count`: Phi-4-mini rotates 3/4);
- Gemma 2's soft caps, and Gemma 3's linear rope scaling of its global layers.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from understudy.models.convert import UnsupportedArchitecture
from understudy.models.gguf_file import GGUFLayout
from understudy.models.rope import RopeScaling
from understudy.models.transformer import TransformerConfig


def _mixture(cfg: TransformerConfig, layout: GGUFLayout, arch: str) -> dict[str, Any]:
    meta, names = layout.metadata, layout.names()
    experts = int(meta.get(f"{arch}.expert_count", 0) or 0)
    if not experts:
        return {}
    sparse = tuple(f"blk.{i}.ffn_gate_inp.weight" in names for i in range(cfg.num_layers))
    if not any(sparse):
        raise UnsupportedArchitecture(f"{arch}: {experts} experts, but no layer routes to them")
    first = sparse.index(True)
    gate = f"blk.{first}.ffn_gate_exps.weight"
    if gate not in names:
        raise UnsupportedArchitecture(f"{arch}: experts not stacked as {gate} (an older file?)")
    hidden, width, stacked = layout.entry(gate).shape  # GGUF order: innermost first
    if stacked != experts or hidden != cfg.hidden_size:
        raise UnsupportedArchitecture(f"{arch}: {gate} is {(hidden, width, stacked)}")
    return dict(
        num_experts=experts,
        experts_per_token=int(meta[f"{arch}.expert_used_count"]),
        moe_intermediate_size=width,
        moe_layers=() if all(sparse) else sparse,
        normalize_expert_weights=True,  # llama.cpp's Mixtral and Qwen3-MoE renormalise
        expert_weights_in_float32=arch == "llama",  # Mixtral's; Qwen3-MoE's cast to the dtype
    )


def config_from_gguf(cfg: TransformerConfig, layout: GGUFLayout) -> TransformerConfig:
    """`cfg` (the dense path's, from transformers' config) with what the file states besides
    (module docstring)."""
    arch = layout.architecture or ""
    meta = layout.metadata
    changes = _mixture(cfg, layout, arch)
    head_dim = meta.get(f"{arch}.attention.key_length")
    if isinstance(head_dim, int) and head_dim != cfg.head_dim:
        changes["head_dim"] = head_dim
    rotated = meta.get(f"{arch}.rope.dimension_count")
    if arch == "phi3" and isinstance(rotated, int) and rotated < cfg.head_dim:
        changes["rotary_dim"] = rotated
    if arch == "gemma2":
        for key, name in (("attn", "attn_softcap"), ("final", "final_softcap")):
            cap = meta.get(f"gemma2.{key}_logit_softcapping")
            if cap is not None:
                changes[name] = float(cap)
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if arch == "gemma3" and meta.get("gemma3.rope.scaling.type") == "linear" and factor:
        changes["rope_scaling"] = RopeScaling("linear", factor=float(factor))
    return replace(cfg, **changes) if changes else cfg
