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
from safetensors import safe_open
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


def held_out_rows(rows: int) -> int:
    """How many of a source's last rows are held out: min(SHARD, rows // 10), at least 1."""
    return max(1, min(SHARD, rows // 10))


def train_and_held_out(
    sources: list[list[Path]], length: int
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The training and held-out sets of several sources' shards: each sequence [T, ...] cut
    into T // length rows [length, ...] (so sources of different lengths train together),
    each source's last held_out_rows rows held out, the sources in order. Keys: KEYS, and
    "kept" where every shard has it.

    Built one shard at a time into tensors of the final size, so the sets' bytes are held
    once (concatenating whole sources, then splitting, holds them two or three times over:
    with three feature layers, ~12 KB a token in float16)."""
    shapes: list[list[dict[str, list[int]]]] = []  # per source, per shard: key -> shape
    for paths in sources:
        source = []
        for path in paths:
            with safe_open(str(path), framework="pt") as f:
                source.append({key: list(f.get_slice(key).get_shape()) for key in f.keys()})
        shapes.append(source)
    keys = KEYS + (("kept",) if all("kept" in s for src in shapes for s in src) else ())
    lengths = {s["tokens"][1] for src in shapes for s in src}
    assert all(T % length == 0 for T in lengths), f"sequence lengths {lengths}, rows of {length}"
    rows = [sum(s["tokens"][0] * (s["tokens"][1] // length) for s in src) for src in shapes]
    held = [held_out_rows(n) for n in rows]
    first = load_file(str(sources[0][0]))  # one shard: each key's dtype and trailing shape

    def empty(n: int) -> dict[str, torch.Tensor]:  # pages are touched as rows are copied in
        return {
            key: torch.empty(n, length, *first[key].shape[2:], dtype=first[key].dtype)
            for key in keys
        }

    train, val = empty(sum(rows) - sum(held)), empty(sum(held))
    at_train = at_val = 0
    for paths, n, h in zip(sources, rows, held, strict=True):
        done = 0  # rows of this source copied
        for path in paths:
            shard = load_file(str(path))
            for key in keys:
                t = shard[key]
                shard[key] = t.reshape(t.shape[0] * (t.shape[1] // length), length, *t.shape[2:])
            m = shard["tokens"].shape[0]
            to_train = max(0, min(m, n - h - done))  # the source's first n - h rows train
            for key in keys:
                train[key][at_train : at_train + to_train] = shard[key][:to_train]
                val[key][at_val : at_val + m - to_train] = shard[key][to_train:]
            at_train, at_val, done = at_train + to_train, at_val + m - to_train, done + m
    assert at_train == train["tokens"].shape[0] and at_val == val["tokens"].shape[0]
    return train, val
