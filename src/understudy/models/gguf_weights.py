"""Build understudy's Transformer straight from a GGUF file's own quantized blocks.

The linears become kernels/qgemm.py QuantLinears, their blocks repacked once into the
kernel's panels (nothing is dequantized: resident memory is about the file's size plus
caches, the file's pages under packed tensors released), the token
embedding a lookup that dequantizes only the looked-up rows, and the F32 norms and biases
are used as they are. Fused matmuls (q/k/v, gate/up) concatenate their GGUF tensors as parts
of one QuantLinear, whatever each part's block type.

Names: GGUF's (blk.N.attn_q.weight, ...) map to ours as the dense path's do through
transformers (models/convert.py). llama.cpp's converter permutes the rows of a llama-family
model's q and k weights for its rotary layout; transformers' GGUF loader undoes that for
"llama" (not for "qwen2"), and so do we, by reordering rows of blocks (rows are independent).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.quants import quant_shape_to_byte_shape
from torch import nn

from understudy.kernels.qgemm import GGUFTensor, QuantEmbedding, QuantLinear
from understudy.models.convert import UnsupportedArchitecture
from understudy.models.transformer import Transformer, TransformerConfig

ARCHITECTURES = ("qwen2", "llama")
PERMUTED_QK = ("llama",)  # architectures whose q/k rows llama.cpp permutes


LAYOUT_FILE = "layout.json"
# the element types GGUF stores as plain arrays (every other type: rows of block bytes)
PLAIN_TYPES = {
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a GGUF file: where its data lies and how to read it."""

    name: str
    tensor_type: int  # ggml's type id
    shape: tuple[int, ...]  # GGUF's order, innermost dimension first
    offset: int  # of its data, in bytes from the file's start
    n_bytes: int


@dataclass(frozen=True)
class GGUFLayout:
    """What the blocks path needs of a GGUF file besides its cached config: its architecture
    and tensor table. gguf's reader parses every metadata value one by one in Python (a
    151,936-token vocabulary and its merges: ~20 s a file on a 2-core CPU, which a load paid
    twice); read once per file and kept as JSON beside the cached config."""

    architecture: str | None
    tensors: tuple[TensorEntry, ...]

    @classmethod
    def of(cls, reader: GGUFReader) -> GGUFLayout:
        field = reader.fields.get("general.architecture")
        entries = tuple(
            TensorEntry(
                t.name, int(t.tensor_type), tuple(int(d) for d in t.shape), int(t.data_offset),
                int(t.n_bytes),
            )
            for t in reader.tensors
        )  # fmt: skip
        return cls(None if field is None else str(field.contents()), entries)


def read_layout(path: Path, cache: Path | None = None) -> GGUFLayout:
    """`path`'s layout, from `cache`/LAYOUT_FILE when there, else parsed (and kept there)."""
    kept = None if cache is None else cache / LAYOUT_FILE
    if kept is not None and kept.exists():
        raw = json.loads(kept.read_text())
        entries = tuple(TensorEntry(**{**e, "shape": tuple(e["shape"])}) for e in raw["tensors"])
        return GGUFLayout(raw["architecture"], entries)
    layout = GGUFLayout.of(GGUFReader(str(path)))
    if kept is not None:
        kept.parent.mkdir(parents=True, exist_ok=True)
        partial = kept.with_suffix(f".{os.getpid()}.partial")
        raw = {"architecture": layout.architecture, "tensors": [asdict(e) for e in layout.tensors]}
        partial.write_text(json.dumps(raw))
        partial.replace(kept)  # whole or absent: a reader never sees half a file
    return layout


@dataclass(frozen=True)
class MappedTensor:
    """A tensor's data mapped from the file, shaped as gguf's reader shapes it: rows of
    block bytes for block types, an array of its elements for the plain ones."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


def mapped_tensors(path: Path, layout: GGUFLayout) -> dict[str, MappedTensor]:
    """Every tensor of `path` by name, each a view of one read-only map of the file."""
    file = np.memmap(path, mode="r")
    out = {}
    for e in layout.tensors:
        kind = GGMLQuantizationType(e.tensor_type)
        dims = tuple(reversed(e.shape))
        raw = file[e.offset : e.offset + e.n_bytes]
        if kind in PLAIN_TYPES:
            data = raw.view(PLAIN_TYPES[kind]).reshape(dims)
        else:
            assert kind in GGML_QUANT_SIZES, kind
            data = raw.reshape(quant_shape_to_byte_shape(dims, kind))
        out[e.name] = MappedTensor(e.name, kind, e.shape, data)
    return out


def architecture(layout: GGUFLayout) -> str:
    arch = layout.architecture
    if arch not in ARCHITECTURES:
        raise UnsupportedArchitecture(
            f"GGUF architecture {arch!r} cannot run from its blocks "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )
    return arch


def runs_from_blocks(path: Path, cache: Path | None = None) -> bool:
    """Whether the GGUF file's architecture is one this path builds (quantization="auto"
    takes the dense path for the others). `cache`: read_layout's."""
    return read_layout(path, cache).architecture in ARCHITECTURES


def tensor_names(layout: GGUFLayout) -> dict[str, torch.Tensor]:
    """The dense path's Hugging Face parameter names this file has, each mapped to an empty
    tensor: what config_from_hf reads to see biases and an untied head."""
    names = {t.name for t in layout.tensors}
    present: dict[str, torch.Tensor] = {"model.embed_tokens.weight": torch.empty(0)}
    if "blk.0.attn_q.bias" in names:
        present["model.layers.0.self_attn.q_proj.bias"] = torch.empty(0)
    if "output.weight" in names:
        present["lm_head.weight"] = torch.empty(0)
    return present


def _tensor(t: MappedTensor) -> GGUFTensor:
    cols, rows = (int(d) for d in t.shape)  # GGUF lists dimensions innermost first
    return GGUFTensor(GGMLQuantizationType(t.tensor_type), t.data, rows, cols)


def _rope_rows(rows: int, heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation (transformers' reverse_permute)."""
    dim = rows // heads // 2
    return np.arange(rows).reshape(heads, dim, 2).swapaxes(2, 1).reshape(-1)


def _vector(t: MappedTensor) -> torch.Tensor:
    assert t.tensor_type == GGMLQuantizationType.F32, (t.name, t.tensor_type)
    return torch.from_numpy(np.array(t.data, dtype=np.float32))  # a copy: small


def build_from_gguf(path: Path, cfg: TransformerConfig, cache: Path | None = None) -> Transformer:
    """Our Transformer over `path`'s blocks; `cfg` as the dense path derives it; `cache`:
    read_layout's."""
    layout = read_layout(path, cache)
    arch = architecture(layout)
    tensors = mapped_tensors(path, layout)

    def weight(name: str, heads: int | None = None) -> GGUFTensor:
        tensor = _tensor(tensors[name])
        if heads is not None and arch in PERMUTED_QK:
            tensor = tensor.take_rows(_rope_rows(tensor.rows, heads))
        return tensor

    def bias(names: list[str], heads: list[int | None]) -> torch.Tensor | None:
        if f"{names[0]}.bias" not in tensors:
            return None
        parts = []
        for name, h in zip(names, heads, strict=True):
            vec = _vector(tensors[f"{name}.bias"])
            if h is not None and arch in PERMUTED_QK:
                vec = vec[torch.from_numpy(_rope_rows(vec.shape[0], h))]
            parts.append(vec)
        return torch.cat(parts)

    with torch.device("meta"):
        model = Transformer(cfg)
    model.embed = QuantEmbedding(weight("token_embd.weight"))
    head = "token_embd.weight" if cfg.tie_word_embeddings else "output.weight"
    model.lm_head = QuantLinear([weight(head)], None)
    model.norm.weight = nn.Parameter(_vector(tensors["output_norm.weight"]), requires_grad=False)
    for i, layer in enumerate(model.layers):
        blk = f"blk.{i}."
        qkv = [blk + "attn_q", blk + "attn_k", blk + "attn_v"]
        heads = [cfg.num_heads, cfg.num_kv_heads, None]
        layer.attn.wqkv = QuantLinear(
            [weight(f"{n}.weight", h) for n, h in zip(qkv, heads, strict=True)],
            bias(qkv, heads),
        )
        layer.attn.wo = QuantLinear([weight(blk + "attn_output.weight")], None)
        layer.mlp.w_gate_up = QuantLinear(
            [weight(blk + "ffn_gate.weight"), weight(blk + "ffn_up.weight")], None
        )
        layer.mlp.w_down = QuantLinear([weight(blk + "ffn_down.weight")], None)
        layer.attn_norm.weight = nn.Parameter(_vector(tensors[blk + "attn_norm.weight"]), False)
        layer.mlp_norm.weight = nn.Parameter(_vector(tensors[blk + "ffn_norm.weight"]), False)
    return model.eval().requires_grad_(False)
