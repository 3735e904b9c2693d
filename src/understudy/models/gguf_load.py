"""A GGUF file loaded: from its own blocks (the kernels) or converted once to dense weights,
and what the file says of itself (config, tokenizer, end-of-text ids), derived once and cached
beside it (models/loader.py chooses which)."""

from __future__ import annotations

import json
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from gguf import GGMLQuantizationType
from safetensors.torch import load_file, save_file

from understudy.cache import cache_dir
from understudy.config import UnderstudyError
from understudy.models.convert import (
    RECURRENT,
    UnsupportedArchitecture,
    config_from_hf,
    convert_state_dict,
)
from understudy.models.loaded import (
    LoadedModel,
    ModelSource,
    build_model,
    eos_ids,
    load_tokenizer,
)
from understudy.models.refusals import log_refusal
from understudy.models.transformer import TransformerConfig


def load_gguf_dense(source: ModelSource, dtype: torch.dtype, device: torch.device) -> LoadedModel:
    """GGUF -> dense weights in `dtype`, converted once and cached as safetensors."""
    assert source.gguf is not None
    dtype_name = str(dtype).removeprefix("torch.")
    cached = cache_dir() / "converted" / f"{source.ident[:24]}-{dtype_name}"
    if not (cached / "done").exists():
        _convert_gguf(source.gguf, cached, dtype, source.meta_dir)
    cfg = TransformerConfig(**json.loads((cached / "config.json").read_text()))
    weights = load_file(str(cached / "model.safetensors"))
    if cfg.tie_word_embeddings:
        weights["lm_head.weight"] = weights["embed.weight"]
    meta = json.loads((cached / "meta.json").read_text())
    tokenizer = load_tokenizer(str(cached / "tokenizer"))
    eos = tuple(meta["eos_token_ids"])
    return LoadedModel(source.spec, build_model(cfg, weights, device), tokenizer, eos)


@dataclass(frozen=True)
class GGUFDescription:
    """What a GGUF file says of itself, derived once without reading its weights and kept
    in its ModelSource.meta_dir: its config (as config_from_hf reads it), the ids that end
    its text, and the folder of its tokenizer (empty when the file has none)."""

    config: TransformerConfig
    eos_token_ids: tuple[int, ...]
    tokenizer_dir: Path

    def tokenizer(self) -> Any | None:
        return load_tokenizer(str(self.tokenizer_dir))


def describe_gguf(source: ModelSource) -> GGUFDescription:
    """The GGUFDescription of `source`'s file, derived on first use (UnsupportedArchitecture,
    one line, where config_from_hf refuses its architecture)."""
    assert source.gguf is not None, f"{source.spec} is not a GGUF file"
    cached = source.meta_dir
    if not (cached / "done").exists():
        _describe_gguf(source.gguf, cached)
    cfg = TransformerConfig(**json.loads((cached / "config.json").read_text()))
    meta = json.loads((cached / "meta.json").read_text())
    return GGUFDescription(cfg, tuple(meta["eos_token_ids"]), cached / "tokenizer")


def load_gguf_blocks(source: ModelSource, insist: bool) -> LoadedModel:
    """GGUF -> our Transformer over the file's own blocks; its config, tokenizer and EOS ids
    are derived as the dense path's are, once, and cached (small files). `insist`
    (quantization="gguf"): refuse a file any part of which the kernels cannot take."""
    from understudy.models.fused import kernel_refusals
    from understudy.models.gguf_file import read_layout
    from understudy.models.gguf_weights import architecture, build_from_gguf, dequantized

    assert source.gguf is not None
    layout = read_layout(source.gguf, source.meta_dir)
    architecture(layout)  # refuses what cannot run so
    names = dequantized(layout)
    if names:
        kind = GGMLQuantizationType(layout.entry(names[0]).tensor_type).name
        _kernel_refusal(
            f"{len(names)} tensors of {source.gguf.name} are of types qgemm has no kernel "
            f"for ({names[0]}: {kind}, ...) and would run dequantized", insist,
        )  # fmt: skip
    described = describe_gguf(source)
    model = build_from_gguf(source.gguf, described.config, source.meta_dir)
    if insist:  # "auto" logs these where the kernels are installed (models/fused.py)
        for reason in kernel_refusals(model):
            _kernel_refusal(reason, insist)
    tokenizer, eos = described.tokenizer(), described.eos_token_ids
    return LoadedModel(source.spec, model, tokenizer, eos, from_blocks=True)


def _kernel_refusal(reason: str, insist: bool) -> None:
    """quantization="gguf" refuses a model a kernel cannot take; "auto" logs why, once."""
    if insist:
        raise UnderstudyError(
            f"quantization='gguf' cannot be used: {reason} "
            "(quantization='auto' runs such parts on the exact portable path)"
        )
    log_refusal(reason)


def _describe_gguf(path: Path, out: Path) -> None:
    """config.json, meta.json and the tokenizer of `path`, without loading its weights."""
    from transformers import AutoConfig, GenerationConfig

    from understudy.models.gguf_config import config_from_gguf
    from understudy.models.gguf_file import read_layout
    from understudy.models.gguf_weights import tensor_names

    layout = read_layout(path, out)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    out.mkdir(parents=True, exist_ok=True)
    cfg = config_from_gguf(config_from_hf(hf_config, tensor_names(layout)), layout, path)
    (out / "config.json").write_text(json.dumps(asdict(cfg)))
    _save_tokenizer_and_eos(path, out, GenerationConfig.from_model_config(hf_config), hf_config)
    (out / "done").write_text("ok")


def _save_tokenizer_and_eos(path: Path, out: Path, generation_config: Any, config: Any) -> None:
    """The GGUF's tokenizer (if it has one) in out/tokenizer, its end-of-text ids in
    out/meta.json: the configs' EOS ids, the tokenizer's, and the chat models' turn ends."""
    from transformers import AutoTokenizer

    eos = eos_ids(generation_config, config)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except KeyError:  # the file has no tokenizer: token-id prompts only
        tokenizer = None
    if tokenizer is not None:
        if tokenizer.eos_token_id is not None:
            eos = tuple(dict.fromkeys((*eos, tokenizer.eos_token_id)))
        # Instruct models end turns with <|im_end|>; GGUF metadata may name only one EOS.
        for extra in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
            tok_id = tokenizer.convert_tokens_to_ids(extra)
            if isinstance(tok_id, int) and tok_id != tokenizer.unk_token_id and tok_id is not None:
                eos = tuple(dict.fromkeys((*eos, tok_id)))
        tokenizer.save_pretrained(str(out / "tokenizer"))
    (out / "meta.json").write_text(json.dumps({"eos_token_ids": list(eos), "source": str(path)}))


def _convert_gguf(path: Path, out: Path, dtype: torch.dtype, meta: Path) -> None:
    """transformers reads and dequantizes the file; its config, with what the file states
    besides (models/gguf_config.py), and its weights re-laid for ours go to `out`. `meta`:
    where the file's layout is kept (read_layout's cache, the blocks path's too)."""
    from rich.console import Console
    from transformers import AutoModelForCausalLM, GgufConfig

    from understudy.models.gguf_config import config_from_gguf
    from understudy.models.gguf_file import read_layout

    layout = read_layout(path, meta)
    if layout.architecture == "llama" and layout.metadata.get("llama.expert_count"):
        raise UnsupportedArchitecture(
            f"{path.name}: a mixture of experts stored as 'llama' (Mixtral), which "
            "transformers' GGUF reader reads as a dense model: load it from its blocks "
            "(quantization='auto' or 'gguf')"
        )

    console = Console(stderr=True)
    out.mkdir(parents=True, exist_ok=True)
    with console.status(f"converting {path.name} to dense {dtype} weights (once; cached)..."):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hf = AutoModelForCausalLM.from_pretrained(
                str(path.parent),
                gguf_file=path.name,
                dtype=dtype,
                quantization_config=GgufConfig(dequantize=True),
            )
        sd = hf.state_dict()
        try:
            cfg = config_from_hf(hf.config, sd)
        except UnsupportedArchitecture as refusal:  # the fallback runs Hugging Face folders
            if hf.config.model_type in RECURRENT:
                raise
            raise UnsupportedArchitecture(
                f"{path.name}: {refusal}; the transformers fallback does not read GGUF files: "
                "load the model's Hugging Face folder or id instead"
            ) from None
        cfg = config_from_gguf(cfg, layout, path)
        weights = convert_state_dict(sd, cfg)
        if cfg.tie_word_embeddings:
            weights.pop("lm_head.weight")
        save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
        (out / "config.json").write_text(json.dumps(asdict(cfg)))
        _save_tokenizer_and_eos(path, out, hf.generation_config, hf.config)
        (out / "done").write_text("ok")
    console.print(f"[dim]cached dense weights in {out}[/dim]")
