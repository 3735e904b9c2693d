"""From a target and token sequences to a trained head on disk: features, vocabulary, training.

Layout of the output folder (default: the cache's heads/<target>/, where method="eagle"
finds it by itself):
    head.safetensors, config.json      the trained head (models/eagle_head.py)
    features-<corpus>-<T><layers>/     cached target features (head/shards.py), reusable
    features-self-<T><layers>/         the target's own continuations (head/self_text.py)
    features-open-<T><layers>/         ... of prompts it began itself from file openers
    features-chat-<T><layers>/         ... its answers to chat requests about code
    checkpoint.pt                      the training state, for resuming
(<layers>: "-layers-1-13-27" where the head reads those layers' outputs, else empty.)
Every stage resumes: shards already extracted are kept, a checkpoint is continued.
"""

from __future__ import annotations

import gc
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from understudy.config import UnderstudyError
from understudy.head.features import extract
from understudy.head.self_text import OPENER_SAMPLED, OPENER_TEMPERATURE
from understudy.head.shards import ShardRows, train_and_held_out
from understudy.head.train import TrainConfig, choose_vocab, train
from understudy.models.eagle_head import (
    WEIGHTS_FILE,
    EagleHead,
    HeadConfig,
    default_feature_layers,
    lm_rows,
    read_head_config,
    save_head,
)
from understudy.models.head_file import file_sha256, load_packed_head, read_packed
from understudy.models.loader import LoadedModel
from understudy.models.norms import norm_scale


@dataclass(frozen=True)
class HeadSettings:
    intermediate_size: int = 4096
    draft_vocab_size: int = 8192
    train: TrainConfig = TrainConfig()
    self_len: int = 256  # tokens per sequence the target writes itself (prompt included)
    # the target layers the head reads (EAGLE-3); None: default_feature_layers of the
    # target (or an --init head's); (): the final hidden state alone
    feature_layers: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Source:
    """Text the target reads (or continues) for the head: its prompts and how."""

    name: str  # the shards' folder: features-<name>-<seq_len><layers>
    prompts: list[list[int]]  # corpus sequences of seq_len tokens, or prompts to continue
    seq_len: int
    sampled: int = 0  # tokens sampled after each prompt before the greedy rest


def release_layers(target: LoadedModel) -> None:
    """Free the target's decoder layers and caches (training needs only its embedding and LM
    rows): gigabytes back for the training run."""
    model = target.model
    model.layers = nn.ModuleList()
    model.k_cache, model.v_cache = [], []
    model.fused_stack = None
    gc.collect()


def feature_layers_of(target: LoadedModel, settings: HeadSettings, init: Path | None) -> tuple:
    """The layers the head reads: an --init head's, else the settings', else the default."""
    if init is not None:
        return init_config(init).feature_layers
    if settings.feature_layers is not None:
        return settings.feature_layers
    return default_feature_layers(target.model.cfg.num_layers)


def read_sources(
    target: LoadedModel, sources: list[Source], folder: Path, progress: bool
) -> tuple[dict[str, ShardRows], dict[str, ShardRows]]:
    """(train, held out) of every source's shards (extracted where missing), rows cut to the
    shortest sequence length when the lengths differ (shards.train_and_held_out)."""
    layers = target.model.feature_layers
    tag = "-layers-" + "-".join(map(str, layers)) if layers else ""
    paths = []
    for source in sources:
        shards = folder / f"features-{source.name}-{source.seq_len}{tag}"
        paths.append(
            extract(
                target.model,
                source.prompts,
                source.seq_len,
                shards,
                progress,
                sampled=source.sampled,
                temperature=OPENER_TEMPERATURE,
            )  # fmt: skip
        )
    return train_and_held_out(paths, min(source.seq_len for source in sources))


def new_head(
    target: LoadedModel, settings: HeadSettings, layers: tuple, train_part: dict[str, ShardRows]
) -> EagleHead:
    """A fresh head: its draft vocabulary the tokens the target predicts most often, its
    output norm (and its last tap's, when that is the target's last layer) the target's
    final norm, so it starts at the scale of what it predicts, reading f as it is."""
    model = target.model
    cfg = HeadConfig.for_target(
        model.cfg, settings.intermediate_size, settings.draft_vocab_size, layers
    )
    vocab = choose_vocab(
        train_part["argmax"][:], train_part["tokens"][:], model.cfg.vocab_size, cfg.draft_vocab_size
    )
    head = EagleHead(cfg, model.embed)
    head.vocab.copy_(vocab)
    head.lm.weight.data = lm_rows(model, vocab).float()
    with torch.no_grad():
        head.norm.weight.copy_(norm_scale(model.norm))
        if layers and layers[-1] == model.cfg.num_layers - 1:
            head.tap_norms[-1].weight.copy_(norm_scale(model.norm))
    return head


def init_config(init: Path) -> HeadConfig:
    """The config of an --init head: a packed head's file or a trained head's folder."""
    return read_packed(init)[0] if init.is_file() else read_head_config(init)[0]


def start_head(target: LoadedModel, init: Path) -> EagleHead:
    """A head to train further: `init`'s weights and draft vocabulary (a head of this target).
    A packed head (`init` a file) starts from its Q4_0 weights dequantized: the float
    weights it was packed from are not in it, and training moves its weights off the grid."""
    if init.is_file():
        _, digest, _ = read_packed(init)
        if digest != file_sha256(target.name):
            raise UnderstudyError(
                f"--init {init}: a head packed for another target file (sha256 {digest[:12]}...), "
                f"not {target.name!r}"
            )
        return load_packed_head(init, target.model).float()
    init_cfg, meta = read_head_config(init)
    if meta.get("target") not in (None, target.name):
        raise UnderstudyError(
            f"--init {init}: a head of {meta['target']!r}, not of {target.name!r}"
        )
    head = EagleHead(init_cfg, target.model.embed)
    missing, unexpected = head.load_state_dict(load_file(str(init / WEIGHTS_FILE)), strict=False)
    assert set(missing) == {"lm.weight"} and not unexpected, (missing, unexpected)
    head.lm.weight.data = lm_rows(target.model, head.vocab).float()
    return head


def train_head(
    target: LoadedModel,
    sequences: list[list[int]],
    folder: Path,
    corpus: str,
    settings: HeadSettings = HeadSettings(),
    progress: bool = True,
    self_prompts: list[list[int]] | None = None,
    init: Path | None = None,
    opener_prompts: list[list[int]] | None = None,
    chat_prompts: list[list[int]] | None = None,
) -> dict[str, object]:
    """Extract features (cached), train, save; returns the config.json "meta" facts.

    `sequences`: corpus token sequences of one length T. `self_prompts`: prompts the target
    continues itself to `settings.self_len` tokens (head/self_text.py); then both kinds train
    together, corpus sequences cut to that length (T must be a multiple of it). Each source
    holds out its own last sequences. `init`: start from that trained head (its vocabulary
    and feature layers are kept) instead of a fresh one. `opener_prompts`: file openers
    (self_text.opener_prompts) after which the target samples OPENER_SAMPLED tokens of
    prompt, then continues greedily; a third source. `chat_prompts`: chat requests
    (self_text.chat_prompts) the target answers greedily; a fourth. `init` may be a packed
    head's file (models/head_file.py), the package's among them. Releases the target's
    layers once features are extracted."""
    self_prompts = self_prompts or []
    opener_prompts = opener_prompts or []
    chat_prompts = chat_prompts or []
    if len(sequences) + len(self_prompts) + len(opener_prompts) + len(chat_prompts) < 2:
        raise ValueError("training a head needs at least 2 sequences (one is held out)")
    sources = [
        Source(name, prompts, length, sampled)
        for name, prompts, length, sampled in (
            (corpus, sequences, len(sequences[0]) if sequences else 0, 0),
            ("self", self_prompts, settings.self_len, 0),
            ("open", opener_prompts, settings.self_len, OPENER_SAMPLED),
            ("chat", chat_prompts, settings.self_len, 0),
        )
        if prompts
    ]
    layers = feature_layers_of(target, settings, init)
    target.model.feature_layers = layers
    t0 = time.perf_counter()
    train_part, val_part = read_sources(target, sources, folder, progress)
    extract_s = time.perf_counter() - t0
    release_layers(target)
    if init is not None:
        head = start_head(target, init)
    else:
        head = new_head(target, settings, layers, train_part)
    coverage = float(torch.isin(val_part["argmax"][:].long(), head.vocab).float().mean())
    start = "fresh" if init is None else str(init.resolve())
    facts = train(head, train_part, val_part, settings.train, folder, progress, start)
    seq_len = len(sequences[0]) if sequences else settings.self_len
    meta = {
        "target": target.name,
        "target_sha256": file_sha256(target.name),
        "corpus": corpus if sequences else "self",
        "sequence_length": seq_len,
        "sequences": len(sequences),
        "tokens": len(sequences) * seq_len,
        "self_sequences": len(self_prompts),
        "self_tokens": len(self_prompts) * settings.self_len,
        "opener_sequences": len(opener_prompts),
        "opener_tokens": len(opener_prompts) * settings.self_len,
        "chat_sequences": len(chat_prompts),
        "chat_tokens": len(chat_prompts) * settings.self_len,
        "init": str(init) if init is not None else None,
        "feature_layers": list(layers),
        "extract_seconds_this_run": round(extract_s, 1),
        "draft_vocab_coverage_held_out": round(coverage, 4),
        "settings": asdict(settings),
        **facts,
    }
    save_head(head, folder, meta)
    return meta
