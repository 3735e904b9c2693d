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

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from torch import nn

from understudy.kernels.qgemm import GGUFTensor, QuantEmbedding, QuantLinear
from understudy.models.convert import UnsupportedArchitecture
from understudy.models.transformer import Transformer, TransformerConfig

ARCHITECTURES = ("qwen2", "llama")
PERMUTED_QK = ("llama",)  # architectures whose q/k rows llama.cpp permutes


def architecture(reader: GGUFReader) -> str:
    field = reader.fields.get("general.architecture")
    arch = None if field is None else field.contents()
    if arch not in ARCHITECTURES:
        raise UnsupportedArchitecture(
            f"GGUF architecture {arch!r} cannot run from its blocks "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )
    return arch


def runs_from_blocks(path: Path) -> bool:
    """Whether the GGUF file's architecture is one this path builds (quantization="auto"
    takes the dense path for the others)."""
    field = GGUFReader(str(path)).fields.get("general.architecture")
    return field is not None and field.contents() in ARCHITECTURES


def tensor_names(reader: GGUFReader) -> dict[str, torch.Tensor]:
    """The dense path's Hugging Face parameter names this file has, each mapped to an empty
    tensor: what config_from_hf reads to see biases and an untied head."""
    names = {t.name for t in reader.tensors}
    present: dict[str, torch.Tensor] = {"model.embed_tokens.weight": torch.empty(0)}
    if "blk.0.attn_q.bias" in names:
        present["model.layers.0.self_attn.q_proj.bias"] = torch.empty(0)
    if "output.weight" in names:
        present["lm_head.weight"] = torch.empty(0)
    return present


def _tensor(t: ReaderTensor) -> GGUFTensor:
    cols, rows = (int(d) for d in t.shape)  # GGUF lists dimensions innermost first
    return GGUFTensor(GGMLQuantizationType(t.tensor_type), t.data, rows, cols)


def _rope_rows(rows: int, heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation (transformers' reverse_permute)."""
    dim = rows // heads // 2
    return np.arange(rows).reshape(heads, dim, 2).swapaxes(2, 1).reshape(-1)


def _vector(t: ReaderTensor) -> torch.Tensor:
    assert t.tensor_type == GGMLQuantizationType.F32, (t.name, t.tensor_type)
    return torch.from_numpy(np.array(t.data, dtype=np.float32))  # a copy: small


def build_from_gguf(path: Path, cfg: TransformerConfig) -> Transformer:
    """Our Transformer over `path`'s blocks; `cfg` as the dense path derives it."""
    reader = GGUFReader(str(path))
    arch = architecture(reader)
    tensors = {t.name: t for t in reader.tensors}

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
