"""A decoder layer's work around its attention in two C calls (kernels/fused_layer.c).

For a model whose linears all run from GGUF blocks (kernels/qgemm.py) and whose layers are
the plain kind (RMSNorm, full rotary, no q/k norm, no sandwich norms, a SiLU-gated MLP:
Llama, Qwen2, Mistral), `FusedLayer.attention_input` does norm, q/k/v projection, rotation
and the cache write, and `FusedLayer.output` the output projection, residuals, norm and MLP.
Between them the layer's own `Attention.attend_rows` decides which keys each row sees, so
trees, windows and batched groups work as on the module path.

Invariant: row-wise and row-invariant, like every step of a decode pass (the C file's header
comment), and taken for EVERY pass of the model once installed (prefill too): a token's
bits never depend on the path its pass took.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

import torch
from torch import nn

from understudy.cache import cache_dir
from understudy.kernels import qgemm, span_attention
from understudy.kernels.build import VECTOR_FLAGS, open_library
from understudy.models.moe import MLP
from understudy.models.norms import RMSNorm

SOURCE = Path(__file__).with_name("fused_layer.c")
MAX_PARTS = 4


class LinearArgs(ctypes.Structure):
    _fields_ = [
        ("parts", ctypes.c_long),
        ("in_features", ctypes.c_long),
        ("out_features", ctypes.c_long),
        ("kinds", ctypes.c_int * MAX_PARTS),
        ("weights", ctypes.c_void_p * MAX_PARTS),
        ("biases", ctypes.c_void_p * MAX_PARTS),
        ("first", ctypes.c_long * MAX_PARTS),
        ("rows", ctypes.c_long * MAX_PARTS),
    ]


class LayerArgs(ctypes.Structure):
    _fields_ = [
        ("qgemm", ctypes.c_void_p),
        ("qkv", LinearArgs),
        ("o", LinearArgs),
        ("gate_up", LinearArgs),
        ("down", LinearArgs),
        ("norm1", ctypes.c_void_p),
        ("norm2", ctypes.c_void_p),
        ("eps", ctypes.c_float),
        ("hidden", ctypes.c_long),
        ("heads", ctypes.c_long),
        ("kv_heads", ctypes.c_long),
        ("head_dim", ctypes.c_long),
        ("intermediate", ctypes.c_long),
    ]


@cache
def load() -> ctypes.CDLL | None:
    """The compiled library, building it if needed; None when it (or qgemm) cannot be built."""
    lib = open_library(SOURCE, cache_dir() / "kernels", VECTOR_FLAGS)
    if lib is None or qgemm.load() is None:
        return None
    ptr, long = ctypes.c_void_p, ctypes.c_long
    lib.understudy_layer_input.argtypes = [ptr, ptr, long, ptr, ptr, ptr, ptr, ptr, long, ptr]
    lib.understudy_layer_input.argtypes += [ctypes.c_int]
    lib.understudy_layer_input.restype = ctypes.c_int
    lib.understudy_layer_output.argtypes = [ptr, ptr, ptr, long, ctypes.c_int]
    lib.understudy_layer_output.restype = ctypes.c_int
    lib.understudy_layers.argtypes = [ptr, long, ptr, ptr, long] + [ptr] * 5 + [long, ptr, long]
    lib.understudy_layers.argtypes += [ctypes.c_float, ctypes.c_float, ctypes.c_int]
    lib.understudy_layers.restype = ctypes.c_int
    return lib


def linear_args(linear: nn.Module) -> LinearArgs | None:
    """The C view of a QuantLinear whose parts all run in qgemm; None for anything else."""
    if not isinstance(linear, qgemm.QuantLinear) or len(linear.dense) or len(linear.parts) > 4:
        return None
    args = LinearArgs(len(linear.parts), linear.in_features, linear.out_features)
    for i, (kind, weight, bias, at, rows) in enumerate(linear.kernel_calls):
        args.kinds[i], args.weights[i] = kind, weight
        args.biases[i], args.first[i], args.rows[i] = bias or None, at // 4, rows
    return args


class FusedLayer:
    """The two C calls of one layer; holds what their pointers point into."""

    def __init__(self, block: nn.Module, args: LayerArgs, lib: ctypes.CDLL) -> None:
        self.block = block  # keeps the weights, norms and the linears' blocks alive
        self.args = args
        self.lib = lib
        cfg = block.attn.cfg
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    @classmethod
    def of(cls, block: nn.Module) -> FusedLayer | None:
        """The fused form of a transformer Block, or None where the block is of a kind the C
        code does not compute (or the kernels cannot be built)."""
        lib = load()
        attn, mlp, cfg = block.attn, block.mlp, block.attn.cfg
        plain = (
            isinstance(block.attn_norm, RMSNorm)
            and isinstance(block.mlp_norm, RMSNorm)
            and isinstance(block.post_attn_norm, nn.Identity)
            and isinstance(block.post_mlp_norm, nn.Identity)
            and isinstance(attn.q_norm, nn.Identity)
            and cfg.rotary_dim in (None, cfg.head_dim)
            and isinstance(mlp, MLP)
            and cfg.hidden_act == "silu"
            and block.attn_norm.weight.dtype == torch.float32
        )
        if lib is None or not plain:
            return None
        parts = [linear_args(m) for m in (attn.wqkv, attn.wo, mlp.w_gate_up, mlp.w_down)]
        if any(p is None for p in parts):
            return None
        for norm in (block.attn_norm, block.mlp_norm):
            assert norm.weight.is_contiguous()
        address = ctypes.cast(qgemm.load().understudy_qgemm_parts, ctypes.c_void_p).value
        args = LayerArgs(
            address, *parts, block.attn_norm.weight.data_ptr(), block.mlp_norm.weight.data_ptr(),
            block.attn_norm.eps, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.intermediate_size,
        )  # fmt: skip
        return cls(block, args, lib)

    def attention_input(
        self,
        x: torch.Tensor,  # [R, hidden] float32
        cos: torch.Tensor,  # [R, D]
        sin: torch.Tensor,  # [R, D]
        slots: torch.Tensor,  # [R] the cache slots of the rows' keys and values
        k_cache: torch.Tensor,  # [Hkv, S, D], written at `slots`
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Norm, projections, rotation, cache write: the rows' queries [H, R, D]."""
        rows = x.shape[0]
        x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
        slots = slots.to(torch.long).contiguous()
        assert k_cache.is_contiguous() and v_cache.is_contiguous()
        q = torch.empty(rows, self.heads, self.head_dim, dtype=torch.float32)
        code = self.lib.understudy_layer_input(
            ctypes.byref(self.args), x.data_ptr(), rows, cos.data_ptr(), sin.data_ptr(),
            slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[1],
            q.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        assert code == 0, f"layer input failed ({code})"
        return q.transpose(0, 1)  # [H, R, D]

    def output(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """x [R, hidden] after the attention output attn [R, H, D] and the MLP (in place)."""
        x, attn = x.contiguous(), attn.contiguous()
        code = self.lib.understudy_layer_output(
            ctypes.byref(self.args), x.data_ptr(), attn.data_ptr(), x.shape[0],
            torch.get_num_threads(),
        )  # fmt: skip
        assert code == 0, f"layer output failed ({code})"
        return x


NOT_ONE_RUN = span_attention.NOT_ONE_RUN


class FusedStack:
    """Every fused layer of a model in one C call a pass (understudy_layers): the per-layer
    calls and span_attention between them, in C. Only for a pass whose rows all attend by
    span_attention to one run of keys each from slot 0 (the caller checks the pass; the
    call answers False, having changed nothing the caller's own path does not write alike,
    when some row's keys are not one run). The same calls in the same order: the same bits
    as the per-layer path."""

    def __init__(self, layers: list[FusedLayer], scale: float) -> None:
        self.layers = layers  # keeps the LayerArgs alive
        self.lib = layers[0].lib
        self.pointers = (ctypes.c_void_p * len(layers))(
            *[ctypes.addressof(layer.args) for layer in layers]
        )
        self.scale = scale
        attend = span_attention.load()
        assert attend is not None, "span_attention could not be built"
        self.attend = ctypes.cast(attend.understudy_span_attention, ctypes.c_void_p).value

    def run(
        self,
        x: torch.Tensor,  # [R, hidden] float32 contiguous, in place
        cos: torch.Tensor,  # [R, D]
        sin: torch.Tensor,  # [R, D]
        slots: torch.Tensor,  # [R]
        k_caches: list[torch.Tensor],  # each [Hkv, S, D]
        v_caches: list[torch.Tensor],
        mask: torch.Tensor,  # [R, L] bool: row r sees slot j
    ) -> bool:
        """x after every layer; False (x unchanged) when some row's keys are not one run."""
        assert x.is_contiguous() and x.dtype == torch.float32 and mask.dtype == torch.bool
        cos, sin, mask = cos.contiguous(), sin.contiguous(), mask.contiguous()
        slots = slots.to(torch.long).contiguous()
        n = len(self.layers)
        keys = (ctypes.c_void_p * n)(*[k.data_ptr() for k in k_caches])
        values = (ctypes.c_void_p * n)(*[v.data_ptr() for v in v_caches])
        code = self.lib.understudy_layers(
            self.pointers, n, self.attend, x.data_ptr(), x.shape[0], cos.data_ptr(),
            sin.data_ptr(), slots.data_ptr(), keys, values, k_caches[0].shape[1],
            mask.data_ptr(), mask.shape[1], self.scale, 0.0, torch.get_num_threads(),
        )  # fmt: skip
        if code == NOT_ONE_RUN:
            return False
        assert code == 0, f"fused layers failed ({code})"
        return True
