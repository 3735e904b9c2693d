"""Build understudy's Transformer straight from a GGUF file's own quantized blocks.

The linears become kernels/qgemm.py QuantLinears, their blocks repacked once into the
kernel's panels (nothing is dequantized: resident memory is about the file's size plus
caches, the file's pages under packed tensors released), the token embedding a lookup that
dequantizes only the looked-up rows, and the F32 norms and biases are used as they are.
Fused matmuls (q/k/v, gate/up) concatenate their GGUF tensors as parts of one QuantLinear,
whatever each part's block type. A type qgemm has no kernel for runs dequantized through
rowgemm (`dequantized` names them; quantization="gguf" refuses such a file).

Names, per family as llama.cpp's converter writes them (models/convert.py maps the same
models' Hugging Face names):

- every family: token_embd, output (absent: tied), output_norm; blk.N.attn_norm, attn_q,
  attn_k, attn_v (q/k biases: Qwen2), attn_output, ffn_norm, ffn_gate, ffn_up, ffn_down;
- Qwen3, Qwen3-MoE, Gemma 3: attn_q_norm, attn_k_norm (each head's RMSNorm);
- Gemma 2/3: post_attention_norm and post_ffw_norm after each branch, ffn_norm before the
  MLP. The converter stores every Gemma norm as its factor 1 + w (it adds the one), so these
  norms are built as plain RMSNorms of the stored factor, what llama.cpp multiplies by;
- Phi-3/4: attn_qkv (q, k, v rows fused) and ffn_up holding gate then up rows (fused);
- mixtures (Mixtral, written as "llama", and Qwen3-MoE): ffn_gate_inp (the router, kept F32
  by llama.cpp) and the experts stacked in 3-D tensors ffn_gate_exps, ffn_up_exps
  [experts, width, hidden] and ffn_down_exps, one QuantLinear per expert over its slice.

llama.cpp's converter permutes the rows of a llama-family model's q and k weights (Llama,
Mistral, Mixtral) for its rotary layout; transformers' GGUF loader undoes that for "llama",
and so do we, by reordering rows of blocks (rows are independent).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from torch import nn

from understudy.kernels.qgemm import KERNEL_TYPES, GGUFTensor, QuantEmbedding, QuantLinear
from understudy.models.convert import UnsupportedArchitecture
from understudy.models.gguf_file import GGUFLayout, MappedTensor, mapped_tensors, read_layout
from understudy.models.moe import MLP, SparseMoE
from understudy.models.norms import RMSNorm
from understudy.models.transformer import Block, Transformer, TransformerConfig

ARCHITECTURES = ("qwen2", "llama", "qwen3", "qwen3moe", "gemma2", "gemma3", "phi3")
PERMUTED_QK = ("llama",)  # architectures whose q/k rows llama.cpp permutes


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
    names = layout.names()
    present: dict[str, torch.Tensor] = {"model.embed_tokens.weight": torch.empty(0)}
    if "blk.0.attn_q.bias" in names:
        present["model.layers.0.self_attn.q_proj.bias"] = torch.empty(0)
    if "output.weight" in names:
        present["lm_head.weight"] = torch.empty(0)
    return present


def dequantized(layout: GGUFLayout) -> list[str]:
    """The matrices of the file that would run dequantized: of a type qgemm has no kernel for
    and not plain float32 (which rowgemm runs as it is), e.g. IQ2_XXS, IQ3_S, TQ1_0."""
    return [
        t.name
        for t in layout.tensors
        if len(t.shape) >= 2
        and GGMLQuantizationType(t.tensor_type) not in KERNEL_TYPES
        and t.tensor_type != GGMLQuantizationType.F32
    ]


def _rope_rows(rows: int, heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation (transformers' reverse_permute)."""
    dim = rows // heads // 2
    return np.arange(rows).reshape(heads, dim, 2).swapaxes(2, 1).reshape(-1)


class BlockSource:
    """A file's tensors by GGUF name, as the pieces our modules take."""

    def __init__(self, tensors: dict[str, MappedTensor], arch: str, cfg: TransformerConfig):
        self.tensors, self.permuted, self.cfg = tensors, arch in PERMUTED_QK, cfg

    def has(self, name: str) -> bool:
        return f"{name}.weight" in self.tensors

    def matrix(self, name: str, heads: int | None = None, expert: int | None = None) -> GGUFTensor:
        """`name`.weight [out, in] (an expert's slice of a stacked tensor), its rows in our
        rotary layout when `heads` names a permuted q or k."""
        t = self.tensors[f"{name}.weight"]
        cols, rows = (int(d) for d in t.shape[:2])  # GGUF lists dimensions innermost first
        data = t.data if expert is None else t.data[expert]
        kind = GGMLQuantizationType(t.tensor_type)
        if kind == GGMLQuantizationType.F32:  # a router (or a float32 file): rowgemm packs
            data = np.array(data)  # it anyway; a writable copy, as torch wants what it wraps
        tensor = GGUFTensor(kind, data, rows, cols)
        if heads is not None and self.permuted:
            tensor = tensor.take_rows(_rope_rows(tensor.rows, heads))
        return tensor

    def vector(self, name: str, heads: int | None = None) -> torch.Tensor:
        t = self.tensors[name]
        assert t.tensor_type == GGMLQuantizationType.F32, (t.name, t.tensor_type)
        vec = torch.from_numpy(np.array(t.data, dtype=np.float32))  # a copy: small
        if heads is not None and self.permuted:
            vec = vec[torch.from_numpy(_rope_rows(vec.shape[0], heads))]
        return vec

    def norm(self, name: str) -> RMSNorm:
        """An RMSNorm multiplying by the stored weight (a Gemma norm's stored 1 + w too)."""
        weight = self.vector(f"{name}.weight")
        norm = RMSNorm(weight.shape[0], self.cfg.rms_norm_eps)
        norm.weight = nn.Parameter(weight, requires_grad=False)
        return norm

    def linear(self, names: list[str], heads: list[int | None] | None = None) -> QuantLinear:
        """One QuantLinear over the parts `names` (biases where the first has one)."""
        heads = heads or [None] * len(names)
        parts = [self.matrix(n, h) for n, h in zip(names, heads, strict=True)]
        bias = None
        if f"{names[0]}.bias" in self.tensors:
            bias = torch.cat(
                [self.vector(f"{n}.bias", h) for n, h in zip(names, heads, strict=True)]
            )
        return QuantLinear(parts, bias)


def _attention(layer: Block, src: BlockSource, blk: str) -> None:
    cfg, attn = src.cfg, layer.attn
    if src.has(blk + "attn_qkv"):  # Phi-3: fused already, q then k then v
        attn.wqkv = src.linear([blk + "attn_qkv"])
    else:
        names = [blk + "attn_q", blk + "attn_k", blk + "attn_v"]
        attn.wqkv = src.linear(names, [cfg.num_heads, cfg.num_kv_heads, None])
    attn.wo = src.linear([blk + "attn_output"])
    if cfg.qk_norm:
        attn.q_norm, attn.k_norm = src.norm(blk + "attn_q_norm"), src.norm(blk + "attn_k_norm")
    layer.attn_norm = src.norm(blk + "attn_norm")
    layer.mlp_norm = src.norm(blk + "ffn_norm")
    if cfg.sandwich_norms:  # Gemma
        layer.post_attn_norm = src.norm(blk + "post_attention_norm")
        layer.post_mlp_norm = src.norm(blk + "post_ffw_norm")


def _mlp(mlp: MLP, src: BlockSource, gate_up: list[str], down: str, expert: int | None) -> None:
    mlp.w_gate_up = QuantLinear([src.matrix(n, expert=expert) for n in gate_up], None)
    mlp.w_down = QuantLinear([src.matrix(down, expert=expert)], None)


def _feed_forward(layer: Block, src: BlockSource, blk: str, sparse: bool) -> None:
    if sparse != src.has(blk + "ffn_gate_inp"):
        raise UnsupportedArchitecture(f"{blk}: the file's tensors do not match its metadata")
    mlp = layer.mlp
    if isinstance(mlp, SparseMoE):
        mlp.router = src.linear([blk + "ffn_gate_inp"])
        for e, expert in enumerate(mlp.experts):
            gate_up = [blk + "ffn_gate_exps", blk + "ffn_up_exps"]
            _mlp(expert, src, gate_up, blk + "ffn_down_exps", e)
    elif src.has(blk + "ffn_gate"):
        _mlp(mlp, src, [blk + "ffn_gate", blk + "ffn_up"], blk + "ffn_down", None)
    else:  # Phi-3: ffn_up holds gate then up rows
        _mlp(mlp, src, [blk + "ffn_up"], blk + "ffn_down", None)


def build_from_gguf(path: Path, cfg: TransformerConfig, cache: Path | None = None) -> Transformer:
    """Our Transformer over `path`'s blocks; `cfg` as the blocks path derives it (the dense
    path's, models/gguf_config.py); `cache`: read_layout's."""
    layout = read_layout(path, cache)
    src = BlockSource(mapped_tensors(path, layout), architecture(layout), cfg)
    with torch.device("meta"):
        model = Transformer(cfg)
    model.embed = QuantEmbedding(src.matrix("token_embd"))
    head = "token_embd" if cfg.tie_word_embeddings else "output"
    model.lm_head = QuantLinear([src.matrix(head)], None)
    model.norm = src.norm("output_norm")
    for i, layer in enumerate(model.layers):
        _attention(layer, src, f"blk.{i}.")
        _feed_forward(layer, src, f"blk.{i}.", cfg.sparse(i))
    return model.eval().requires_grad_(False)
