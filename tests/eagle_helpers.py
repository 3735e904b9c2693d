"""Helpers for the method="eagle" tests: text the tiny target writes itself, the settings of
a tiny head, and one call that trains such a head into a folder."""

from __future__ import annotations

from pathlib import Path

import torch

from understudy import Engine, SamplingParams
from understudy.head.pipeline import HeadSettings, train_head
from understudy.head.train import TrainConfig
from understudy.models.loader import load_model

SETTINGS = HeadSettings(
    intermediate_size=96,
    draft_vocab_size=256,
    train=TrainConfig(epochs=8, batch=4, lr=3e-3, warmup=5, checkpoint_every=1000),
)


def target_written_text(target: str, count: int, seed: int, temperature: float) -> list[list[int]]:
    """Random 8-token prompts continued by the target itself: 64-token training sequences."""
    plain = Engine.from_pretrained(target=target, method="none", dtype="float32")
    gen = torch.Generator().manual_seed(seed)
    sequences = []
    for i in range(count):
        prompt = torch.randint(1, 300, (8,), generator=gen).tolist()
        params = SamplingParams(max_tokens=56, temperature=temperature, seed=i, ignore_eos=True)
        sequences.append(prompt + plain.generate(prompt, params).token_ids)
    return sequences


def train_greedy_head(target: str, folder: Path) -> dict:
    """Train a head with SETTINGS on 40 sequences the target wrote greedily; return its
    metadata (train_head's). The `trained` fixture of each eagle test file calls this."""
    sequences = target_written_text(target, 40, seed=0, temperature=0.0)
    return train_head(load_model(target, "float32"), sequences, folder, "test", SETTINGS, False)
