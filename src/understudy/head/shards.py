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
from safetensors.torch import save_file

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


class ShardRows:
    """One key's rows [n, length, ...] across shard files, read from disk when indexed.

    Row r is tokens start[r] .. start[r] + length of sequence sequence[r] of files[file[r]].
    Only those addresses are held: with three feature layers a token's features take ~12 KB
    in float16, so 2M tokens of training text are ~25 GB, past a training machine's memory,
    while a step reads a few rows (the page cache keeps what fits)."""

    def __init__(
        self,
        key: str,
        files: list[Path],
        address: torch.Tensor,  # [n, 3] int64: file, sequence, start
        length: int,
        trailing: tuple[int, ...],
        dtype: torch.dtype,
    ) -> None:
        self.key, self.files, self.address = key, files, address
        self.length, self.trailing, self.dtype = length, trailing, dtype

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.address.shape[0], self.length, *self.trailing))

    def __len__(self) -> int:
        return self.address.shape[0]

    def __getitem__(self, rows: torch.Tensor | slice) -> torch.Tensor:
        """The rows selected as a tensor's first dimension would be: [len(rows), length, ...]."""
        picked = self.address[rows]  # [m, 3]
        out = torch.empty(picked.shape[0], self.length, *self.trailing, dtype=self.dtype)
        for file in picked[:, 0].unique().tolist():  # each file opened once a call
            with safe_open(str(self.files[file]), framework="pt") as f:
                part = f.get_slice(self.key)
                for i in (picked[:, 0] == file).nonzero().flatten().tolist():
                    sequence, start = picked[i, 1].item(), picked[i, 2].item()
                    out[i] = part[sequence, start : start + self.length]
        return out


Rows = torch.Tensor | ShardRows  # what the head's training indexes: [n, length, ...]

DTYPES = {"F16": torch.float16, "I32": torch.int32, "F32": torch.float32}  # write_shard's


def train_and_held_out(
    sources: list[list[Path]], length: int
) -> tuple[dict[str, ShardRows], dict[str, ShardRows]]:
    """The training and held-out sets of several sources' shards: each sequence [T, ...] cut
    into T // length rows [length, ...] (so sources of different lengths train together),
    each source's last held_out_rows rows held out, the sources in order. Keys: KEYS, and
    "kept" where every shard has it. Rows are read from the shards when indexed (ShardRows):
    only the shards' headers are read here."""
    files = [path for paths in sources for path in paths]
    shapes: list[dict[str, list[int]]] = []  # per file: key -> shape
    dtypes: dict[str, str] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            shapes.append({key: list(f.get_slice(key).get_shape()) for key in f.keys()})
            dtypes.update({key: f.get_slice(key).get_dtype() for key in f.keys()})
    keys = KEYS + (("kept",) if all("kept" in s for s in shapes) else ())
    lengths = {s["tokens"][1] for s in shapes}
    assert all(T % length == 0 for T in lengths), f"sequence lengths {lengths}, rows of {length}"
    train: list[tuple[int, int, int]] = []  # (file, sequence, start) of each row
    val: list[tuple[int, int, int]] = []
    at = 0  # the first file of this source
    for paths in sources:
        rows = [
            (file, sequence, start)
            for file in range(at, at + len(paths))
            for sequence in range(shapes[file]["tokens"][0])
            for start in range(0, shapes[file]["tokens"][1], length)
        ]
        held = held_out_rows(len(rows))
        train += rows[:-held]
        val += rows[-held:]
        at += len(paths)

    def rows_of(address: list[tuple[int, int, int]]) -> dict[str, ShardRows]:
        table = torch.tensor(address, dtype=torch.long).reshape(-1, 3)
        trailing = {key: tuple(shapes[0][key][2:]) for key in keys}
        return {
            key: ShardRows(key, files, table, length, trailing[key], DTYPES[dtypes[key]])
            for key in keys
        }

    return rows_of(train), rows_of(val)
