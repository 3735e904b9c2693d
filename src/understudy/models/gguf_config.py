"""What a GGUF file says about its model that transformers' GGUF reader leaves out.

The blocks path derives a file's TransformerConfig as the dense path does (transformers'
config -> models/convert.config_from_hf), then takes from the file what that reader drops
and llama.cpp computes with, so the model is the one the file describes:

- mixtures: llama.cpp writes Mixtral as architecture "llama" with `expert_count`, which
  transformers reads as a dense Llama; Qwen3-MoE's expert width and its renormalised top-k
  (llama.cpp always renormalises there) come back as transformers' defaults. The experts'
  count, width and the sparse layers are taken from the tensors, top-k from the metadata;
- a head size (`attention.key_length`) where the reader does not map it (Qwen3);
- Phi-3's rotated share of each head (`rope.dimension_count`: Phi-4-mini rotates 3/4), its
  LongRoPE (the short and long factors are tensors of the file, rope_factors_short/long,
  with the pretraining context and the cos/sin factor in the metadata) and its sliding
  window (Phi-3-mini's 2047; Phi-4's files write 0, none);
- Gemma 2's soft caps, and Gemma 3's linear rope scaling of its global layers;
- Llama 3.1+'s rope scaling, which llama.cpp's converter writes as a tensor, rope_freqs (each
  frequency's divisor), and no metadata: read as plain rope, such a model's positions would
  turn unlike llama.cpp's and transformers' (rope kind "divisors").
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from understudy.models.convert import UnsupportedArchitecture
from understudy.models.gguf_file import GGUFLayout, mapped_tensors
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


def _phi3(cfg: TransformerConfig, layout: GGUFLayout, path: Path) -> dict[str, Any]:
    meta, changes = layout.metadata, {}
    rotated = meta.get("phi3.rope.dimension_count")
    if isinstance(rotated, int) and rotated < cfg.head_dim:
        changes["rotary_dim"] = rotated
    window = meta.get("phi3.attention.sliding_window")
    if isinstance(window, int) and 0 < window < cfg.max_position_embeddings:
        changes.update(sliding_window=window, sliding_layers=(True,) * cfg.num_layers)
    if "rope_factors_short.weight" in layout.names():
        tensors = mapped_tensors(path, layout)
        short, long = (tuple(float(v) for v in tensors[f"rope_factors_{n}.weight"].data)
                       for n in ("short", "long"))  # fmt: skip
        original = int(meta["phi3.rope.scaling.original_context_length"])
        changes["rope_scaling"] = RopeScaling(
            "longrope", factor=cfg.max_position_embeddings / original,
            original_max_positions=original, short_factor=short, long_factor=long,
            attention_factor=meta.get("phi3.rope.scaling.attn_factor"),
        )  # fmt: skip
    return changes


def config_from_gguf(cfg: TransformerConfig, layout: GGUFLayout, path: Path) -> TransformerConfig:
    """`cfg` (the dense path's, from transformers' config) with what the file at `path`
    states besides (module docstring)."""
    arch = layout.architecture or ""
    meta = layout.metadata
    changes = _mixture(cfg, layout, arch)
    if arch == "phi3":
        changes.update(_phi3(cfg, layout, path))
    head_dim = meta.get(f"{arch}.attention.key_length")
    if isinstance(head_dim, int) and head_dim != cfg.head_dim:
        changes["head_dim"] = head_dim
    if arch == "gemma2":
        for key, name in (("attn", "attn_softcap"), ("final", "final_softcap")):
            cap = meta.get(f"gemma2.{key}_logit_softcapping")
            if cap is not None:
                changes[name] = float(cap)
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if arch == "gemma3" and meta.get("gemma3.rope.scaling.type") == "linear" and factor:
        changes["rope_scaling"] = RopeScaling("linear", factor=float(factor))
    changes.update(_rope_divisors(cfg, layout, path, changes))
    return replace(cfg, **changes) if changes else cfg


def _rope_divisors(
    cfg: TransformerConfig, layout: GGUFLayout, path: Path, changes: dict[str, Any]
) -> dict[str, Any]:
    if "rope_freqs.weight" not in layout.names():
        return {}
    if changes.get("rope_scaling", cfg.rope_scaling) is not None:
        raise UnsupportedArchitecture(
            f"{path.name}: rope_freqs.weight besides another rope scaling; which one applies "
            "is not known here"
        )
    divisors = tuple(float(v) for v in mapped_tensors(path, layout)["rope_freqs.weight"].data)
    rotated = changes.get("rotary_dim") or cfg.rotary_dim or changes.get("head_dim", cfg.head_dim)
    if len(divisors) != rotated // 2:
        raise UnsupportedArchitecture(
            f"{path.name}: rope_freqs.weight holds {len(divisors)} values for {rotated // 2} "
            "frequencies"
        )
    return {"rope_scaling": RopeScaling("divisors", divisors=divisors)}
