"""Which keys each sequence's rows see in a pass shared by several sequences.

A batched pass (models/shared_pass.py) scores the rows of many sequences together: every
linear layer runs once over all of them, and attention runs per sequence (on GGUF blocks, all
the sequences' rows in one span_attention call a layer, through slot_mask). Each sequence owns a region
of the KV cache (slots base .. base + region - 1, its chain position j at slot base + j), and
its rows attend to that region exactly as a pass of that sequence alone attends to slots
0..L-1: the same mask, the same number of keys L, the same per-row calls. With row-invariant
linear kernels (kernels/rowgemm, kernels/qgemm) a row's logits are then bitwise those of the
sequence's solo pass, whatever else shares the pass.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class KeyGroup:
    """Rows `rows` of a pass: one sequence's, over its own region of the cache."""

    rows: slice  # its rows in the pass
    base: int  # its region's first slot: chain position j is slot base + j
    mask: torch.Tensor  # [n, L] bool: may row i see the key at chain position j
    key_slots: torch.Tensor | None = None  # [n, L] absolute slots, in chain order


def groups_within_window(
    groups: list[KeyGroup], positions: torch.Tensor, window: int
) -> list[KeyGroup]:
    """The groups as a sliding-window layer sees them: chain positions p - window < j only.
    positions: [R] the pass's rotary positions (a group's rows' chain positions)."""
    out = []
    for group in groups:
        columns = torch.arange(group.mask.shape[-1], device=group.mask.device)[None]  # [1, L]
        near = columns > (positions[group.rows] - window)[:, None]  # [n, L]
        out.append(replace(group, mask=group.mask & near))
    return out


def slot_mask(groups: list[KeyGroup], rows: int) -> torch.Tensor | None:
    """The groups' masks as one [R, S] mask over the cache's slots themselves (column s is
    slot s): row i of a group sees slot base + j where its own mask shows j. A row then sees
    the same keys, in the same order, as through its group, so a kernel that finds each row's
    run of keys in this mask (the fused stack's span_attention) scores it the same bits, and
    the whole pass takes one call. None where a group gathers its keys (a tree's key_slots:
    not slots in order)."""
    if any(g.key_slots is not None for g in groups):
        return None
    width = max(g.base + g.mask.shape[-1] for g in groups)
    mask = torch.zeros(rows, width, dtype=torch.bool, device=groups[0].mask.device)
    for g in groups:
        mask[g.rows, g.base : g.base + g.mask.shape[-1]] = g.mask
    return mask
