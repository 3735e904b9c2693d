"""The peer: transformers' own `generate()` on the very same weights.

`hf_model(loaded)` wraps an understudy `LoadedModel` as a transformers Qwen2/Llama
ForCausalLM whose parameters are VIEWS of the loaded tensors (our fused q|k|v and gate|up
matrices are sliced back along their output rows, which are contiguous): no second conversion
of the GGUF file, and the peer provably runs the same numbers. (When the target's linears are
prepacked for oneDNN, models/packed.py, the peer gets a dense copy of them: more memory.)

Three peer methods, as a user of transformers would run them (its defaults otherwise):
- hf-plain:    `generate()` (greedy or sampling as asked).
- hf-assisted: `generate(assistant_model=<the draft>)` (its default: up to 20 assistant tokens
  per round, stopped early by a confidence threshold that adapts across calls).
- hf-lookup:   `generate(prompt_lookup_num_tokens=HF_LOOKUP_TOKENS)` (prompt lookup decoding).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from understudy.config import SamplingParams
from understudy.models.loader import LoadedModel

HF_PLAIN, HF_ASSISTED, HF_LOOKUP = "hf-plain", "hf-assisted", "hf-lookup"
HF_METHODS = (HF_PLAIN, HF_ASSISTED, HF_LOOKUP)
HF_LOOKUP_TOKENS = 10  # the value transformers' documentation uses for prompt lookup


def hf_model(loaded: LoadedModel) -> Any:
    """A transformers CausalLM sharing `loaded`'s weight tensors (see module docstring)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    ours = loaded.model
    cfg = ours.cfg
    eos = list(loaded.eos_token_ids)
    common: dict[str, Any] = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        tie_word_embeddings=cfg.tie_word_embeddings,
        max_position_embeddings=cfg.max_position_embeddings,
        eos_token_id=eos or None,
        pad_token_id=eos[0] if eos else 0,
    )
    if cfg.attention_bias:  # Qwen2: biases on q, k, v only
        config, cls = Qwen2Config(**common), Qwen2ForCausalLM
        config.head_dim = cfg.head_dim
    else:
        config, cls = LlamaConfig(head_dim=cfg.head_dim, **common), LlamaForCausalLM
    config.dtype = ours.dtype
    with torch.device("meta"):
        hf = cls(config)
    hf.load_state_dict(_hf_state_dict(ours), strict=True, assign=True)
    rotary = hf.model.rotary_emb
    hf.model.rotary_emb = type(rotary)(config=config).to(ours.device)  # its buffers were meta
    if any(t.is_meta for t in (*hf.parameters(), *hf.buffers())):
        raise RuntimeError("the transformers peer still has meta tensors")
    hf.generation_config.eos_token_id = eos or None
    hf.generation_config.pad_token_id = eos[0] if eos else 0
    return hf.eval().requires_grad_(False)


def _hf_state_dict(ours: torch.nn.Module) -> dict[str, torch.Tensor]:
    cfg = ours.cfg
    q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    sd: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": ours.embed.weight,
        "model.norm.weight": ours.norm.weight,
    }
    if not cfg.tie_word_embeddings:  # tied: transformers ties lm_head to the embedding itself
        sd["lm_head.weight"] = ours.lm_head.weight
    for i, layer in enumerate(ours.layers):
        p = f"model.layers.{i}."
        wq, wk, wv = layer.attn.wqkv.weight.split((q_out, kv_out, kv_out), dim=0)
        sd |= {p + "self_attn.q_proj.weight": wq, p + "self_attn.k_proj.weight": wk}
        sd[p + "self_attn.v_proj.weight"] = wv
        if cfg.attention_bias:
            bq, bk, bv = layer.attn.wqkv.bias.split((q_out, kv_out, kv_out), dim=0)
            sd |= {p + "self_attn.q_proj.bias": bq, p + "self_attn.k_proj.bias": bk}
            sd[p + "self_attn.v_proj.bias"] = bv
        sd[p + "self_attn.o_proj.weight"] = layer.attn.wo.weight
        gate, up = layer.mlp.w_gate_up.weight.split(cfg.intermediate_size, dim=0)
        sd |= {p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up}
        sd[p + "mlp.down_proj.weight"] = layer.mlp.w_down.weight
        sd[p + "input_layernorm.weight"] = layer.attn_norm.weight
        sd[p + "post_attention_layernorm.weight"] = layer.mlp_norm.weight
    return sd


class _Clock:
    """A transformers streamer that notes when the first generated token arrives."""

    def __init__(self) -> None:
        self.calls = 0
        self.first_token_at: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls == 2 and self.first_token_at is None:  # call 1 is the prompt
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


@dataclass
class HFResult:
    token_ids: list[int]
    wall_s: float
    prefill_s: float
    target_passes: int

    def stats(self, method: str) -> dict[str, Any]:
        tokens = len(self.token_ids)
        decode_s = max(self.wall_s - self.prefill_s, 0.0)
        return {
            "method": method,
            "tokens": tokens,
            "target_passes": self.target_passes,
            "tokens_per_pass": tokens / self.target_passes if self.target_passes else 0.0,
            "prefill_s": self.prefill_s,
            "decode_s": decode_s,
            "wall_s": self.wall_s,
            "tokens_per_s": tokens / self.wall_s if self.wall_s > 0 else 0.0,
            "decode_tokens_per_s": (tokens - 1) / decode_s if decode_s > 0 and tokens > 1 else 0.0,
        }


class HFPeer:
    """transformers' generate() on the target (and the draft as its assistant)."""

    def __init__(
        self, target: LoadedModel, draft: LoadedModel | None, methods: tuple[str, ...] = HF_METHODS
    ) -> None:
        self.target = hf_model(target)
        self.draft = hf_model(draft) if draft is not None and HF_ASSISTED in methods else None
        self.methods = [m for m in methods if m != HF_ASSISTED or self.draft is not None]
        self._passes = 0
        self.target.register_forward_pre_hook(self._count)

    def describe(self) -> dict[str, dict[str, Any]]:
        about = {
            HF_PLAIN: {"method": HF_PLAIN},
            HF_ASSISTED: {"method": HF_ASSISTED, "assistant": "the draft, transformers defaults"},
            HF_LOOKUP: {"method": HF_LOOKUP, "prompt_lookup_num_tokens": HF_LOOKUP_TOKENS},
        }
        return {m: about[m] for m in self.methods}

    def _count(self, *_: object) -> None:
        self._passes += 1

    def generate(self, method: str, prompt_ids: list[int], params: SamplingParams) -> HFResult:
        kwargs: dict[str, Any] = {"max_new_tokens": params.max_tokens}
        if params.greedy:
            kwargs["do_sample"] = False
        else:  # our defaults, never the model's generation_config
            kwargs.update(
                do_sample=True,
                temperature=params.temperature,
                top_k=params.top_k,  # 0 = off, as ours
                top_p=params.top_p,
                min_p=params.min_p or None,
            )
            if params.seed is not None:
                torch.manual_seed(params.seed)
        if method == HF_ASSISTED:
            kwargs["assistant_model"] = self.draft
        elif method == HF_LOOKUP:
            kwargs["prompt_lookup_num_tokens"] = HF_LOOKUP_TOKENS
        elif method != HF_PLAIN:
            raise ValueError(method)
        from transformers.utils import logging as hf_logging

        if params.ignore_eos:
            kwargs["eos_token_id"] = None
        device = self.target.device
        input_ids = torch.tensor([prompt_ids], device=device)  # [1, n]
        clock = _Clock()
        self._passes = 0
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # its notes on generation_config, on every call
        try:
            with warnings.catch_warnings(), torch.inference_mode():
                warnings.simplefilter("ignore")
                t0 = time.perf_counter()
                out = self.target.generate(
                    input_ids, attention_mask=torch.ones_like(input_ids), streamer=clock, **kwargs
                )
                wall = time.perf_counter() - t0
        finally:
            hf_logging.set_verbosity(verbosity)
        token_ids = out[0, len(prompt_ids) :].tolist()
        prefill = (clock.first_token_at - t0) if clock.first_token_at is not None else wall
        return HFResult(token_ids, wall, prefill, self._passes)
