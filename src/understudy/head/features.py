"""Run the target once over the corpus and cache what the head learns from, in shards.

For each sequence of T tokens the target's final hidden states (after the last norm: the
input of its LM head) are stored in float16, with the tokens and the target's own argmax
prediction at each position. The head is trained on these alone, so the target (the slow
part: ~80 tokens/s for a 1.5B model on a 2-core CPU) runs over each token once, however
many epochs follow.

Shard files `features-NNNN.safetensors` under the output folder hold:
    tokens   [n, T] int32
    features [n, T, hidden] float16   features[i, t] = target's hidden state after tokens[i, :t+1]
    argmax   [n, T] int32             the target's next-token argmax at (i, t)
Invariant: shard j holds sequences j*SHARD .. j*SHARD+n-1 of the corpus order, and a shard
file exists only once complete (written under a temporary name, then renamed), so an
interrupted extraction resumes at the first missing shard.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from understudy.models.transformer import Transformer

SHARD = 16  # sequences per shard file


def shard_path(folder: Path, index: int) -> Path:
    return folder / f"features-{index:04d}.safetensors"


@torch.inference_mode()
def target_features(model: Transformer, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [T] -> (final hidden states [T, hidden] float32, argmax next tokens [T])."""
    n = tokens.shape[0]
    model.allocate_cache(n)
    positions = torch.arange(n, device=model.device)
    causal = torch.ones(n, n, dtype=torch.bool, device=model.device).tril()
    hidden = model.hidden_states(tokens.to(model.device), positions, positions, causal)
    argmax = model.lm_head(hidden).argmax(-1)
    return hidden.float().cpu(), argmax.cpu()


def extract(
    model: Transformer,
    sequences: list[list[int]],
    folder: Path,
    progress: bool = True,
) -> list[Path]:
    """Write the shards for `sequences` (skipping complete ones); return all shard paths."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    todo = sum(
        len(sequences[j : j + SHARD])
        for j in range(0, len(sequences), SHARD)
        if not shard_path(folder, j // SHARD).exists()
    )
    bar = tqdm(
        total=todo * len(sequences[0]) if sequences else 0,
        unit="tok",
        desc="target features",
        disable=not progress,
    )
    for start in range(0, len(sequences), SHARD):
        path = shard_path(folder, start // SHARD)
        paths.append(path)
        if path.exists():
            continue
        batch = torch.tensor(sequences[start : start + SHARD], dtype=torch.long)  # [n, T]
        feats, tops = [], []
        for row in batch:
            hidden, argmax = target_features(model, row)
            feats.append(hidden)
            tops.append(argmax)
            bar.update(row.shape[0])
        write_shard(path, batch, torch.stack(feats), torch.stack(tops))
    bar.close()
    return paths


def write_shard(
    path: Path,
    tokens: torch.Tensor,  # [n, T]
    features: torch.Tensor,  # [n, T, hidden]
    argmax: torch.Tensor,  # [n, T]
) -> None:
    """Save one shard in the layout above: written under a temporary name, then renamed, so
    the file exists only once complete."""
    tmp = path.with_suffix(".tmp")
    save_file(
        {"tokens": tokens.int(), "features": features.half(), "argmax": argmax.int()}, str(tmp)
    )
    tmp.rename(path)


def load_shards(paths: list[Path]) -> dict[str, torch.Tensor]:
    """Concatenate shards: tokens [N, T], features [N, T, hidden] (float16), argmax [N, T]."""
    parts = [load_file(str(p)) for p in paths]
    return {key: torch.cat([p[key] for p in parts]) for key in ("tokens", "features", "argmax")}
