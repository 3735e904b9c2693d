"""Random valid GGUF blocks and tiny GGUF files written with gguf's own GGUFWriter."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

from understudy.kernels.qgemm import GGUFTensor

T = GGMLQuantizationType
# where each format keeps its float16 scales, and a scale that gives weights of std ~0.02-0.1
SCALES = {
    T.Q4_K: ((0, 2), 1e-4),
    T.Q6_K: ((208,), 3e-5),
    T.Q8_0: ((0,), 5e-4),
    T.Q5_0: ((0,), 4e-3),
}


def random_blocks(
    kind: GGMLQuantizationType, rows: int, cols: int, seed: int, scale: float = 0.01
) -> np.ndarray:
    """[rows, row_bytes] uint8: random blocks of `kind` (random quant bytes, finite f16
    scales of std `scale`)."""
    block, size = GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for offset in SCALES[kind][0]:
        scales = (rng.standard_normal((rows, cols // block)) * scale).astype(np.float16)
        data[:, :, offset : offset + 2] = scales.view(np.uint8).reshape(rows, cols // block, 2)
    return data.reshape(rows, -1)


def random_tensor(kind: GGMLQuantizationType, rows: int, cols: int, seed: int) -> GGUFTensor:
    return GGUFTensor(kind, random_blocks(kind, rows, cols, seed), rows, cols)


# a tiny Qwen2 whose linears cover every kernel type and one float16 part
TINY = {"hidden": 256, "inter": 512, "heads": 4, "kv_heads": 2, "layers": 2, "vocab": 320}
LAYER_TYPES = {
    "attn_q": T.Q4_K,
    "attn_k": T.F16,
    "attn_v": T.Q6_K,
    "attn_output": T.Q5_0,
    "ffn_gate": T.Q4_K,
    "ffn_up": T.Q8_0,
    "ffn_down": T.Q6_K,
}


def write_tiny_qwen2_gguf(path: Path, seed: int = 0, eos: int = 0, tied: bool = False) -> Path:
    """A tiny random Qwen2 GGUF file (no tokenizer: token-id prompts), weights in mixed
    block types; embedding Q8_0, output Q6_K (or tied to the embedding)."""
    h, inter, heads, kv = TINY["hidden"], TINY["inter"], TINY["heads"], TINY["kv_heads"]
    head_dim = h // heads
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), "qwen2")
    writer.add_block_count(TINY["layers"])
    writer.add_context_length(2048)
    writer.add_embedding_length(h)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(TINY["vocab"])
    writer.add_eos_token_id(eos)
    count = [seed * 1000]

    def add(name: str, kind: GGMLQuantizationType, rows: int, cols: int) -> None:
        count[0] += 1
        if kind == T.F16:
            data = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float16)
            writer.add_tensor(name, data)
        else:
            data = random_blocks(kind, rows, cols, count[0], SCALES[kind][1])
            writer.add_tensor(name, data, raw_dtype=kind)

    def add_f32(name: str, values: np.ndarray) -> None:
        writer.add_tensor(name, values.astype(np.float32))

    add("token_embd.weight", T.Q8_0, TINY["vocab"], h)
    if not tied:
        add("output.weight", T.Q6_K, TINY["vocab"], h)
    add_f32("output_norm.weight", 1 + 0.1 * rng.standard_normal(h))
    shapes = {
        "attn_q": (heads * head_dim, h),
        "attn_k": (kv * head_dim, h),
        "attn_v": (kv * head_dim, h),
        "attn_output": (h, heads * head_dim),
        "ffn_gate": (inter, h),
        "ffn_up": (inter, h),
        "ffn_down": (h, inter),
    }
    for i in range(TINY["layers"]):
        for part, kind in LAYER_TYPES.items():
            add(f"blk.{i}.{part}.weight", kind, *shapes[part])
        for part in ("attn_q", "attn_k", "attn_v"):
            add_f32(f"blk.{i}.{part}.bias", 0.1 * rng.standard_normal(shapes[part][0]))
        add_f32(f"blk.{i}.attn_norm.weight", 1 + 0.1 * rng.standard_normal(h))
        add_f32(f"blk.{i}.ffn_norm.weight", 1 + 0.1 * rng.standard_normal(h))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
