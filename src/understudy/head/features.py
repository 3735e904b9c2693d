"""Run the target once over the training text and cache what the head learns from, in shards
(head/shards.py has the layout).

Every source of text goes through here: corpus sequences (read only) and prompts the target
continues itself (head/self_text.py). Sequences are read in lockstep batches
(head/lockstep.py), so their features are the bits the engine's runner hands the head at
decode time. The head is trained on these shards alone, so the target (the slow part) runs
over each token once, however many epochs follow.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tqdm import tqdm

from understudy.head.lockstep import Decoded, decode_in_lockstep, prepare_target
from understudy.head.shards import SHARD, shard_path, write_shard
from understudy.models.packed import can_pack, pack_linears
from understudy.models.transformer import Transformer

# sequences a lockstep batch decodes together: rows of a pass on GGUF blocks are
# compute-bound, and more than this gained nothing measurable while the cache grows with
# the batch (docs/eagle.md)
SHARDS_PER_PASS = 4


@torch.inference_mode()
def target_features(model: Transformer, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [T] -> (final hidden states [T, hidden] float32, argmax next tokens [T]), as
    `extract` computes them (call prepare_target first for the engine's bits)."""
    decoded = decode_in_lockstep(model, [tokens.tolist()], tokens.shape[0])
    return decoded.features[0], decoded.argmax[0]


def sequence_data(model: Transformer, sequences: list[list[int]]) -> dict[str, torch.Tensor]:
    """What `extract` would write for `sequences` (of one length, read whole), in memory:
    tokens, features, argmax and, where the model names feature layers, kept (float32)."""
    decoded = decode_in_lockstep(model, sequences, len(sequences[0]))
    data = {"tokens": decoded.tokens, "features": decoded.features, "argmax": decoded.argmax}
    if decoded.kept is not None:
        data["kept"] = decoded.kept
    return data


def extract(
    model: Transformer,
    prompts: list[list[int]],
    seq_len: int,
    folder: Path,
    progress: bool = True,
    sampled: int = 0,
    temperature: float = 1.0,
    seed: int = 0,
    shards_per_pass: int = SHARDS_PER_PASS,
) -> list[Path]:
    """Shards of `prompts` (in order) continued greedily to `seq_len` tokens (a prompt of
    `seq_len` tokens is only read), `shards_per_pass` shards (of SHARD sequences) decoded
    in one lockstep batch. Complete shards are kept (an interrupted run resumes). Returns
    all shard paths. `sampled` > 0: the first `sampled` tokens after each prompt are sampled
    at `temperature` (the draws of a batch seeded by `seed` and its first shard), the rest
    greedy (self_text.opener_prompts). Installs the engine's kernels (prepare_target), or,
    where it pads passes (bf16), packs the linears for passes of a batch's rows."""
    folder.mkdir(parents=True, exist_ok=True)
    per_pass = SHARD * shards_per_pass
    prepare_target(model)
    if can_pack(model.device, model.dtype):
        pack_linears(model, per_pass)
    starts = list(range(0, len(prompts), SHARD))
    paths = [shard_path(folder, s // SHARD) for s in starts]
    todo = [s for s, path in zip(starts, paths, strict=True) if not path.exists()]
    bar = tqdm(
        total=sum(len(prompts[s : s + SHARD]) for s in todo) * seq_len,
        unit="tok",
        desc=f"target reads {folder.name}",
        disable=not progress,
    )
    for i in range(0, len(todo), shards_per_pass):
        group = todo[i : i + shards_per_pass]
        batch = [prompt for s in group for prompt in prompts[s : s + SHARD]]
        sample_to = [min(len(p) + sampled, seq_len) for p in batch] if sampled else None
        generator = torch.Generator().manual_seed(seed * 100_003 + group[0] // SHARD)
        decoded = decode_in_lockstep(model, batch, seq_len, sample_to, temperature, generator)
        write_shards(folder, group, [len(prompts[s : s + SHARD]) for s in group], decoded)
        bar.update(len(batch) * seq_len)
    bar.close()
    return paths


def write_shards(folder: Path, starts: list[int], sizes: list[int], decoded: Decoded) -> None:
    """Write a lockstep batch as the shards beginning at sequences `starts` (`sizes` each)."""
    row = 0
    for start, n in zip(starts, sizes, strict=True):
        part = slice(row, row + n)
        row += n
        kept = None if decoded.kept is None else decoded.kept[part]
        write_shard(
            shard_path(folder, start // SHARD),
            decoded.tokens[part],
            decoded.features[part],
            decoded.argmax[part],
            kept,
        )
