"""Hugging Face Llama/Qwen2-family checkpoints -> understudy's Transformer.

The layout change is mechanical: q/k/v projections are fused into one `wqkv` matmul and
gate/up into one `w_gate_up` (fewer, larger matmuls: less per-call overhead on a CPU).
Architectures outside the family raise UnsupportedArchitecture with the reason.
"""

from __future__ import annotations

from typing import Any

import torch

from understudy.models.transformer import TransformerConfig

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


class UnsupportedArchitecture(ValueError):
    pass


def _rope_theta(hf_config: Any) -> float:
    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type not in ("default", None):
        raise UnsupportedArchitecture(f"rope scaling {rope_type!r} is not supported")
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    return float(theta if theta is not None else 10000.0)


def config_from_hf(hf_config: Any, state_dict: dict[str, torch.Tensor]) -> TransformerConfig:
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedArchitecture(
            f"model type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    if getattr(hf_config, "sliding_window", None) and getattr(
        hf_config, "use_sliding_window", False
    ):
        raise UnsupportedArchitecture("sliding-window attention is not supported")
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return TransformerConfig(
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        rms_norm_eps=float(hf_config.rms_norm_eps),
        rope_theta=_rope_theta(hf_config),
        attention_bias="model.layers.0.self_attn.q_proj.bias" in state_dict,
        tie_word_embeddings="lm_head.weight" not in state_dict
        or bool(getattr(hf_config, "tie_word_embeddings", False)),
        max_position_embeddings=getattr(hf_config, "max_position_embeddings", 32768),
    )


def convert_state_dict(
    sd: dict[str, torch.Tensor], cfg: TransformerConfig
) -> dict[str, torch.Tensor]:
    """Map HF parameter names to ours, fusing qkv and gate/up. Tied heads share the embedding."""
    out: dict[str, torch.Tensor] = {
        "embed.weight": sd["model.embed_tokens.weight"],
        "norm.weight": sd["model.norm.weight"],
        "lm_head.weight": sd["model.embed_tokens.weight"]
        if cfg.tie_word_embeddings
        else sd["lm_head.weight"],
    }
    for i in range(cfg.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        attn = src + "self_attn."
        out[dst + "attn.wqkv.weight"] = torch.cat(
            [sd[attn + f"{n}_proj.weight"] for n in ("q", "k", "v")], dim=0
        )
        if cfg.attention_bias:
            out[dst + "attn.wqkv.bias"] = torch.cat(
                [sd[attn + f"{n}_proj.bias"] for n in ("q", "k", "v")], dim=0
            )
        out[dst + "attn.wo.weight"] = sd[attn + "o_proj.weight"]
        out[dst + "mlp.w_gate_up.weight"] = torch.cat(
            [sd[src + "mlp.gate_proj.weight"], sd[src + "mlp.up_proj.weight"]], dim=0
        )
        out[dst + "mlp.w_down.weight"] = sd[src + "mlp.down_proj.weight"]
        out[dst + "attn_norm.weight"] = sd[src + "input_layernorm.weight"]
        out[dst + "mlp_norm.weight"] = sd[src + "post_attention_layernorm.weight"]
    return out
