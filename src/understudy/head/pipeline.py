"""From a target and token sequences to a trained head on disk: features, vocabulary, training.

Layout of the output folder (default: the cache's heads/<target>/, where method="eagle"
finds it by itself):
    head.safetensors, config.json      the trained head (models/eagle_head.py)
    features-<corpus>-<T>/             cached target features (head/features.py), reusable
    checkpoint.pt                      the training state, for resuming
Every stage resumes: shards already extracted are kept, a checkpoint is continued.
"""

from __future__ import annotations

import gc
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from understudy.head.features import SHARD, extract, load_shards
from understudy.head.train import TrainConfig, choose_vocab, train
from understudy.models.eagle_head import EagleHead, HeadConfig, lm_rows, save_head
from understudy.models.loader import LoadedModel


@dataclass(frozen=True)
class HeadSettings:
    intermediate_size: int = 4096
    draft_vocab_size: int = 8192
    train: TrainConfig = TrainConfig()


def release_layers(target: LoadedModel) -> None:
    """Free the target's decoder layers and caches (training needs only its embedding and LM
    rows): gigabytes back for the training run."""
    model = target.model
    model.layers = nn.ModuleList()
    model.k_cache, model.v_cache = [], []
    gc.collect()


def train_head(
    target: LoadedModel,
    sequences: list[list[int]],
    folder: Path,
    corpus: str,
    settings: HeadSettings = HeadSettings(),
    progress: bool = True,
) -> dict[str, object]:
    """Extract features (cached), train, save; returns the config.json "meta" facts.
    Releases the target's layers once the features are extracted (`release_layers`)."""
    if len(sequences) < 2:
        raise ValueError("training a head needs at least 2 sequences (one is held out)")
    seq_len = len(sequences[0])
    t0 = time.perf_counter()
    paths = extract(target.model, sequences, folder / f"features-{corpus}-{seq_len}", progress)
    extract_s = time.perf_counter() - t0
    data = load_shards(paths)
    release_layers(target)
    held_out = max(1, min(SHARD, len(sequences) // 10))
    train_part = {k: v[:-held_out] for k, v in data.items()}
    val_part = {k: v[-held_out:] for k, v in data.items()}
    model = target.model
    cfg = HeadConfig.for_target(model.cfg, settings.intermediate_size, settings.draft_vocab_size)
    vocab = choose_vocab(
        train_part["argmax"], train_part["tokens"], model.cfg.vocab_size, cfg.draft_vocab_size
    )
    head = EagleHead(cfg, model.embed)
    head.vocab.copy_(vocab)
    head.lm.weight.data = lm_rows(model, vocab).float()
    with torch.no_grad():  # start at the scale of the features it predicts
        head.norm.weight.copy_(model.norm.weight)
    coverage = float(torch.isin(val_part["argmax"].long(), vocab).float().mean())
    facts = train(head, train_part, val_part, settings.train, folder, progress)
    meta = {
        "target": target.name,
        "corpus": corpus,
        "sequence_length": seq_len,
        "sequences": len(sequences),
        "tokens": len(sequences) * seq_len,
        "extract_seconds_this_run": round(extract_s, 1),
        "draft_vocab_coverage_held_out": round(coverage, 4),
        "settings": asdict(settings),
        **facts,
    }
    save_head(head, folder, meta)
    return meta
