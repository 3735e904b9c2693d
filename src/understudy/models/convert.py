"""Hugging Face checkpoints -> understudy's Transformer (models/transformer.py).

Supported (the fast, exact path): llama (Llama 2/3.x, rope scaling included), mistral,
qwen2, qwen3, gemma2, gemma3_text, phi3 (Phi-3, Phi-4), mixtral and qwen3_moe. The layout
change is mechanical: q/k/v projections become one `wqkv` matmul and gate/up one
`w_gate_up` (Phi-3's fused `qkv_proj` / `gate_up_proj` already are), and a mixture's
stacked expert weights become one MLP per expert.

Everything else raises UnsupportedArchitecture with one line saying why; the loader then runs
it on transformers' own code (models/hf_fallback.py), except models whose state is a
recurrence (Mamba, RWKV, Gated DeltaNet and other linear-attention hybrids), which cannot be
rolled back by position arithmetic on a KV cache, so a rejected guess could not be undone.
"""

from __future__ import annotations

from typing import Any

import torch

from understudy.config import UnderstudyError
from understudy.models.moe import ACTIVATIONS
from understudy.models.rope import RopeScaling, UnsupportedRope, rope_scaling_from_hf
from understudy.models.transformer import TransformerConfig

DENSE = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3")
MIXTURES = ("mixtral", "qwen3_moe")
SUPPORTED_MODEL_TYPES = DENSE + MIXTURES
GEMMA = ("gemma2", "gemma3_text")
QK_NORM = ("qwen3", "qwen3_moe", "gemma3_text")

# model types whose per-token state is a recurrence, not a cache indexed by position
RECURRENT = (
    "mamba", "mamba2", "falcon_mamba", "falcon_h1", "jamba", "bamba", "zamba", "zamba2",
    "rwkv", "recurrent_gemma", "qwen3_next", "qwen3_5", "qwen3_5_moe", "granitemoehybrid",
    "nemotron_h", "lfm2", "lfm2_moe", "olmo_hybrid", "minimax", "xlstm",
)  # fmt: skip


class UnsupportedArchitecture(UnderstudyError):
    """The fast path cannot run this model; its message, one line, says why. The loader
    then tries the transformers fallback, which raises it where that cannot run it either."""


def _refuse_type(model_type: str | None) -> UnsupportedArchitecture:
    if model_type in RECURRENT:
        return UnsupportedArchitecture(
            f"model type {model_type!r} keeps a recurrent state (state-space or linear "
            "attention layers) that cannot be rolled back by position, so speculative "
            "decoding cannot undo a rejected guess"
        )
    if model_type == "gemma3":
        return UnsupportedArchitecture(
            "model type 'gemma3' is the multimodal Gemma 3; load its text model "
            "(model type 'gemma3_text', e.g. google/gemma-3-1b-it or gemma-3-270m)"
        )
    return UnsupportedArchitecture(
        f"model type {model_type!r} is not supported "
        f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
    )


def _rope(params: dict[str, Any] | None, model_type: str) -> tuple[float, RopeScaling | None]:
    params = params or {}
    try:
        scaling = rope_scaling_from_hf(params)
    except UnsupportedRope as err:
        raise UnsupportedArchitecture(f"{model_type}: {err}") from None
    theta = params.get("rope_theta")
    return float(theta if theta is not None else 10000.0), scaling


def _layer_kinds(hf: Any, layers: int, model_type: str) -> tuple[int | None, tuple[bool, ...]]:
    """(window, sliding per layer): transformers' `layer_types` where the config has them,
    else every layer slides when a window is set (Mistral, Mixtral, Phi-3)."""
    window = getattr(hf, "sliding_window", None)
    if window is None:
        return None, ()
    types = getattr(hf, "layer_types", None)
    sliding = tuple(t == "sliding_attention" for t in types) if types else (True,) * layers
    if model_type in ("qwen2", "qwen3", "qwen3_moe") and not getattr(
        hf, "use_sliding_window", False
    ):
        sliding = (False,) * layers
    return (int(window), sliding) if any(sliding) else (None, ())


def config_from_hf(hf_config: Any, state_dict: dict[str, torch.Tensor]) -> TransformerConfig:
    """The TransformerConfig of a transformers config; UnsupportedArchitecture if none fits."""
    hf = hf_config
    model_type = getattr(hf, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise _refuse_type(model_type)
    gemma = model_type in GEMMA
    act = getattr(hf, "hidden_activation", None) if gemma else None
    act = act or getattr(hf, "hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise UnsupportedArchitecture(f"{model_type}: activation {act!r} is not supported")
    if getattr(hf, "mlp_bias", False) or "model.layers.0.self_attn.o_proj.bias" in state_dict:
        raise UnsupportedArchitecture(
            f"{model_type}: biases on o_proj or the MLP are not supported"
        )
    if getattr(hf, "use_bidirectional_attention", False):
        raise UnsupportedArchitecture(f"{model_type}: bidirectional attention is not causal")
    heads, layers = hf.num_attention_heads, hf.num_hidden_layers
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    params = getattr(hf, "rope_parameters", None) or {}
    local_theta = None
    if model_type == "gemma3_text":  # one rope per layer type
        local_theta, local_scaling = _rope(params.get("sliding_attention"), model_type)
        if local_scaling is not None:
            raise UnsupportedArchitecture("gemma3_text: scaled rope on sliding layers")
        params = params.get("full_attention")
    theta, scaling = _rope(params, model_type)
    partial = float((params or {}).get("partial_rotary_factor", 1.0))
    window, sliding = _layer_kinds(hf, layers, model_type)
    scalar = getattr(hf, "query_pre_attn_scalar", None)
    experts, moe_layers = 0, ()
    if model_type == "mixtral":
        experts = hf.num_local_experts
    elif model_type == "qwen3_moe":
        experts, step, dense = hf.num_experts, hf.decoder_sparse_step, set(hf.mlp_only_layers)
        moe_layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
    return TransformerConfig(
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        rms_norm_eps=float(hf.rms_norm_eps),
        rope_theta=theta,
        attention_bias="model.layers.0.self_attn.q_proj.bias" in state_dict,
        tie_word_embeddings="lm_head.weight" not in state_dict
        or bool(getattr(hf, "tie_word_embeddings", False)),
        max_position_embeddings=getattr(hf, "max_position_embeddings", 32768),
        rope_scaling=scaling,
        rotary_dim=None if partial == 1.0 else int(head_dim * partial),
        local_rope_theta=local_theta,
        sliding_window=window,
        sliding_layers=sliding,
        attn_scale=None if scalar is None else float(scalar) ** -0.5,
        attn_softcap=getattr(hf, "attn_logit_softcapping", None),
        qk_norm=model_type in QK_NORM,
        norm_unit_offset=gemma,
        sandwich_norms=gemma,
        embed_scale=hf.hidden_size**0.5 if gemma else None,
        final_softcap=getattr(hf, "final_logit_softcapping", None),
        hidden_act=act,
        num_experts=experts,
        experts_per_token=getattr(hf, "num_experts_per_tok", 0) if experts else 0,
        moe_intermediate_size=getattr(hf, "moe_intermediate_size", hf.intermediate_size)
        if experts
        else 0,
        moe_layers=moe_layers,
        normalize_expert_weights=model_type == "mixtral" or bool(getattr(hf, "norm_topk_prob", 0)),
        expert_weights_in_float32=model_type == "mixtral",
    )


def _attention(sd: dict[str, torch.Tensor], src: str, dst: str, cfg: TransformerConfig) -> dict:
    out: dict[str, torch.Tensor] = {}
    if src + "qkv_proj.weight" in sd:  # Phi-3: fused already, q then k then v
        out[dst + "wqkv.weight"] = sd[src + "qkv_proj.weight"]
    else:
        names = [src + f"{n}_proj.weight" for n in ("q", "k", "v")]
        out[dst + "wqkv.weight"] = torch.cat([sd[n] for n in names], dim=0)
    if cfg.attention_bias:
        names = [src + f"{n}_proj.bias" for n in ("q", "k", "v")]
        out[dst + "wqkv.bias"] = torch.cat([sd[n] for n in names], dim=0)
    out[dst + "wo.weight"] = sd[src + "o_proj.weight"]
    if cfg.qk_norm:
        out[dst + "q_norm.weight"] = sd[src + "q_norm.weight"]
        out[dst + "k_norm.weight"] = sd[src + "k_norm.weight"]
    return out


def _feed_forward(sd: dict[str, torch.Tensor], src: str, dst: str, sparse: bool) -> dict:
    out: dict[str, torch.Tensor] = {}
    if sparse:  # stacked experts [E, 2I, H] and [E, H, I] -> one MLP each
        out[dst + "router.weight"] = sd[src + "gate.weight"]
        gate_up, down = sd[src + "experts.gate_up_proj"], sd[src + "experts.down_proj"]
        for e in range(gate_up.shape[0]):
            out[dst + f"experts.{e}.w_gate_up.weight"] = gate_up[e]
            out[dst + f"experts.{e}.w_down.weight"] = down[e]
        return out
    if src + "gate_up_proj.weight" in sd:  # Phi-3: gate rows first, as ours
        out[dst + "w_gate_up.weight"] = sd[src + "gate_up_proj.weight"]
    else:
        gate, up = sd[src + "gate_proj.weight"], sd[src + "up_proj.weight"]
        out[dst + "w_gate_up.weight"] = torch.cat([gate, up], dim=0)
    out[dst + "w_down.weight"] = sd[src + "down_proj.weight"]
    return out


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
        out.update(_attention(sd, src + "self_attn.", dst + "attn.", cfg))
        out.update(_feed_forward(sd, src + "mlp.", dst + "mlp.", cfg.sparse(i)))
        out[dst + "attn_norm.weight"] = sd[src + "input_layernorm.weight"]
        if cfg.sandwich_norms:  # Gemma: post-attention, pre- and post-feedforward norms
            out[dst + "post_attn_norm.weight"] = sd[src + "post_attention_layernorm.weight"]
            out[dst + "mlp_norm.weight"] = sd[src + "pre_feedforward_layernorm.weight"]
            out[dst + "post_mlp_norm.weight"] = sd[src + "post_feedforward_layernorm.weight"]
        else:
            out[dst + "mlp_norm.weight"] = sd[src + "post_attention_layernorm.weight"]
    return out
