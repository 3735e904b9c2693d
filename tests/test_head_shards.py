"""head/shards.py: the training and held-out sets read from the shards equal the sources
concatenated, cut into rows and split as the docstring says (the plain way, done here),
whichever rows are asked for, and they are read from disk when asked for, not before."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from understudy.head.shards import SHARD, held_out_rows, shard_path, train_and_held_out, write_shard


def write_source(folder: Path, sequences: int, length: int, seed: int, kept: bool) -> list[Path]:
    """`sequences` random sequences of `length` tokens in shards of SHARD (the last short)."""
    folder.mkdir()
    g = torch.Generator().manual_seed(seed)
    paths = []
    for index, start in enumerate(range(0, sequences, SHARD)):
        n = min(SHARD, sequences - start)
        path = shard_path(folder, index)
        write_shard(
            path,
            torch.randint(0, 1000, (n, length), generator=g),
            torch.randn(n, length, 8, generator=g),
            torch.randint(0, 1000, (n, length), generator=g),
            torch.randn(n, length, 24, generator=g) if kept else None,
        )
        paths.append(path)
    return paths


def plainly(sources: list[list[Path]], length: int) -> tuple[dict, dict]:
    """The sets the simple way: each source loaded whole, cut into rows, its last rows held
    out, the sources concatenated."""
    train, val = [], []
    for paths in sources:
        shards = [load_file(str(p)) for p in paths]
        keys = [k for k in ("tokens", "features", "argmax", "kept") if k in shards[0]]
        whole = {k: torch.cat([s[k] for s in shards]) for k in keys}
        rows = {k: v.reshape(-1, length, *v.shape[2:]) for k, v in whole.items()}
        h = held_out_rows(rows["tokens"].shape[0])
        train.append({k: v[:-h] for k, v in rows.items()})
        val.append({k: v[-h:] for k, v in rows.items()})
    return tuple(
        {k: torch.cat([part[k] for part in parts]) for k in parts[0]} for parts in (train, val)
    )


def test_sets_built_shard_by_shard_equal_the_sources_concatenated(tmp_path):
    """Rows of 32 tokens from three sources: 70 sequences of 64 tokens (140 rows in 5 shards,
    14 held out, from the last two shards), 20 of 32 (2 held out), 3 of 64 (1 held out)."""
    sources = [
        write_source(tmp_path / "a", 70, 64, seed=1, kept=True),
        write_source(tmp_path / "b", 20, 32, seed=2, kept=True),
        write_source(tmp_path / "c", 3, 64, seed=3, kept=True),
    ]
    train, val = train_and_held_out(sources, 32)
    want_train, want_val = plainly(sources, 32)
    assert set(train) == set(want_train) == {"tokens", "features", "argmax", "kept"}
    for key in train:
        assert train[key].shape == want_train[key].shape, key
        assert torch.equal(train[key][:], want_train[key]), key
        assert torch.equal(val[key][:], want_val[key]), key
    assert val["tokens"].shape[0] == 14 + 2 + 1
    order = torch.randperm(len(train["tokens"]), generator=torch.Generator().manual_seed(0))
    for rows in (order[:7], order[7:9], slice(3, 5), torch.tensor([5, 5, 0])):
        for key in train:
            assert torch.equal(train[key][rows], want_train[key][rows]), (key, rows)


def test_rows_are_read_when_indexed(tmp_path):
    """The sets hold addresses, not bytes: a shard rewritten after they were built is what
    they then read (so 2M tokens of features need not fit in memory)."""
    paths = write_source(tmp_path / "a", 20, 32, seed=1, kept=True)
    train, _ = train_and_held_out([paths], 32)
    before = train["features"][torch.tensor([0, 17])]
    write_source(tmp_path / "b", 20, 32, seed=2, kept=True)
    (tmp_path / "b" / paths[1].name).replace(paths[1])  # rows 16.. of the source
    after = train["features"][torch.tensor([0, 17])]
    assert torch.equal(after[0], before[0])
    assert not torch.equal(after[1], before[1])
    assert torch.equal(after[1], load_file(str(paths[1]))["features"][1])


def test_kept_only_where_every_shard_has_it(tmp_path):
    sources = [
        write_source(tmp_path / "a", 20, 32, seed=1, kept=True),
        write_source(tmp_path / "b", 20, 32, seed=2, kept=False),
    ]
    train, val = train_and_held_out(sources, 32)
    assert set(train) == set(val) == {"tokens", "features", "argmax"}
