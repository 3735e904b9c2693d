"""A compact decoder-only transformer of the Llama / Qwen2 family, built for verification.

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

Why this shape: a matmul's result for a row depends on how many rows are in the call (FACTS.md),
so the target always scores a FIXED number of rows over a FIXED number of key slots. Then a
row's logits do not depend on how many of the other rows are real, and speculative output is
bitwise the output of plain decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from understudy.models.split_attention import SplitKeys, split_attention


@dataclass(frozen=True)
class TransformerConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    attention_bias: bool = False  # Qwen2 has q/k/v biases, Llama does not
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def region_view(cache: torch.Tensor, rows: int, region: int, length: int) -> torch.Tensor:
    """cache [Hkv, S, D] seen as each row's own region: [R, Hkv, L, D], row r's slots
    r * region .. r * region + L - 1 (a view, no copy; needs R * region <= S, L <= region)."""
    kv_heads, _, dim = cache.shape
    assert length <= region and rows * region <= cache.shape[1]
    return (
        cache[:, : rows * region].view(kv_heads, rows, region, dim)[:, :, :length].transpose(0, 1)
    )


class Attention(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        q_out = cfg.num_heads * cfg.head_dim
        kv_out = cfg.num_kv_heads * cfg.head_dim
        self.split = (q_out, kv_out, kv_out)
        self.wqkv = nn.Linear(cfg.hidden_size, q_out + 2 * kv_out, bias=cfg.attention_bias)
        self.wo = nn.Linear(q_out, cfg.hidden_size, bias=False)
        # passes of at most rows_apart_upto rows score each query row in its own 1-row SDPA
        # call, so a row's output does not depend on how many rows the pass holds: SDPA's
        # blocking does, and so does its batch size (batch 1 vs 2+ differ on some CPUs, seen
        # on an AVX-512 EPYC; a loop of 1-row calls costs what one batched call does there).
        # 0 = off. Longer passes (a prompt's chunks) stay batched.
        self.rows_apart_upto = 0

    def forward(
        self,
        x: torch.Tensor,  # [R, hidden]
        cos: torch.Tensor,  # [R, head_dim]
        sin: torch.Tensor,  # [R, head_dim]
        slots: torch.Tensor,  # [R]
        mask: torch.Tensor,  # [R, L]
        k_cache: torch.Tensor,  # [kv_heads, S, head_dim]
        v_cache: torch.Tensor,  # [kv_heads, S, head_dim]
        key_slots: torch.Tensor | None = None,  # [R, L]
        split: SplitKeys | None = None,
        regions: int | None = None,
    ) -> torch.Tensor:
        """Attention of rows x over the cache after writing their keys/values to `slots`:
        one SDPA call under `mask`; with `key_slots`, each row over its own gathered keys
        in a 1-row SDPA call (at most rows_apart_upto rows); with `split` (padded decode
        passes), split_attention, exact for tree nodes; with `regions` (batch work), row r
        over its own region of the cache, slots r * regions + j for j < L, under mask[r]."""
        cfg = self.cfg
        rows = x.shape[0]
        q, k, v = self.wqkv(x).split(self.split, dim=-1)
        q = q.view(rows, cfg.num_heads, cfg.head_dim).transpose(0, 1)  # [H, R, D]
        k = k.view(rows, cfg.num_kv_heads, cfg.head_dim).transpose(0, 1)  # [Hkv, R, D]
        v = v.view(rows, cfg.num_kv_heads, cfg.head_dim).transpose(0, 1)  # [Hkv, R, D]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        # (a no-op cast except under autocast in training, where v comes out in bf16)
        k_cache.index_copy_(1, slots, k.to(k_cache.dtype))
        v_cache.index_copy_(1, slots, v.to(v_cache.dtype))
        if split is not None:
            out = split_attention(q, k_cache, v_cache, split)  # [R, H, D]
            return self.wo(out.reshape(rows, -1))
        length = mask.shape[-1]
        gqa = cfg.num_heads != cfg.num_kv_heads
        if regions is not None:  # rows as SDPA's batch, each over its own region: no gather
            keys = region_view(k_cache, rows, regions, length)  # [R, Hkv, L, D]
            values = region_view(v_cache, rows, regions, length)
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1)[:, :, None], keys, values, attn_mask=mask[:, None, None],
                enable_gqa=gqa,
            )  # [R, H, 1, D]  # fmt: skip
            return self.wo(out.reshape(rows, -1))
        keys, values = k_cache[None, :, :length], v_cache[None, :, :length]  # [1, Hkv, L, D]
        if key_slots is not None:  # each row its own keys, gathered in the order given
            assert rows <= self.rows_apart_upto, "key_slots needs per-row attention"
            keys = k_cache[:, key_slots].transpose(0, 1)  # [R, Hkv, L, D]
            values = v_cache[:, key_slots].transpose(0, 1)  # [R, Hkv, L, D]
        if rows <= self.rows_apart_upto:  # each query row its own call, the shape of a 1-row pass
            per_row = keys.shape[0] > 1
            out = torch.cat(
                [
                    F.scaled_dot_product_attention(
                        q[None, :, r : r + 1],  # [1, H, 1, D]
                        keys[r : r + 1] if per_row else keys,  # [1, Hkv, L, D]
                        values[r : r + 1] if per_row else values,
                        attn_mask=mask[r : r + 1],  # [1, L]
                        enable_gqa=gqa,
                    )[0, :, 0]  # [H, D]
                    for r in range(rows)
                ]
            ).view(rows, cfg.num_heads, cfg.head_dim)  # [R, H, D]
        else:
            out = F.scaled_dot_product_attention(
                q[None], keys, values, attn_mask=mask, enable_gqa=gqa
            )[0].transpose(0, 1)  # [R, H, D]
        return self.wo(out.reshape(rows, -1))


class MLP(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.w_gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.w_down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up(x).split(self.inter, dim=-1)
        return self.w_down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)


class Transformer(nn.Module):
    """Decoder-only LM with a slot-indexed static KV cache (see module docstring)."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.k_cache: list[torch.Tensor] = []
        self.v_cache: list[torch.Tensor] = []
        exponents = torch.arange(0, cfg.head_dim, 2, dtype=torch.float32, device="cpu")
        self.inv_freq = 1.0 / (cfg.rope_theta ** (exponents / cfg.head_dim))  # [D/2], not a weight

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
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None]  # [R, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [R, D]
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def hidden_states(
        self,
        tokens: torch.Tensor,  # [R]
        positions: torch.Tensor,  # [R]
        slots: torch.Tensor,  # [R]
        mask: torch.Tensor,  # [R, L]
        key_slots: torch.Tensor | None = None,  # [R, L]
        split: SplitKeys | None = None,
        regions: int | None = None,
    ) -> torch.Tensor:
        """Run the layers; write the rows' keys/values into `slots`. Returns [R, hidden].
        `regions` (batch work, head/self_text.py): row r attends to its own region of the
        cache only, slots r * regions .. r * regions + L - 1 under mask [R, L]."""
        x = self.embed(tokens)
        cos, sin = self.rotary(positions)
        for layer, k_cache, v_cache in zip(self.layers, self.k_cache, self.v_cache, strict=True):
            attn_in = layer.attn_norm(x)
            x = x + layer.attn(
                attn_in, cos, sin, slots, mask, k_cache, v_cache, key_slots, split, regions
            )
            x = x + layer.mlp(layer.mlp_norm(x))
        return self.norm(x)

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
        return self.lm_head(h).float()

    def keep_slots(self, src: torch.Tensor, dst_start: int) -> None:
        """Copy the KV of cache slots `src` [n] to slots dst_start..dst_start+n-1 (tree paths)."""
        dst = torch.arange(dst_start, dst_start + src.shape[0], device=src.device)
        for k_cache, v_cache in zip(self.k_cache, self.v_cache, strict=True):
            k_cache.index_copy_(1, dst, k_cache.index_select(1, src))
            v_cache.index_copy_(1, dst, v_cache.index_select(1, src))
