"""Attention for padded decode passes that scores every row, tree nodes included, exactly as
plain decoding scores the same position.

A padded pass (models/runner.py) holds a fixed number of rows R over a fixed window of L key
slots, so the linears and the attention see one shape whatever the method. One batched
SDPA call over shared slots is then exact for chains, but not for tree nodes: a node off
the tree's first-child path finds its ancestors in scattered slots, and SDPA reduces keys in
slot-dependent lanes and blocks, so its logits move in the last bits. Here each row r at
chain position p_r sees its keys in two parts, both in chain order:

  head: slots 0..h_r-1 of the shared cache, h_r = a multiple of TAIL_QUANTUM at most
        p_r - (R - 1), so it holds only committed tokens (a tree is at most R - 1 deep),
        whose slot is their position;
  tail: T = R + TAIL_QUANTUM gathered slots, the row's chain positions h_r..p_r (for a tree
        node: the prefix up to the root, then its own path), then masked filler.

Scores of both parts go through ONE softmax per row (float32), and the output is P_head @
V_head + P_tail @ V_tail. Every operation is row-wise (matmuls over shared operands, the
softmax, the sum), and h_r depends only on p_r and R, so a row's output depends only on its
own query and the keys at its chain positions: a tree node's logits are bitwise those of its
path decoded as a chain (tests/test_tree.py). Cost on the 1.5B target's shapes in bfloat16
(a 512-slot window, 16 rows): ~15% a layer over one SDPA call, 0-6% of a whole pass
(docs/design.md, section 3).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TAIL_QUANTUM = 16  # head lengths are multiples of this


@dataclass(frozen=True)
class SplitKeys:
    """Which keys each row of a padded pass sees (module docstring), built by `split_keys`."""

    window: int  # L: the head part reads slots 0..L-1
    tail: int  # T: tail keys per row
    tail_slots: torch.Tensor  # [R * T] cache slot of each tail key, row-major
    bias: torch.Tensor  # [1, R, 1, L + T] float32: 0 where the row sees the key, else -inf
    tail_positions: torch.Tensor  # [R, T] chain position of each tail key
    positions: torch.Tensor  # [R] each row's own chain position


def split_keys(
    positions: torch.Tensor,  # [R] each row's chain position
    window: int,
    chain_slots: torch.Tensor | None = None,  # [R, L'] slot of row r's chain position p
) -> SplitKeys:
    """The split for rows at `positions`; `chain_slots` None = every chain position p sits at
    slot p (a chain pass). For a tree pass, chain_slots[r] maps row r's chain positions to
    slots (the prefix to itself, then the node's path); positions before h_r must map to
    themselves."""
    rows, device = positions.shape[0], positions.device
    tail = rows + TAIL_QUANTUM
    head_len = (positions - (rows - 1)).clamp(min=0) // TAIL_QUANTUM * TAIL_QUANTUM  # [R]
    tail_pos = head_len[:, None] + torch.arange(tail, device=device)[None]  # [R, T]
    seen = tail_pos <= positions[:, None]  # [R, T]
    tail_pos = torch.where(seen, tail_pos, 0)
    slots = tail_pos if chain_slots is None else chain_slots.gather(1, tail_pos)
    head = torch.arange(window, device=device)[None] < head_len[:, None]  # [R, L]
    visible = torch.cat([head, seen], dim=1)  # [R, L + T]
    bias = torch.zeros(visible.shape, dtype=torch.float32, device=device)
    bias.masked_fill_(~visible, float("-inf"))
    return SplitKeys(window, tail, slots.flatten(), bias[None, :, None], tail_pos, positions)


def within_window(keys: SplitKeys, window: int) -> SplitKeys:
    """The same split for a sliding-window layer: row r at position p also stops seeing the
    keys at positions <= p - window (transformers' sliding mask: kv > q - window). A head
    key's position is its slot; a tail key's is `tail_positions`."""
    rows, device = keys.positions.shape[0], keys.positions.device
    oldest = (keys.positions - window)[:, None]  # [R, 1]: positions <= this are out
    head_out = torch.arange(keys.window, device=device)[None] <= oldest  # [R, L]
    out = torch.cat([head_out, keys.tail_positions <= oldest], dim=1)  # [R, L + T]
    bias = keys.bias.masked_fill(out.view(1, rows, 1, -1), float("-inf"))
    return SplitKeys(
        keys.window, keys.tail, keys.tail_slots, bias, keys.tail_positions, keys.positions
    )


def split_attention(
    q: torch.Tensor,  # [H, R, D] rotated queries
    k_cache: torch.Tensor,  # [Hkv, S, D]
    v_cache: torch.Tensor,  # [Hkv, S, D]
    keys: SplitKeys,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention of each row over its keys (module docstring) -> [R, H, D]
    in q's dtype. Query head j reads kv head j // (H / Hkv), as SDPA's enable_gqa does.
    `scale` defaults to D ** -0.5; `softcap` (Gemma 2) maps scores s to tanh(s / c) * c."""
    heads, rows, dim = q.shape
    kv_heads, length, tail = k_cache.shape[0], keys.window, keys.tail
    group = heads // kv_heads
    scale = dim**-0.5 if scale is None else scale
    qg = (q.float() * scale).reshape(kv_heads, group * rows, dim)  # [Hkv, G*R, D]
    k_head = k_cache[:, :length].float()  # [Hkv, L, D]
    v_head = v_cache[:, :length].float()
    k_tail = k_cache.index_select(1, keys.tail_slots).float().view(kv_heads, rows, tail, dim)
    v_tail = v_cache.index_select(1, keys.tail_slots).float().view(kv_heads, rows, tail, dim)
    s_head = torch.matmul(qg, k_head.transpose(1, 2))  # [Hkv, G*R, L]
    s_head = s_head.view(kv_heads, group, rows, length).transpose(1, 2)  # [Hkv, R, G, L]
    q_rows = qg.view(kv_heads, group, rows, dim).transpose(1, 2)  # [Hkv, R, G, D]
    s_tail = torch.matmul(q_rows, k_tail.transpose(2, 3))  # [Hkv, R, G, T]
    scores = torch.cat([s_head, s_tail], dim=-1)  # [Hkv, R, G, L + T]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    p = torch.softmax(scores.add_(keys.bias), dim=-1)
    p_head = p[..., :length].transpose(1, 2).reshape(kv_heads, group * rows, length)
    out = torch.matmul(p_head, v_head).view(kv_heads, group, rows, dim).transpose(1, 2)
    out = out + torch.matmul(p[..., length:], v_tail)  # [Hkv, R, G, D]
    return out.permute(1, 0, 2, 3).reshape(rows, heads, dim).to(q.dtype)
