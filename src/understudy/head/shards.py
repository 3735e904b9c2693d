"""What the head learns from, cached on disk in shards: the target's tokens, features, argmax.

Shard files `features-NNNN.safetensors` in a folder hold SHARD sequences of T tokens each:
    tokens   [n, T] int32
    features [n, T, hidden] float16   the target's final hidden state after tokens[i, :t+1]
    argmax   [n, T] int32             the target's next-token argmax at (i, t)
    kept     [n, T, F] float16        only for a head with feature layers: what the engine's
                                      runner keeps for it at (i, t) (Runner.last_hidden: the
                                      feature layers' outputs side by side, F = layers * hidden)
Invariant: shard j holds sequences j*SHARD .. j*SHARD+n-1 of its source's order, and a shard
file exists only once complete (written under a temporary name, then renamed), so an
interrupted extraction resumes at the first missing shard.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

SHARD = 16  # sequences per shard file
KEYS = ("tokens", "features", "argmax")


def shard_path(folder: Path, index: int) -> Path:
    return folder / f"features-{index:04d}.safetensors"


def write_shard(
    path: Path,
    tokens: torch.Tensor,  # [n, T]
    features: torch.Tensor,  # [n, T, hidden]
    argmax: torch.Tensor,  # [n, T]
    kept: torch.Tensor | None = None,  # [n, T, F]
) -> None:
    """Save one shard in the layout above: written under a temporary name, then renamed, so
    the file exists only once complete."""
    tmp = path.with_suffix(".tmp")
    tensors = {"tokens": tokens.int(), "features": features.half(), "argmax": argmax.int()}
    if kept is not None:
        tensors["kept"] = kept.half()
    save_file(tensors, str(tmp))
    tmp.rename(path)


def load_shards(paths: list[Path]) -> dict[str, torch.Tensor]:
    """Concatenate shards: tokens [N, T], features [N, T, hidden] (float16), argmax [N, T],
    and kept [N, T, F] (float16) where every shard has it."""
    parts = [load_file(str(p)) for p in paths]
    keys = KEYS + (("kept",) if all("kept" in p for p in parts) else ())
    return {key: torch.cat([p[key] for p in parts]) for key in keys}
