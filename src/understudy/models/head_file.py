"""method="eagle"'s head packed to ship with the package: int4 weights, bound to one target file.

One safetensors file:
    metadata   format        FORMAT
               config        the HeadConfig (models/eagle_head.py), as JSON
               target_sha256 the sha256 of the target file the head was trained on
               meta          the training run's facts (config.json's "meta"), as JSON
    <linear>.q4      uint8 [N, K/2]     4-bit codes (group GROUP), two a byte, the even
                                        column low
    <linear>.scales  float16 [K/G, N, 2] their scales and zeros (w = (q - 8) * s + z, as
                                        models/quant.py's dequantize_int4 reads them)
    <name>           float32            everything else (norms, biases), as trained
    vocab            int64 [N]          the draft vocabulary (target token ids)
The head's LM rows are the target's own and are not in it: `load_packed_head` takes them
from the target, as models/eagle_head.load_head does.

The codes and scales are the trained weights' Q4_0 blocks (gguf's reference quantizer; zero
z = 0), so that beside a GGUF target, where the drafter puts the head in Q4_0 blocks again
(models/block_linears.py), those blocks are bitwise the ones the trained head's own folder
gives: Q4_0 of a block already on its grid gives it back. A packed head drafts as the head
it was packed from (min/max int4 codes, put in Q4_0 again, are rounded twice: the head
drafted worse for it).

Why bound by sha256: the head reads the target's hidden states, which belong to that exact
file's weights (another quantization of the same model moves them), so a head is refused
for any other file rather than drafting badly without a word.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from importlib import resources
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from understudy.config import UnderstudyError
from understudy.models.eagle_head import (
    WEIGHTS_FILE,
    EagleHead,
    HeadConfig,
    lm_rows,
    load_head,
    read_head_config,
)
from understudy.models.quant import dequantize_int4
from understudy.models.registry import resolve_packaged
from understudy.models.transformer import Transformer

FORMAT = "understudy-eagle-head/1"
GROUP = 32  # int4 group size: the drafter's own scheme on a CPU (int4-g32)
MAX_BYTES = 32 * 2**20  # what the package may carry
SHIPPED_NAME = "eagle-head.safetensors"


def shipped_head() -> Path:
    """Where the package keeps its head (the file may be absent)."""
    return Path(str(resources.files("understudy") / "data" / SHIPPED_NAME))


def file_sha256(spec: str) -> str | None:
    """The sha256 of the file a target spec names: a packaged model's registered digest
    (checked when it was fetched), a .gguf file's own (read once, about a second a GB);
    None for a model that is not one file (a Hugging Face folder or id)."""
    packaged = resolve_packaged(spec)
    if packaged is not None:
        return packaged.sha256
    path = Path(spec).expanduser()
    if spec.endswith(".gguf") and path.is_file():
        digest = hashlib.sha256()
        with path.open("rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
        return digest.hexdigest()
    return None


def q4_0_codes(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (codes uint8 [N, K] in 0..15, scales and zeros float16 [K/G, N, 2]): the
    Q4_0 blocks of gguf's reference quantizer in the packed layout, w ~ (q - 8) * d + 0."""
    n, k = w.shape
    blocks = quantize(np.ascontiguousarray(w.numpy()), GGMLQuantizationType.Q4_0)
    blocks = blocks.reshape(n, k // GROUP, 2 + GROUP // 2)  # per block: f16 d, 16 nibble bytes
    d = torch.from_numpy(np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0])
    nibbles = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:]))  # [N, K/G, 16]
    codes = torch.cat([nibbles & 15, nibbles >> 4], dim=-1).reshape(n, k)  # values j, j + 16
    scales = torch.stack([d, torch.zeros_like(d)], dim=-1).transpose(0, 1).contiguous()
    return codes, scales


def pack_head(folder: Path, out: Path, target_sha256: str) -> int:
    """Pack the trained head in `folder` (head.safetensors, config.json) into `out` for the
    target file of digest `target_sha256`; returns the file's size. Refuses a head whose
    packed file would pass MAX_BYTES."""
    cfg, meta = read_head_config(folder)
    state = load_file(str(folder / WEIGHTS_FILE))
    head = EagleHead(cfg, nn.Embedding(1, cfg.hidden_size))
    tensors: dict[str, torch.Tensor] = {}
    linears = {f"{name}.weight" for name, m in head.named_modules() if isinstance(m, nn.Linear)}
    for name, value in state.items():
        if name in linears:
            codes, scales = q4_0_codes(value.float())  # [N, K] 0..15, [K/G, N, 2]
            tensors[f"{name}.q4"] = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()
            tensors[f"{name}.scales"] = scales
        elif name == "vocab":
            tensors[name] = value.long()
        else:
            tensors[name] = value.float().contiguous()
    metadata = {
        "format": FORMAT,
        "config": json.dumps(asdict(cfg)),
        "target_sha256": target_sha256,
        "meta": json.dumps(meta),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    size = tmp.stat().st_size
    if size > MAX_BYTES:
        tmp.unlink()
        raise UnderstudyError(
            f"the packed head would be {size / 2**20:.1f} MB, over {MAX_BYTES // 2**20} MB: "
            "train a narrower one (--intermediate-size)"
        )
    tmp.rename(out)
    return size


def read_packed(path: Path) -> tuple[HeadConfig, str, dict[str, object]]:
    """(config, target_sha256, training facts) of a packed head."""
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
    if metadata.get("format") != FORMAT:
        raise UnderstudyError(f"{path} is not a packed head ({FORMAT})")
    cfg = HeadConfig(**json.loads(metadata["config"]))
    return cfg, metadata["target_sha256"], json.loads(metadata["meta"])


def load_packed_head(path: Path, target: Transformer) -> EagleHead:
    """The packed head at `path` for `target` (the caller has checked the file it belongs
    to), its weights dequantized (the drafter quantizes them again for its kernels)."""
    cfg, _, _ = read_packed(path)
    packed = load_file(str(path))
    state = {}
    for name, value in packed.items():
        if name.endswith(".scales"):
            continue
        if name.endswith(".q4"):
            low, high = value & 15, value >> 4
            q = torch.stack([low, high], dim=-1).flatten(1).int()  # [N, K]
            state[name.removesuffix(".q4")] = dequantize_int4(q, packed[f"{name[:-3]}.scales"])
        else:
            state[name] = value
    head = EagleHead(cfg, target.embed)
    missing, unexpected = head.load_state_dict(state, strict=False)
    assert set(missing) == {"lm.weight"} and not unexpected, (missing, unexpected)
    head.lm.weight.data = lm_rows(target, head.vocab)
    return head.to(device=target.device, dtype=target.dtype).eval()


def load_any_head(path: Path, target: Transformer) -> EagleHead:
    """A head for `target` from a trained head's folder or a packed head's file."""
    return load_packed_head(path, target) if path.is_file() else load_head(path, target)
