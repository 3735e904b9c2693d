"""What loading gives (LoadedModel), where a spec's weights are (ModelSource), and the small
steps every loading path shares: building our Transformer from its weights, the ids that end
a model's text, and its tokenizer."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from understudy.cache import cache_dir
from understudy.models.transformer import Transformer, TransformerConfig

if TYPE_CHECKING:
    from understudy.models.hf_fallback import FallbackLM


@dataclass
class LoadedModel:
    """A ready model: weights on `device`, tokenizer or None, and the ids that end text."""

    name: str
    model: Transformer | FallbackLM  # FallbackLM: an architecture the fast path lacks
    tokenizer: Any | None  # a transformers tokenizer, or None for token-id-only models
    eos_token_ids: tuple[int, ...]
    from_blocks: bool = False  # runs from its GGUF file's own blocks (quantization="gguf")


@dataclass(frozen=True)
class ModelSource:
    """Where a spec's weights are and how load_model runs them: a GGUF file (`gguf`, with
    `ident`, its key in the cache), from its own blocks or dense; or (gguf None) a Hugging
    Face directory or hub id, which transformers reads."""

    spec: str
    gguf: Path | None = None
    ident: str = ""
    from_blocks: bool = False

    @property
    def meta_dir(self) -> Path:
        """Where what is derived from the GGUF file once (layout, config, tokenizer) is kept."""
        return cache_dir() / "gguf-meta" / self.ident[:24]


def build_model(
    cfg: TransformerConfig, weights: dict[str, torch.Tensor], device: torch.device
) -> Transformer:
    with torch.device("meta"):
        model = Transformer(cfg)
    model.load_state_dict(weights, strict=True, assign=True)
    return model.to(device).eval().requires_grad_(False)


def eos_ids(generation_config: Any, config: Any) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (generation_config, config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.append(value)
        elif isinstance(value, (list, tuple)):
            ids.extend(int(v) for v in value)
    return tuple(dict.fromkeys(ids))


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def load_tokenizer(spec: str) -> Any | None:
    """The model's tokenizer, or None when it has none (a local directory without one)."""
    from transformers import AutoTokenizer

    if os.path.isdir(spec) and not any(
        os.path.exists(os.path.join(spec, f)) for f in TOKENIZER_FILES
    ):
        return None
    try:
        tokenizer = AutoTokenizer.from_pretrained(spec)
    except (OSError, ValueError, TypeError, KeyError):
        return None
    return tokenizer if len(tokenizer) > 0 else None
