"""Grouped-query attention over the slot-indexed KV cache (models/transformer.py).

Per layer, chosen once at build time: q/k biases (Qwen2), a per-head RMSNorm of q and k
before the rotation (Qwen3, Gemma 3), rotation of the first `rotary_dim` features only
(Phi-4-mini's partial rotary), the score scale (Gemma's query_pre_attn_scalar) and a
tanh soft cap on the scores (Gemma 2). A sliding window needs nothing here: the layer is
handed a mask (or split) that already hides keys outside its window.

Every path keeps the invariant of models/runner.py: a row's output depends on its own query
and the keys it may see, not on the other rows of the pass (per-row calls up to
`rows_apart_upto` rows; split_attention for padded decode passes).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from understudy.kernels.span_attention import refusal as span_refusal
from understudy.kernels.span_attention import span_attention
from understudy.models.key_groups import KeyGroup
from understudy.models.norms import make_norm
from understudy.models.refusals import log_refusal
from understudy.models.split_attention import SplitKeys, split_attention

# (q [B, H, R, D], keys [B, Hkv, L, D], values, mask bool [.., R, L], gqa) -> [B, H, R, D]
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [H, R, D] rotated by cos/sin [R, D]."""
    return x * cos + rotate_half(x) * sin


def rotate_partial(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [H, R, D]: its first cos.shape[-1] features rotated, the rest passed through."""
    dim = cos.shape[-1]
    return torch.cat([rotate(x[..., :dim], cos, sin), x[..., dim:]], dim=-1)


def sdpa(q, keys, values, mask, gqa, scale: float | None = None) -> torch.Tensor:
    return F.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask, enable_gqa=gqa, scale=scale
    )


def softcapped(q, keys, values, mask, gqa, scale: float, softcap: float) -> torch.Tensor:
    """transformers' eager attention with Gemma 2's soft cap (SDPA has none): scores * scale,
    tanh(s / cap) * cap, masked, softmax in float32, times values."""
    if gqa:
        group = q.shape[-3] // keys.shape[-3]
        keys = keys.repeat_interleave(group, dim=-3)
        values = values.repeat_interleave(group, dim=-3)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale  # [B, H, R, L]
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, values)


def attend_visible(
    q: torch.Tensor,  # [1, H, 1, D]
    keys: torch.Tensor,  # [1, Hkv, L, D]: exactly the keys the row sees
    values: torch.Tensor,  # [1, Hkv, L, D]
    scale: float,
) -> torch.Tensor:
    """One query row over keys it may all see: softmax(q k^T * scale) v -> [1, H, 1, D].
    Three small matmul-sized steps; for one row this is several times cheaper than SDPA's
    blocked kernel under a mask, whose cost follows the cache window, not the keys seen."""
    kv_heads, dim, heads = keys.shape[1], keys.shape[3], q.shape[1]
    qg = q.reshape(kv_heads, heads // kv_heads, dim)  # [Hkv, G, D]
    scores = torch.matmul(qg, keys[0].transpose(1, 2)) * scale  # [Hkv, G, L]
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, values[0]).reshape(1, heads, 1, dim)


def visible_spans(mask: torch.Tensor) -> list[tuple[int, int] | None]:
    """For each row of mask [R, L] (bool), (lo, hi) when the keys it sees are exactly the
    run lo..hi-1 (a chain or a sliding window), else None (a tree's ancestors)."""
    edges = torch.zeros(mask.shape[0], mask.shape[1] + 2, dtype=torch.int8, device=mask.device)
    edges[:, 1:-1] = mask
    runs = (edges[:, 1:] != edges[:, :-1]).sum(-1)  # 2 for exactly one run of True
    lo = mask.to(torch.int8).argmax(-1)
    hi = lo + mask.sum(-1)
    return [
        (a, b) if n == 2 else None
        for a, b, n in zip(lo.tolist(), hi.tolist(), runs.tolist(), strict=True)
    ]


def region_view(cache: torch.Tensor, rows: int, region: int, length: int) -> torch.Tensor:
    """cache [Hkv, S, D] seen as each row's own region: [R, Hkv, L, D], row r's slots
    r * region .. r * region + L - 1 (a view, no copy; needs R * region <= S, L <= region)."""
    kv_heads, _, dim = cache.shape
    assert length <= region and rows * region <= cache.shape[1]
    return (
        cache[:, : rows * region].view(kv_heads, rows, region, dim)[:, :, :length].transpose(0, 1)
    )


class Attention(nn.Module):
    def __init__(self, cfg) -> None:  # cfg: TransformerConfig
        super().__init__()
        self.cfg = cfg
        q_out = cfg.num_heads * cfg.head_dim
        kv_out = cfg.num_kv_heads * cfg.head_dim
        self.split = (q_out, kv_out, kv_out)
        self.wqkv = nn.Linear(cfg.hidden_size, q_out + 2 * kv_out, bias=cfg.attention_bias)
        self.wo = nn.Linear(q_out, cfg.hidden_size, bias=False)
        self.q_norm = self.k_norm = nn.Identity()
        if cfg.qk_norm:
            self.q_norm = make_norm(cfg.head_dim, cfg.rms_norm_eps, cfg.norm_unit_offset)
            self.k_norm = make_norm(cfg.head_dim, cfg.rms_norm_eps, cfg.norm_unit_offset)
        full = cfg.rotary_dim in (None, cfg.head_dim)
        self.rotate = rotate if full else rotate_partial
        self.scale = cfg.attn_scale  # None: SDPA's own head_dim ** -0.5
        self.row_scale = cfg.head_dim**-0.5 if self.scale is None else self.scale
        softcap = cfg.attn_softcap
        self.softcap = softcap
        if softcap is None:
            self.attend: Attend = partial(sdpa, scale=self.scale)
        else:
            scale = cfg.head_dim**-0.5 if self.scale is None else self.scale
            self.attend = partial(softcapped, scale=scale, softcap=softcap)
        # passes of at most rows_apart_upto rows score each query row in its own 1-row
        # attention call, so a row's output does not depend on how many rows the pass holds:
        # SDPA's blocking does, and so does its batch size (batch 1 vs 2+ differ on some CPUs,
        # seen on an AVX-512 EPYC; a loop of 1-row calls costs what one batched call does
        # there). 0 = off. Longer passes (a prompt's chunks) stay batched.
        self.rows_apart_upto = 0
        # passes of at most span_rows rows score each row whose keys are one run (a chain's,
        # a window's, a tree node's gathered path) in kernels/span_attention, one call for all
        # of them: row-invariant by construction; in a pass of the 1.5B target it cut attention
        # from 6.7 to 2.5 ms at 1 row and from 39.5 to 18.4 ms at 16 (one thread).
        # 0 = off (float32 on a CPU only; the engine builder turns it on). Heads the kernel
        # cannot take (span_refusal says why) keep it off.
        self.span_refusal = span_refusal(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.span_rows = 0

    @property
    def span_rows(self) -> int:
        return self._span_rows

    @span_rows.setter
    def span_rows(self, rows: int) -> None:
        """Turn the kernel on for passes of up to `rows` rows (0: off); where it cannot take
        these heads it stays off, the reason logged once (the torch path is exact too)."""
        if rows and self.span_refusal is not None:
            log_refusal(f"span_attention: {self.span_refusal}")
            rows = 0
        self._span_rows = rows

    def forward(
        self,
        x: torch.Tensor,  # [R, hidden]
        cos: torch.Tensor,  # [R, rotary_dim]
        sin: torch.Tensor,  # [R, rotary_dim]
        slots: torch.Tensor,  # [R]
        mask: torch.Tensor,  # [R, L]
        k_cache: torch.Tensor,  # [kv_heads, S, head_dim]
        v_cache: torch.Tensor,  # [kv_heads, S, head_dim]
        key_slots: torch.Tensor | None = None,  # [R, L]
        split: SplitKeys | None = None,
        regions: int | None = None,
        groups: list[KeyGroup] | None = None,
    ) -> torch.Tensor:
        """Attention of rows x over the cache after writing their keys/values to `slots`:
        one call under `mask`; with `key_slots`, each row over its own gathered keys in a
        1-row call (at most rows_apart_upto rows); with `split` (padded decode passes),
        split_attention, exact for tree nodes; with `regions` (batch work), row r over its
        own region of the cache, slots r * regions + j for j < L, under mask[r]; with `groups`
        (a batched pass of several sequences), each group's rows over its own region under
        its own mask, as a pass of that sequence alone would score them (`mask` unused)."""
        cfg = self.cfg
        rows = x.shape[0]
        q, k, v = self.wqkv(x).split(self.split, dim=-1)
        q = self.q_norm(q.view(rows, cfg.num_heads, cfg.head_dim)).transpose(0, 1)  # [H, R, D]
        k = self.k_norm(k.view(rows, cfg.num_kv_heads, cfg.head_dim)).transpose(0, 1)
        v = v.view(rows, cfg.num_kv_heads, cfg.head_dim).transpose(0, 1)  # [Hkv, R, D]
        q = self.rotate(q, cos, sin)
        k = self.rotate(k, cos, sin)  # [Hkv, R, D]
        # (a no-op cast except under autocast in training, where v comes out in bf16)
        k_cache.index_copy_(1, slots, k.to(k_cache.dtype))
        v_cache.index_copy_(1, slots, v.to(v_cache.dtype))
        out = self.attend_rows(q, k_cache, v_cache, mask, key_slots, split, regions, groups)
        return self.wo(out.reshape(rows, -1))  # out: [R, H, D]

    def attend_rows(
        self,
        q: torch.Tensor,  # [H, R, D], rotated; the rows' keys/values are in the cache
        k_cache: torch.Tensor,  # [kv_heads, S, head_dim]
        v_cache: torch.Tensor,  # [kv_heads, S, head_dim]
        mask: torch.Tensor,  # [R, L]
        key_slots: torch.Tensor | None = None,  # [R, L]
        split: SplitKeys | None = None,
        regions: int | None = None,
        groups: list[KeyGroup] | None = None,
    ) -> torch.Tensor:
        """The rows' attention over the cache -> [R, H, D], before the output projection
        (forward's docstring says which keys each row sees)."""
        rows = q.shape[1]
        if split is not None:
            return split_attention(q, k_cache, v_cache, split, self.scale, self.softcap)
        if regions is not None:  # rows as the batch, each over its own region: no gather
            length = mask.shape[-1]
            keys = region_view(k_cache, rows, regions, length)  # [R, Hkv, L, D]
            values = region_view(v_cache, rows, regions, length)
            if self.span_rows and self.softcap is None:  # a decode pass's kernel, any rows
                scored = span_attention(q, keys, values, mask, self.row_scale)
                if scored is not None:
                    return scored  # [R, H, D]: bitwise each row's own decode pass
            gqa = self.cfg.num_heads != self.cfg.num_kv_heads
            out = self.attend(q.transpose(0, 1)[:, :, None], keys, values, mask[:, None, None], gqa)
            return out[:, :, 0]  # [R, H, D]
        if groups is None:
            return self._attend(q, k_cache, v_cache, mask, key_slots, 0)  # [R, H, D]
        # each sequence's rows over its own region, exactly as in a pass of their own
        return torch.cat(
            [
                self._attend(q[:, g.rows], k_cache, v_cache, g.mask, g.key_slots, g.base)
                for g in groups
            ]
        )  # [R, H, D]

    def _attend(
        self,
        q: torch.Tensor,  # [H, R, D]
        k_cache: torch.Tensor,  # [Hkv, S, D]
        v_cache: torch.Tensor,
        mask: torch.Tensor,  # [R, L]: column j is slot base + j (or key_slots[:, j])
        key_slots: torch.Tensor | None,  # [R, L] absolute slots
        base: int,
    ) -> torch.Tensor:
        """Rows q over the keys at slots base..base+L-1 (or their own key_slots) -> [R, H, D].
        Passes of at most span_rows rows whose rows each see one run of keys: one kernel
        call. Passes of at most rows_apart_upto rows: each row in its own 1-row call (the
        kernel again for a row that sees one run, with span_rows on)."""
        cfg = self.cfg
        rows, length = q.shape[1], mask.shape[-1]
        gqa = cfg.num_heads != cfg.num_kv_heads
        keys = k_cache[None, :, base : base + length]  # [1, Hkv, L, D]
        values = v_cache[None, :, base : base + length]
        if key_slots is not None:  # each row its own keys, gathered in the order given
            assert rows <= self.rows_apart_upto, "key_slots needs per-row attention"
            keys = k_cache[:, key_slots].transpose(0, 1)  # [R, Hkv, L, D]
            values = v_cache[:, key_slots].transpose(0, 1)  # [R, Hkv, L, D]
        kernel = rows <= self.span_rows
        if kernel:  # every row over its one run of keys, in one call (None: not all are)
            scored = span_attention(q, keys, values, mask, self.row_scale, softcap=self.softcap)
            if scored is not None:
                return scored  # [R, H, D]
        if rows > self.rows_apart_upto:
            return self.attend(q[None], keys, values, mask, gqa)[0].transpose(0, 1)  # [R, H, D]
        spans = visible_spans(mask)
        per_row = keys.shape[0] > 1  # each query row its own call, the shape of a 1-row pass
        out = []
        for r in range(rows):
            q_r = q[None, :, r : r + 1]  # [1, H, 1, D]
            k_r = keys[r : r + 1] if per_row else keys  # [1, Hkv, L, D]
            v_r = values[r : r + 1] if per_row else values
            span = spans[r]
            if span is None:
                o = self.attend(q_r, k_r, v_r, mask[r : r + 1], gqa)
            elif kernel:  # the kernel's bits, as in a pass of such rows only
                o = span_attention(
                    q_r[0], k_r, v_r, mask[r : r + 1], self.row_scale, softcap=self.softcap
                )
                assert o is not None  # its keys are one run
                o = o[:, :, None]
            elif self.softcap is None:  # exactly the keys it sees, whatever the window
                lo, hi = span
                o = attend_visible(q_r, k_r[:, :, lo:hi], v_r[:, :, lo:hi], self.row_scale)
            else:
                lo, hi = span
                o = self.attend(
                    q_r, k_r[:, :, lo:hi], v_r[:, :, lo:hi], mask[r : r + 1, lo:hi], gqa
                )
            out.append(o[0, :, 0])  # [H, D]
        return torch.cat(out).view(rows, cfg.num_heads, cfg.head_dim)  # [R, H, D]
