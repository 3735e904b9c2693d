"""A model as the loader would build it, without its weights, for the engine's rules to ask.

`understudy inspect` (engine/inspect.py) says what the engine would do with a model in
seconds, reading its metadata and tensor table but never its weights. The engine's rules
are functions of a loaded model (pass_shape.target_pass_shape and check_compatible,
seats.kv_bytes, the runner's cache size, eagle.find_head, FallbackLM.why_inexact), so rather
than restate them, this module builds the model they read with every weight on the meta
device (shapes, no memory). `WeightlessTransformer` and `WeightlessFallback` report the dtype
and device the loader would give the model, and record the cache a runner asks for instead
of allocating it: each rule then answers for the weightless model as for the loaded one, and
stays true when the rules change.

Which model the loader would build is decided by the loader's own functions: `locate`
(GGUF blocks, dense GGUF, or a Hugging Face folder / id), `describe_gguf` (a GGUF file's
config, read once and cached), config_from_hf (our Transformer, or transformers' own code)
and hf_fallback.prepare_fallback (what the fallback refuses before any pass).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch

from understudy.config import UnderstudyError
from understudy.models.convert import UnsupportedArchitecture, config_from_hf
from understudy.models.gguf_file import GGUFLayout, read_layout
from understudy.models.gguf_load import describe_gguf
from understudy.models.hf_fallback import FallbackConfig, FallbackLM, prepare_fallback
from understudy.models.loaded import LoadedModel, ModelSource
from understudy.models.loader import hf_tokens, resolve_dtype
from understudy.models.transformer import Transformer, TransformerConfig

PATHS = ("blocks", "dense", "transformers")  # our Transformer on GGUF blocks, dense; fallback


class WeightlessTransformer(Transformer):
    """Our Transformer with its weights on the meta device, placed (dtype, device) where the
    loader would place it; `allocate_cache` records the slots instead of allocating them."""

    def __init__(self, cfg: TransformerConfig, dtype: torch.dtype, device: torch.device) -> None:
        with torch.device("meta"):
            super().__init__(cfg)
        if cfg.tie_word_embeddings:  # the loader's tied head is the embedding's own tensor
            self.lm_head.weight = self.embed.weight
        self.placed = (dtype, device)
        self.recorded_slots = 0

    @property
    def dtype(self) -> torch.dtype:
        return self.placed[0]

    @property
    def device(self) -> torch.device:
        return self.placed[1]

    @property
    def cache_slots(self) -> int:
        return self.recorded_slots

    def allocate_cache(self, slots: int) -> None:
        self.recorded_slots = slots


class WeightlessFallback(FallbackLM):
    """A FallbackLM around a transformers model on the meta device, placed (dtype, device)
    where the loader would place it; `allocate_cache` records the slots."""

    def __init__(
        self,
        hf: Any,
        cfg: FallbackConfig,
        kinds: list[str],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__(hf, cfg, kinds, None)
        self.placed = (dtype, device)

    @property
    def dtype(self) -> torch.dtype:
        return self.placed[0]

    @property
    def device(self) -> torch.device:
        return self.placed[1]

    def allocate_cache(self, slots: int) -> None:
        self.slots = slots


@dataclass
class Weightless:
    """A spec's model as the loader would build it, weightless (`loaded.model`), with what
    else the inspection reads: where it lies, its path (one of PATHS), the transformers
    config of its family facts (None where the GGUF's cached description stands for it),
    and a GGUF file's tensor table."""

    loaded: LoadedModel
    source: ModelSource
    path: str
    hf_config: Any | None = None
    layout: GGUFLayout | None = None
    refusal: str | None = None  # why our Transformer refused it (path "transformers")


def weightless_gguf(
    source: ModelSource, dtype: str | torch.dtype, device: torch.device
) -> Weightless:
    """The GGUF file of `source` as the loader would build it: from its blocks (float32 on
    the CPU) or dense in `dtype`. UnsupportedArchitecture where config_from_hf refuses it
    (the transformers fallback does not read GGUF files)."""
    assert source.gguf is not None
    layout = read_layout(source.gguf, source.meta_dir)
    try:
        described = describe_gguf(source)
    except UnsupportedArchitecture as refusal:  # as the loader's dense path refuses it
        raise UnsupportedArchitecture(
            f"{source.gguf.name}: {refusal}; the transformers fallback does not read GGUF "
            "files: load the model's Hugging Face folder or id instead"
        ) from None
    cfg = described.config
    if source.from_blocks:
        model = WeightlessTransformer(cfg, torch.float32, device)
        path = "blocks"
    else:
        model = WeightlessTransformer(cfg, resolve_dtype(dtype, device), device)
        path = "dense"
    loaded = LoadedModel(
        source.spec, model, described.tokenizer(), described.eos_token_ids, source.from_blocks
    )
    return Weightless(loaded, source, path, layout=layout)


def weightless_hf(
    source: ModelSource, dtype: str | torch.dtype, device: torch.device
) -> Weightless:
    """A Hugging Face folder or hub id as the loader would build it (its config, tokenizer
    and generation config are read; its weights are not): our Transformer where
    config_from_hf takes it, else transformers' own code. UnderstudyError, one line, where
    the config cannot be read or the fallback refuses the model."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    spec, torch_dtype = source.spec, resolve_dtype(dtype, device)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = AutoConfig.from_pretrained(spec)
            with torch.device("meta"):
                hf = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    except (OSError, ValueError, KeyError) as err:
        first = (str(err).splitlines() or [type(err).__name__])[0]
        raise UnderstudyError(f"could not load model {spec!r}: {first}") from None
    try:
        generation = GenerationConfig.from_pretrained(spec)
    except OSError:  # no generation_config.json: what from_pretrained derives
        generation = GenerationConfig.from_model_config(config)
    tokenizer, eos = hf_tokens(spec, generation, hf.config)
    why = None
    try:
        model: Transformer | FallbackLM = WeightlessTransformer(
            config_from_hf(hf.config, hf.state_dict()), torch_dtype, device
        )
        path = "dense"
    except UnsupportedArchitecture as refusal:
        cfg, kinds = prepare_fallback(hf, refusal)
        model = WeightlessFallback(hf, cfg, kinds, torch_dtype, device)
        path, why = "transformers", str(refusal)
    loaded = LoadedModel(spec, model, tokenizer, eos)
    text = hf.config.get_text_config(decoder=True)
    return Weightless(loaded, source, path, hf_config=text, refusal=why)
