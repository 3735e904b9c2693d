"""Random valid GGUF blocks and tiny GGUF files written with gguf's own GGUFWriter."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from understudy.kernels.qgemm import GGUFTensor

T = GGMLQuantizationType
# where each format keeps its float16 scales, and a scale that gives weights of std ~0.02-0.1
SCALES = {
    T.Q4_K: ((0, 2), 1e-4),
    T.Q6_K: ((208,), 3e-5),
    T.Q8_0: ((0,), 5e-4),
    T.Q5_0: ((0,), 4e-3),
    T.Q5_K: ((0, 2), 1e-4),
    T.Q3_K: ((108,), 1e-3),
    T.Q2_K: ((80, 82), 4e-3),
    T.IQ4_XS: ((0,), 5e-5),
    T.IQ4_NL: ((0,), 1e-3),
    T.Q4_1: ((0, 2), 5e-3),
    T.Q5_1: ((0, 2), 3e-3),
    T.TQ1_0: ((52,), 2e-2),  # a type qgemm has no kernel for: it runs dequantized
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


def scaled_blocks(kind: GGMLQuantizationType, data: np.ndarray, scale: float) -> np.ndarray:
    """Blocks [rows, row_bytes] with every float16 scale times `scale` (a copy)."""
    block, size = GGML_QUANT_SIZES[kind]
    out = data.reshape(data.shape[0], -1, size).copy()
    for offset in SCALES[kind][0]:
        halves = out[:, :, offset : offset + 2].copy().view(np.float16)
        out[:, :, offset : offset + 2] = (halves * np.float16(scale)).view(np.uint8)
    return out.reshape(data.shape)


def random_tensor(kind: GGMLQuantizationType, rows: int, cols: int, seed: int) -> GGUFTensor:
    return GGUFTensor(kind, random_blocks(kind, rows, cols, seed), rows, cols)


# a tiny Qwen2 whose linears cover five kernel types: each layer runs through
# kernels/fused_layer
TINY = {"hidden": 256, "inter": 512, "heads": 4, "kv_heads": 2, "layers": 2, "vocab": 320}
KERNEL_LAYER_TYPES = {
    "attn_q": T.Q4_K,
    "attn_k": T.Q8_0,
    "attn_v": T.Q6_K,
    "attn_output": T.Q5_0,
    "ffn_gate": T.Q4_K,
    "ffn_up": T.Q8_0,
    "ffn_down": T.Q6_K,
}
# the same with one float32 part, which qgemm has no kernel for (it runs dequantized)
MIXED_LAYER_TYPES = {**KERNEL_LAYER_TYPES, "attn_k": T.F32}
# the other kernel types, a kind for each of the two layers
MORE_LAYER_TYPES = {
    "attn_q": (T.Q5_K, T.F16),
    "attn_k": (T.Q3_K, T.BF16),
    "attn_v": (T.IQ4_XS, T.Q5_K),
    "attn_output": (T.Q2_K, T.IQ4_NL),
    "ffn_gate": (T.IQ4_NL, T.Q3_K),
    "ffn_up": (T.Q4_1, T.Q2_K),
    "ffn_down": (T.Q5_1, T.IQ4_XS),
}


def write_tiny_qwen2_gguf(
    path: Path,
    seed: int = 0,
    eos: int = 0,
    tied: bool = False,
    layer_types: dict[str, GGMLQuantizationType | tuple[GGMLQuantizationType, ...]] = (
        KERNEL_LAYER_TYPES
    ),
    head_scale: float = 1.0,
    layers: int = TINY["layers"],
) -> Path:
    """A tiny random Qwen2 GGUF file (no tokenizer: token-id prompts), weights in mixed
    block types (`layer_types`: a kind for every layer, or a tuple of one per layer);
    embedding Q8_0, output Q6_K (or tied to the embedding).
    `head_scale` multiplies the output's float16 scales: the same seed with a larger one is
    the same network with sharper logits (a draft that ranks tokens as the target does).
    `layers`: how many decoder layers."""
    h, inter, heads, kv = TINY["hidden"], TINY["inter"], TINY["heads"], TINY["kv_heads"]
    head_dim = h // heads
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), "qwen2")
    writer.add_block_count(layers)
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

    def add(
        name: str, kind: GGMLQuantizationType, rows: int, cols: int, scale: float = 1.0
    ) -> None:
        count[0] += 1
        if kind in (T.F16, T.F32, T.BF16):  # float16 values, stored as `kind`
            data = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float16)
            if kind == T.BF16:
                top = data.astype(np.float32).view(np.uint32) >> 16  # truncated to bfloat16
                writer.add_tensor(name, top.astype(np.uint16).view(np.uint8), raw_dtype=kind)
            else:
                writer.add_tensor(name, data.astype(np.float32) if kind == T.F32 else data)
        else:
            data = random_blocks(kind, rows, cols, count[0], SCALES[kind][1])
            if scale != 1.0:
                data = scaled_blocks(kind, data, scale)
            writer.add_tensor(name, data, raw_dtype=kind)

    def add_f32(name: str, values: np.ndarray) -> None:
        writer.add_tensor(name, values.astype(np.float32))

    add("token_embd.weight", T.Q8_0, TINY["vocab"], h)
    if not tied:
        add("output.weight", T.Q6_K, TINY["vocab"], h, head_scale)
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
    for i in range(layers):
        for part, kinds in layer_types.items():
            kind = kinds[i] if isinstance(kinds, tuple) else kinds
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


OFFSET_NORMS = ("gemma2", "gemma3", "nemotron")  # stored as 1 + w; transformers subtracts 1
MAPPING_KEY = {"qwen3moe": "qwen3_moe"}  # transformers' name of a GGUF architecture


def _phi3_hyperparameters(config, rope: dict) -> dict[str, int | float]:
    """Phi's rotated share of a head, its window (0: none) and LongRoPE's pretraining
    context and cos/sin factor (its factors are tensors: _gguf_tensors)."""
    head_dim = config.hidden_size // config.num_attention_heads
    out: dict[str, int | float] = {"attention.sliding_window": config.sliding_window or 0}
    partial = rope.get("partial_rotary_factor", 1.0)
    if partial < 1.0:
        out["rope.dimension_count"] = int(head_dim * partial)
    if rope.get("rope_type") == "longrope":
        original = rope["original_max_position_embeddings"]
        scale = config.max_position_embeddings / original
        out["rope.scaling.original_context_length"] = original
        out["rope.scaling.attn_factor"] = math.sqrt(1 + math.log(scale) / math.log(original))
    return out


def _hyperparameters(writer: GGUFWriter, config, arch: str) -> None:
    """What transformers' GGUF reader maps (its GGUF_CONFIG_MAPPING), then what llama.cpp's
    converter writes besides and that reader leaves out: a mixture's expert count, top-k and
    width, Phi's rotated share of a head, Gemma 2's soft caps, Gemma 3's rope scaling."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    written: dict[str, int | float] = {}
    rope = config.rope_parameters or {}
    rope = rope.get("full_attention", rope)  # Gemma 3: the global layers' theta is the file's
    for key, attr in GGUF_CONFIG_MAPPING[MAPPING_KEY.get(arch, arch)].items():
        value = getattr(config, attr, None) if isinstance(attr, str) else None
        value = rope.get("rope_theta") if attr == "rope_theta" else value
        if not isinstance(value, bool) and isinstance(value, int | float):
            written[key] = value
    head_dim = getattr(config, "head_dim", None)
    if head_dim:  # llama.cpp writes a head size its config states, for every architecture
        written.setdefault("attention.key_length", head_dim)
        written.setdefault("attention.value_length", head_dim)
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if experts:
        written.setdefault("expert_count", experts)
        written.setdefault("expert_used_count", config.num_experts_per_tok)
    if arch == "qwen3moe":
        written["expert_feed_forward_length"] = config.moe_intermediate_size
    if arch == "phi3":
        written.update(_phi3_hyperparameters(config, rope))
    if arch == "gemma2":
        written["attn_logit_softcapping"] = float(config.attn_logit_softcapping)
        written["final_logit_softcapping"] = float(config.final_logit_softcapping)
    for key, value in written.items():
        adder = writer.add_uint32 if isinstance(value, int) else writer.add_float32
        adder(f"{arch}.{key}", value)
    if arch == "gemma3" and rope.get("rope_type") == "linear":
        writer.add_string("gemma3.rope.scaling.type", "linear")
        writer.add_float32("gemma3.rope.scaling.factor", float(rope["factor"]))
    for special in ("bos", "eos", "pad"):
        token = getattr(config, f"{special}_token_id", None)
        if isinstance(token, int):
            getattr(writer, f"add_{special}_token_id")(token)


def llama3_divisors(config, rope: dict) -> np.ndarray:
    """Llama 3.1's rope scaling as llama.cpp's converter stores it: what each frequency of
    plain rope is divided by (1 for the fast ones, the factor for the slow, a blend between)."""
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    inv_freq = 1.0 / rope["rope_theta"] ** (np.arange(0, dim, 2) / dim)
    wavelength = 2 * math.pi / inv_freq
    old, factor = rope["original_max_position_embeddings"], rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    smooth = (old / wavelength - low) / (high - low)
    blend = 1 / ((1 - smooth) / factor + smooth)
    slow = np.where(wavelength > old / low, factor, blend)
    return np.where(wavelength < old / high, 1.0, slow).astype(np.float32)


def _gguf_tensors(model, arch: str) -> list[tuple[str, np.ndarray]]:
    """(gguf name, float32 data) of every tensor llama.cpp's converter writes: llama's q/k
    rows permuted, OFFSET_NORMS' norms as 1 + w, a mixture's router and stacked experts
    (gate and up apart) under their GGUF names, a tied head left out."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    config = model.config
    code = next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch)
    names = get_tensor_name_map(code, config.num_hidden_layers)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    out = []
    rope = config.rope_parameters or {}
    if rope.get("rope_type") == "llama3":  # llama.cpp's converter writes the divisors so
        out.append(("rope_freqs.weight", llama3_divisors(config, rope)))
    if rope.get("rope_type") == "longrope":  # llama.cpp's converter writes the factors so
        for kind in ("long", "short"):
            factors = np.array(rope[f"{kind}_factor"], dtype=np.float32)
            out.append((f"rope_factors_{kind}.weight", factors))
    for hf_name, tensor in model.state_dict().items():
        stem, suffix = hf_name.rsplit(".", 1)
        if stem == "lm_head" and config.tie_word_embeddings:
            continue
        data = tensor.detach().float().numpy()
        if arch == "llama" and stem.endswith(("q_proj", "k_proj")):
            n = heads if stem.endswith("q_proj") else kv_heads  # llama.cpp's permute
            data = data.reshape(n, 2, data.shape[0] // n // 2, *data.shape[1:])
            data = data.swapaxes(1, 2).reshape(tensor.shape)
        if arch in OFFSET_NORMS and stem.endswith("norm") and suffix == "weight":
            data = data + 1.0
        blk = f"blk.{stem.split('.')[2]}." if stem.startswith("model.layers.") else ""
        if stem.endswith("mlp.gate") and suffix == "weight":  # the router
            out.append((f"{blk}ffn_gate_inp.weight", data))
        elif stem.endswith("mlp.experts") and suffix == "gate_up_proj":  # [E, 2I, H]
            width = data.shape[1] // 2
            out.append((f"{blk}ffn_gate_exps.weight", data[:, :width]))
            out.append((f"{blk}ffn_up_exps.weight", data[:, width:]))
        elif stem.endswith("mlp.experts") and suffix == "down_proj":  # [E, H, I]
            out.append((f"{blk}ffn_down_exps.weight", data))
        else:
            out.append((f"{names.get_name(stem)}.{suffix}", data))
    return out


def write_gguf_from_hf(
    model,
    path: Path,
    arch: str,
    kind: GGMLQuantizationType = T.F32,
    types: dict[str, GGMLQuantizationType] | None = None,
    name: str | None = None,
) -> Path:
    """`model` (a transformers causal LM of GGUF architecture `arch`) written as llama.cpp's
    converter writes it, for transformers' GGUF reader: the hyperparameters
    (`_hyperparameters`), tensors under gguf's names (`_gguf_tensors`), matrices as `kind`
    or as `types` says by their GGUF name ("attn_q", "ffn_up_exps"...), norms, biases and
    routers float32 (as llama.cpp keeps them). `name`: the file's general.name (a llama file
    named "mistral..." is read as Mistral). No tokenizer: token-id prompts. A field neither
    writes (Gemma's layer pattern and score scale) comes back as its config default."""
    writer = GGUFWriter(str(path), arch)
    if name is not None:
        writer.add_name(name)
    _hyperparameters(writer, model.config, arch)
    for gguf_name, data in _gguf_tensors(model, arch):
        part = gguf_name.split(".")[-2]
        chosen = (types or {}).get(part, kind)
        if data.ndim == 1 or chosen == T.F32 or part == "ffn_gate_inp":
            writer.add_tensor(gguf_name, np.ascontiguousarray(data, np.float32))
        else:  # gguf's own quantizer: the blocks llama.cpp would write
            blocks = quantize(np.ascontiguousarray(data), chosen)
            writer.add_tensor(gguf_name, blocks, raw_dtype=chosen)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
