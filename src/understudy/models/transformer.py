"""A compact decoder-only transformer, built for verification: Llama 3, Mistral, Qwen2/3,
Gemma 2/3, Phi-3/4 and the mixture-of-experts blocks of Mixtral and Qwen3-MoE.

One forward shape for everything (gpt-fast style): `forward(tokens, positions, slots, mask)`
scores any set of query rows against a preallocated, slot-indexed KV cache:

    tokens    [R]        token ids of the query rows (real rows first, filler after)
    positions [R]        rotary positions (a tree's siblings share a position)
    slots     [R]        cache slots the rows' keys/values are written to
    mask      [R, L]     bool, True = query row may attend to cache slot j < L
    key_slots [R, L]     optional: row r attends to cache slots key_slots[r] (in that order)
                         instead of slots 0..L-1; mask then refers to those positions. A
                         tree node's ancestors then sit where a chain's would (exactness).
    split                optional (padded decode passes): each row's keys in chain order,
                         head and tail (models/split_attention.py); mask is then unused.

Rolling the cache back is position arithmetic done by the caller (slots past the valid
length are simply overwritten later); a tree's accepted path is kept by `keep_slots`.

Why this shape: a matmul's result for a row depends on how many rows are in the call, so
the target always scores a FIXED number of rows over a FIXED number of key slots (or runs
row-invariant kernels). Then a row's logits do not depend on how many of the other rows are
real, and speculative output is bitwise the output of plain decoding.

Sliding-window layers (Mistral, Gemma 2/3, Phi-3) keep the whole sequence in the cache like
every layer and hide the keys outside the window by mask: column j of `mask` (or of
`key_slots`) is the key at chain position j, so a row at position p sees j only when
p - window < j (transformers' sliding mask). Nothing is evicted, so rolling back and
generating past the window need no extra bookkeeping. (A drafter's tree pass, whose mask
columns are slots, is exact while the tree is shallower than the window.)

Everything a family changes is decided when the model is built (which norm, rope, MLP or
mixture, soft caps); the forward pass has no branch on the architecture's name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from understudy.models.attention import Attention, region_view, rotate_half
from understudy.models.key_groups import KeyGroup, groups_within_window, slot_mask
from understudy.models.moe import MLP, SparseMoE
from understudy.models.norms import RMSNorm, make_norm
from understudy.models.rope import RopeScaling, Rotary, exact_positions
from understudy.models.split_attention import SplitKeys, within_window


class FusedLayerHook(Protocol):
    """A layer's work around its attention in C calls (models/fused.py installs one): the
    same values, row by row, as the Block's modules give."""

    def attention_input(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
        k_cache: torch.Tensor, v_cache: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """The rows' queries [H, R, D]; the rows' keys and values written at `slots`."""
        ...

    def output(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """x [R, hidden] after the attention output attn [R, H, D] and the MLP."""
        ...


class FusedStackHook(Protocol):
    """Every layer of a model in one call a pass (models/fused.py installs one)."""

    def run(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
        k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], mask: torch.Tensor,
        layers: slice = slice(None),
    ) -> bool:  # fmt: skip
        """x after every layer (or the run `layers`), in place; False (x unchanged) where it
        cannot take the pass."""
        ...


__all__ = ["Block", "RMSNorm", "Transformer", "TransformerConfig", "region_view", "rotate_half"]


@dataclass(frozen=True)
class TransformerConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # apart from hidden / heads in Qwen3 and Gemma
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    attention_bias: bool = False  # Qwen2 has q/k/v biases, Llama does not
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    # rope: a scaling scheme (Llama 3.1's, YaRN, LongRoPE...; None = plain), the rotated
    # share of each head (Phi-4-mini rotates 3/4; None = all), and Gemma 3's own base for
    # its sliding layers (None = every layer uses rope_theta and rope_scaling)
    rope_scaling: RopeScaling | None = None
    rotary_dim: int | None = None
    local_rope_theta: float | None = None
    # attention: which layers see only the last `sliding_window` positions (empty = none),
    # the score scale (Gemma: query_pre_attn_scalar ** -0.5; None = head_dim ** -0.5), the
    # tanh cap on scores (Gemma 2), and a per-head RMSNorm of q and k (Qwen3, Gemma 3)
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] = ()
    attn_scale: float | None = None
    attn_softcap: float | None = None
    qk_norm: bool = False
    # Gemma: norms scale by (1 + weight), extra norms after attention and after the MLP,
    # embeddings times sqrt(hidden) (rounded to the model's dtype, as transformers does),
    # a tanh cap on the final logits (Gemma 2)
    norm_unit_offset: bool = False
    sandwich_norms: bool = False
    embed_scale: float | None = None
    final_softcap: float | None = None
    hidden_act: str = "silu"  # or "gelu_pytorch_tanh" (Gemma)
    # mixture of experts (0 experts = dense): which layers are sparse (empty = all), the
    # experts' own width, top-k, renormalising the k weights, and whether the weights stay
    # float32 (Mixtral) or are cast to the model's dtype first (Qwen3-MoE)
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    moe_layers: tuple[bool, ...] = ()
    normalize_expert_weights: bool = True
    expert_weights_in_float32: bool = True

    def __post_init__(self) -> None:
        # JSON round trip (the converted-model cache): lists back to tuples, dicts to dataclasses
        for name in ("sliding_layers", "moe_layers"):
            object.__setattr__(self, name, tuple(bool(v) for v in getattr(self, name)))
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        for name in ("sliding_layers", "moe_layers"):
            value = getattr(self, name)
            assert not value or len(value) == self.num_layers, (name, len(value))
        assert (self.sliding_window is not None) == any(self.sliding_layers), "window and layers"

    def sliding(self, layer: int) -> bool:
        return bool(self.sliding_layers) and self.sliding_layers[layer]

    def sparse(self, layer: int) -> bool:
        return self.num_experts > 0 and (not self.moe_layers or self.moe_layers[layer])


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(x / cap) * cap


class Block(nn.Module):
    """One decoder layer: x + attn(norm(x)), then x + mlp(norm(x)); with sandwich norms
    (Gemma) each branch's output is normalised again before it is added."""

    def __init__(self, cfg: TransformerConfig, index: int = 0) -> None:
        super().__init__()
        hidden, eps, offset = cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_unit_offset
        self.attn_norm = make_norm(hidden, eps, offset)
        self.attn = Attention(cfg)
        self.mlp_norm = make_norm(hidden, eps, offset)
        self.mlp: nn.Module = MLP(hidden, cfg.intermediate_size, cfg.hidden_act)
        if cfg.sparse(index):
            self.mlp = SparseMoE(
                hidden, cfg.moe_intermediate_size, cfg.hidden_act, cfg.num_experts,
                cfg.experts_per_token, cfg.normalize_expert_weights,
                cfg.expert_weights_in_float32,
            )  # fmt: skip
        self.post_attn_norm = self.post_mlp_norm = nn.Identity()
        if cfg.sandwich_norms:
            self.post_attn_norm = make_norm(hidden, eps, offset)
            self.post_mlp_norm = make_norm(hidden, eps, offset)
        self.sliding = cfg.sliding(index)  # sees the last sliding_window positions only
        self.rope = 1 if self.sliding and cfg.local_rope_theta is not None else 0  # which rope
        # the layer's work around attention in two C calls (models/fused.py), set by the
        # engine builder for a model on GGUF blocks; None = the modules above
        self.fused: FusedLayerHook | None = None


class Transformer(nn.Module):
    """Decoder-only LM with a slot-indexed static KV cache (see module docstring)."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = make_norm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_unit_offset)
        self.lm_head: nn.Module = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.k_cache: list[torch.Tensor] = []
        self.v_cache: list[torch.Tensor] = []
        dim, positions = cfg.rotary_dim or cfg.head_dim, cfg.max_position_embeddings
        # not weights: [global rope, Gemma 3's local rope]; Block.rope picks one
        self.rotaries = [Rotary(cfg.rope_theta, dim, cfg.rope_scaling, positions)]
        if cfg.local_rope_theta is not None:
            self.rotaries.append(Rotary(cfg.local_rope_theta, dim, None, positions))
        self.windowed = any(layer.sliding for layer in self.layers)
        # every layer in one C call a pass where all are fused (models/fused.py), set
        # by the engine builder; hidden_states takes it for the passes it computes
        self.fused_stack: FusedStackHook | None = None
        # the layers whose outputs (the residual stream after them) a pass hands out when
        # asked (hidden_states' `features`): EAGLE-3's low, middle and high features for
        # method="eagle" (models/eagle_head.py), set by the drafter that reads them; ()=none
        self.feature_layers: tuple[int, ...] = ()

    # (the final norm's weight, not the embedding's: an embedding from GGUF blocks,
    # kernels/qgemm.py, has no dense weight to ask)
    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def cache_slots(self) -> int:
        return self.k_cache[0].shape[1] if self.k_cache else 0

    @property
    def exact_context(self) -> int | None:
        """Tokens up to which the rope is transformers' own in every pass (None: any); see
        models/rope.py ("dynamic" and "longrope" change with the sequence's length)."""
        return exact_positions(self.cfg.rope_scaling, self.cfg.max_position_embeddings)

    def allocate_cache(self, slots: int) -> None:
        """Preallocate the KV cache (zeroed, so unused slots hold finite values)."""
        cfg = self.cfg
        shape = (cfg.num_kv_heads, slots, cfg.head_dim)
        if self.cache_slots != slots:
            self.k_cache = [
                torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers
            ]
            self.v_cache = [
                torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers
            ]

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [R, rotary_dim] of the global rope at positions [R]."""
        return self.rotaries[0](positions, self.dtype)

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:  # [R] -> [R, hidden]
        x = self.embed(tokens)
        if self.cfg.embed_scale is None:
            return x
        scale = torch.tensor(self.cfg.embed_scale, dtype=torch.float32).to(x.dtype)
        return x * scale.to(x.device)

    def hidden_states(
        self,
        tokens: torch.Tensor,  # [R]
        positions: torch.Tensor,  # [R]
        slots: torch.Tensor,  # [R]
        mask: torch.Tensor,  # [R, L]
        key_slots: torch.Tensor | None = None,  # [R, L]
        split: SplitKeys | None = None,
        regions: int | None = None,
        groups: list[KeyGroup] | None = None,
        features: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Run the layers; write the rows' keys/values into `slots`. Returns [R, hidden].
        `regions` (batch work, head/self_text.py): row r attends to its own region of the
        cache only, slots r * regions .. r * regions + L - 1 under mask [R, L]. `groups` (a
        pass shared by several sequences, models/key_groups.py): each group's rows attend
        to their own region under their own mask; `mask` is then unused. `features` (a
        list): the output of each of `feature_layers` [R, hidden] is appended, in order;
        taking them changes no bit of the pass."""
        x = self.embed_tokens(tokens)
        ropes = [rotary(positions, self.dtype) for rotary in self.rotaries]
        views = [(mask, split, groups)]  # [full attention, sliding window]
        if self.windowed:
            window = self.cfg.sliding_window
            assert window is not None
            columns = torch.arange(mask.shape[-1], device=mask.device)[None]  # [1, L]
            near = mask & (columns > (positions - window)[:, None])  # [R, L]
            views.append(
                (
                    near,
                    None if split is None else within_window(split, window),
                    None if groups is None else groups_within_window(groups, positions, window),
                )
            )
        stack_mask = self.stack_mask(tokens.shape[0], mask, key_slots, split, regions, groups)
        if stack_mask is not None:  # all rows over their one run of keys, by span_attention
            assert self.fused_stack is not None
            x = x.contiguous()
            cos, sin = ropes[0]
            if self._stacked(x, cos, sin, slots, stack_mask, features):
                return self.norm(x)
        layers = zip(self.layers, self.k_cache, self.v_cache, strict=True)
        for index, (layer, k_cache, v_cache) in enumerate(layers):
            cos, sin = ropes[layer.rope]
            layer_mask, layer_split, layer_groups = views[layer.sliding]
            if layer.fused is not None:
                q = layer.fused.attention_input(x, cos, sin, slots, k_cache, v_cache)  # [H, R, D]
                out = layer.attn.attend_rows(
                    q, k_cache, v_cache, layer_mask, key_slots, layer_split, regions, layer_groups
                )  # [R, H, D]
                x = layer.fused.output(x, out)  # in place
            else:
                attn = layer.attn(
                    layer.attn_norm(x), cos, sin, slots, layer_mask, k_cache, v_cache,
                    key_slots, layer_split, regions, layer_groups,
                )  # fmt: skip
                x = x + layer.post_attn_norm(attn)
                x = x + layer.post_mlp_norm(layer.mlp(layer.mlp_norm(x)))
            if features is not None and index in self.feature_layers:
                features.append(x.clone())  # [R, hidden]
        return self.norm(x)

    def _stacked(
        self,
        x: torch.Tensor,  # [R, hidden] float32, contiguous: changed in place
        cos: torch.Tensor,  # [R, D]
        sin: torch.Tensor,
        slots: torch.Tensor,  # [R]
        mask: torch.Tensor,  # [R, L]
        features: list[torch.Tensor] | None,
    ) -> bool:
        """x through every layer by the fused stack: one C call, or with `features` one per
        run of layers ending at a feature layer (whose output is appended); the same calls
        in C either way. False, x unchanged, where some row's keys are not one run."""
        stack = self.fused_stack
        assert stack is not None
        taps = self.feature_layers if features is not None else ()
        start = 0
        for end in sorted({i + 1 for i in taps} | {len(self.layers)}):
            run = slice(start, end)
            if not stack.run(x, cos, sin, slots, self.k_cache, self.v_cache, mask, run):
                assert start == 0, "a later run of layers sees the keys the first saw"
                return False
            if features is not None and end - 1 in taps:
                features.append(x.clone())  # [R, hidden]
            start = end
        return True

    def stack_mask(
        self,
        rows: int,
        mask: torch.Tensor,  # [R, L]
        key_slots: torch.Tensor | None,
        split: SplitKeys | None,
        regions: int | None,
        groups: list[KeyGroup] | None,
    ) -> torch.Tensor | None:
        """The mask over cache slots with which the fused stack takes this pass, or None
        where the layer-by-layer path must: no stack, gathered keys or split passes, or rows
        that the layers would not give span_attention (more than span_rows of one sequence).
        A pass of several sequences (groups) is one mask over their regions (slot_mask)."""
        if self.fused_stack is None or key_slots is not None or split is not None:
            return None
        span_rows = self.layers[0].attn.span_rows
        if regions is not None:
            return None
        if groups is None:
            return mask if rows <= span_rows else None
        if any(g.rows.stop - g.rows.start > span_rows for g in groups):
            return None
        return slot_mask(groups, rows)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[R, hidden] final hidden states -> [R, vocab] float32 logits (capped for Gemma 2:
        a row at a time, so that no row's tanh is computed unlike another pass's, as torch's
        vectorised and scalar forms may differ where a tensor's size splits them)."""
        out = self.lm_head(hidden)
        if self.cfg.final_softcap is not None:
            out = torch.stack([softcap(row, self.cfg.final_softcap) for row in out])
        return out.float()

    def forward(
        self,
        tokens: torch.Tensor,  # [R]
        positions: torch.Tensor,  # [R]
        slots: torch.Tensor,  # [R]
        mask: torch.Tensor,  # [R, L]
        logit_rows: slice | None = None,
        key_slots: torch.Tensor | None = None,
        split: SplitKeys | None = None,
    ) -> torch.Tensor:
        """Logits [len(logit_rows), vocab] (float32) of the selected rows (all by default)."""
        h = self.hidden_states(tokens, positions, slots, mask, key_slots, split)
        if logit_rows is not None:
            h = h[logit_rows]
        return self.logits(h)

    def keep_slots(self, src: torch.Tensor, dst_start: int) -> None:
        """Copy the KV of cache slots `src` [n] to slots dst_start..dst_start+n-1 (tree paths)."""
        dst = torch.arange(dst_start, dst_start + src.shape[0], device=src.device)
        for k_cache, v_cache in zip(self.k_cache, self.v_cache, strict=True):
            k_cache.index_copy_(1, dst, k_cache.index_select(1, src))
            v_cache.index_copy_(1, dst, v_cache.index_select(1, src))
