"""A decoder layer's work around its attention in two C calls (kernels/fused_layer.c).

For a layer whose linears all run from GGUF blocks (kernels/qgemm.py): `LayerKernel.
attention_input` does norm, q/k/v projection, the per-head q/k norms (Qwen3, Gemma 3), the
rotation of the first `rotary_dim` features (Phi-4-mini rotates 3/4) and the cache write;
`LayerKernel.output` the output projection, residuals, norms (Gemma's sandwich norms
included) and the gated MLP (SiLU or GELU's tanh form). A mixture's layer has no MLP of its
own: `mlp_input` stops at the normed input of its experts, each an `MLPKernel`. Between the
two calls the caller decides which keys each row sees, so trees, windows and batched groups
work as on the module path.

This module takes plain values, QuantLinears and float32 vectors with the layer's sizes
(`LayerTensors`, `LayerShape`); which modules of a model they come from is the caller's
business (models/fused.py).

Invariant: row-wise and row-invariant, like every step of a decode pass (the C file's header
comment), and taken for EVERY pass of the model once installed (prefill too): a token's
bits never depend on the path its pass took.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from understudy.cache import cache_dir
from understudy.kernels import qgemm, span_attention
from understudy.kernels.build import VECTOR_FLAGS, open_library
from understudy.kernels.qgemm import QuantLinear

SOURCE = Path(__file__).with_name("fused_layer.c")
MAX_PARTS = 4
ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}  # fused_layer.c's ACT_SILU, ACT_GELU_TANH


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
        ("post_attn", ctypes.c_void_p),
        ("post_mlp", ctypes.c_void_p),
        ("q_norm", ctypes.c_void_p),
        ("k_norm", ctypes.c_void_p),
        ("eps", ctypes.c_float),
        ("hidden", ctypes.c_long),
        ("heads", ctypes.c_long),
        ("kv_heads", ctypes.c_long),
        ("head_dim", ctypes.c_long),
        ("rotary_dim", ctypes.c_long),
        ("intermediate", ctypes.c_long),
        ("activation", ctypes.c_int),
    ]


@cache
def load() -> ctypes.CDLL | None:
    """The compiled library, building it if needed; None when it (or qgemm) cannot be built."""
    lib = open_library(SOURCE, cache_dir() / "kernels", VECTOR_FLAGS)
    if lib is None or qgemm.load() is None:
        return None
    ptr, long, c_int = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    lib.understudy_layer_input.argtypes = [ptr, ptr, long, ptr, ptr, ptr, ptr, ptr, long, ptr]
    lib.understudy_layer_input.argtypes += [c_int]
    lib.understudy_layer_output.argtypes = [ptr, ptr, ptr, long, c_int]
    lib.understudy_layer_mlp_input.argtypes = [ptr, ptr, ptr, long, ptr, c_int]
    lib.understudy_layer_mlp.argtypes = [ptr, ptr, long, ptr, c_int]
    lib.understudy_layers.argtypes = [ptr, long, ptr, ptr, long] + [ptr] * 5 + [long, ptr, long]
    lib.understudy_layers.argtypes += [ctypes.c_float, ctypes.c_float, c_int]
    for entry in (
        lib.understudy_layer_input,
        lib.understudy_layer_output,
        lib.understudy_layer_mlp_input,
        lib.understudy_layer_mlp,
        lib.understudy_layers,
    ):
        entry.restype = c_int
    return lib


def qgemm_address() -> int:
    """qgemm.c's understudy_qgemm_parts, which the C code calls for every product."""
    return ctypes.cast(qgemm.load().understudy_qgemm_parts, ctypes.c_void_p).value


@dataclass(frozen=True)
class LayerShape:
    """A layer's sizes as the C code takes them."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    rotary_dim: int  # features rotated at the start of each head (head_dim: all)
    intermediate: int  # of the layer's own MLP (unused for a mixture's layer)
    eps: float
    activation: str  # a key of ACTIVATIONS


@dataclass(frozen=True)
class LayerTensors:
    """A layer's weights: QuantLinears and float32 vectors (norm weights as multiplied)."""

    qkv: QuantLinear  # [(heads + 2 kv_heads) * head_dim, hidden]: q, k, v rows
    o: QuantLinear
    norm1: torch.Tensor  # [hidden] before attention
    norm2: torch.Tensor  # [hidden] before the MLP (or the experts)
    gate_up: QuantLinear | None = None  # [2 intermediate, hidden], gate rows first; None: a
    down: QuantLinear | None = None  # mixture's layer, whose experts are the caller's
    post_attn: torch.Tensor | None = None  # [hidden] after attention (Gemma)
    post_mlp: torch.Tensor | None = None  # [hidden] after the MLP (Gemma)
    q_norm: torch.Tensor | None = None  # [head_dim] each head of q (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None = None


def linear_refusal(linear: QuantLinear) -> str | None:
    """Why the C code cannot take `linear` (None: it can): a part of a type qgemm has no
    kernel for (it runs dequantized), or more parts than the C code holds."""
    dense = [p.kind.name for i, p in enumerate(linear.parts) if str(i) in linear.dense]
    if dense:
        return f"a {dense[0]} part, which qgemm has no kernel for"
    if len(linear.parts) > MAX_PARTS:
        return f"{len(linear.parts)} parts (the fused layer takes at most {MAX_PARTS})"
    return None


def refusal(shape: LayerShape, tensors: LayerTensors) -> str | None:
    """Why the C code cannot compute this layer, in a few words (None: it can)."""
    if load() is None:
        return "fused_layer.c cannot be built here"
    if shape.activation not in ACTIVATIONS:
        return f"the fused layer has no {shape.activation} activation"
    rot, dim = shape.rotary_dim, shape.head_dim
    if rot % 2 or not 0 < rot <= dim:
        return f"the fused layer rotates an even number of a head's features, not {rot} of {dim}"
    linears = (tensors.qkv, tensors.o, tensors.gate_up, tensors.down)
    for name, linear in zip(("q/k/v", "output", "gate/up", "down"), linears, strict=True):
        why = None if linear is None else linear_refusal(linear)
        if why is not None:
            return f"its {name} projection has {why}"
    return None


def linear_args(linear: QuantLinear | None) -> LinearArgs:
    """The C view of a QuantLinear whose parts all run in qgemm (no parts for None)."""
    if linear is None:
        return LinearArgs(0, 0, 0)
    assert linear_refusal(linear) is None, linear_refusal(linear)
    args = LinearArgs(len(linear.parts), linear.in_features, linear.out_features)
    for i, (kind, weight, bias, at, rows) in enumerate(linear.kernel_calls):
        args.kinds[i], args.weights[i] = kind, weight
        args.biases[i], args.first[i], args.rows[i] = bias or None, at // 4, rows
    return args


def vector(t: torch.Tensor | None, size: int) -> int | None:
    """The address of a float32 vector of `size` values (None for None)."""
    if t is None:
        return None
    assert t.dtype == torch.float32 and t.is_contiguous() and t.shape == (size,), t.shape
    return t.data_ptr()


def layer_args(shape: LayerShape, tensors: LayerTensors, lib: ctypes.CDLL) -> LayerArgs:
    hidden, dim = shape.hidden, shape.head_dim
    return LayerArgs(
        qgemm_address(), *(linear_args(m) for m in (tensors.qkv, tensors.o, tensors.gate_up, tensors.down)),
        *(vector(t, hidden) for t in (tensors.norm1, tensors.norm2, tensors.post_attn,
                                      tensors.post_mlp)),
        vector(tensors.q_norm, dim), vector(tensors.k_norm, dim), shape.eps, hidden, shape.heads,
        shape.kv_heads, dim, shape.rotary_dim, shape.intermediate,
        ACTIVATIONS[shape.activation],
    )  # fmt: skip


class LayerKernel:
    """The C calls of one layer; holds what their pointers point into."""

    def __init__(self, shape: LayerShape, tensors: LayerTensors) -> None:
        why = refusal(shape, tensors)
        assert why is None, why
        lib = load()
        assert lib is not None
        self.shape, self.tensors, self.lib = shape, tensors, lib  # tensors: kept alive
        self.args = layer_args(shape, tensors, lib)
        self.mixture = tensors.gate_up is None  # its experts are the caller's

    def attention_input(
        self,
        x: torch.Tensor,  # [R, hidden] float32
        cos: torch.Tensor,  # [R, rotary_dim]
        sin: torch.Tensor,  # [R, rotary_dim]
        slots: torch.Tensor,  # [R] the cache slots of the rows' keys and values
        k_cache: torch.Tensor,  # [Hkv, S, D], written at `slots`
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Norm, projections, q/k norms, rotation, cache write: the rows' queries [H, R, D]."""
        rows, shape = x.shape[0], self.shape
        x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
        assert cos.shape == (rows, shape.rotary_dim), (cos.shape, shape.rotary_dim)
        slots = slots.to(torch.long).contiguous()
        assert k_cache.is_contiguous() and v_cache.is_contiguous()
        q = torch.empty(rows, shape.heads, shape.head_dim, dtype=torch.float32)
        code = self.lib.understudy_layer_input(
            ctypes.byref(self.args), x.data_ptr(), rows, cos.data_ptr(), sin.data_ptr(),
            slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[1],
            q.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        assert code == 0, f"layer input failed ({code})"
        return q.transpose(0, 1)  # [H, R, D]

    def output(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """x [R, hidden] after the attention output attn [R, H, D] and the MLP (in place)."""
        assert not self.mixture, "a mixture's layer: mlp_input, then its experts"
        x, attn = x.contiguous(), attn.contiguous()
        code = self.lib.understudy_layer_output(
            ctypes.byref(self.args), x.data_ptr(), attn.data_ptr(), x.shape[0],
            torch.get_num_threads(),
        )  # fmt: skip
        assert code == 0, f"layer output failed ({code})"
        return x

    def mlp_input(self, x: torch.Tensor, attn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x after the attention output, in place; its norm [R, hidden]: the experts' input)."""
        x, attn = x.contiguous(), attn.contiguous()
        normed = torch.empty_like(x)
        code = self.lib.understudy_layer_mlp_input(
            ctypes.byref(self.args), x.data_ptr(), attn.data_ptr(), x.shape[0],
            normed.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        assert code == 0, f"layer output failed ({code})"
        return x, normed


class MLPKernel:
    """down(act(gate(h)) * up(h)) in one C call, for an expert of a mixture."""

    def __init__(self, gate_up: QuantLinear, down: QuantLinear, activation: str) -> None:
        lib = load()
        assert lib is not None and linear_refusal(gate_up) is None is linear_refusal(down)
        self.lib, self.linears = lib, (gate_up, down)  # kept alive
        self.hidden = down.out_features
        self.args = LayerArgs(
            qgemm_address(), linear_args(None), linear_args(None), linear_args(gate_up),
            linear_args(down), hidden=self.hidden, intermediate=down.in_features,
            activation=ACTIVATIONS[activation],
        )  # fmt: skip

    def __call__(self, h: torch.Tensor) -> torch.Tensor:  # [R, hidden] -> [R, hidden]
        h = h.contiguous()
        out = torch.empty(h.shape[0], self.hidden, dtype=torch.float32)
        code = self.lib.understudy_layer_mlp(
            ctypes.byref(self.args), h.data_ptr(), h.shape[0], out.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        assert code == 0, f"expert MLP failed ({code})"
        return out


NOT_ONE_RUN = span_attention.NOT_ONE_RUN


class LayerStack:
    """Every layer of a model in one C call a pass (understudy_layers): the per-layer calls
    and span_attention between them, in C. Only for a pass whose rows all attend by
    span_attention to one run of keys each from slot 0, with one rope and one mask for every
    layer (the caller checks the pass; the call answers False, having changed nothing the
    caller's own path does not write alike, when some row's keys are not one run). The same
    calls in the same order: the same bits as the per-layer path."""

    def __init__(self, layers: list[LayerKernel], scale: float, softcap: float | None) -> None:
        assert not any(layer.mixture for layer in layers), "a mixture's experts are Python's"
        self.layers = layers  # keeps the LayerArgs alive
        self.lib = layers[0].lib
        self.pointers = (ctypes.c_void_p * len(layers))(
            *[ctypes.addressof(layer.args) for layer in layers]
        )
        self.scale, self.softcap = scale, softcap or 0.0
        attend = span_attention.load()
        assert attend is not None, "span_attention could not be built"
        self.attend = ctypes.cast(attend.understudy_span_attention, ctypes.c_void_p).value

    def run(
        self,
        x: torch.Tensor,  # [R, hidden] float32 contiguous, in place
        cos: torch.Tensor,  # [R, rotary_dim]
        sin: torch.Tensor,  # [R, rotary_dim]
        slots: torch.Tensor,  # [R]
        k_caches: list[torch.Tensor],  # each [Hkv, S, D]
        v_caches: list[torch.Tensor],
        mask: torch.Tensor,  # [R, L] bool: row r sees slot j
        layers: slice = slice(None),
    ) -> bool:
        """x after every layer (or only `layers`, a run of them: a stack split in several
        calls runs the same calls in C); False (x unchanged) when some row's keys are not
        one run."""
        assert x.is_contiguous() and x.dtype == torch.float32 and mask.dtype == torch.bool
        cos, sin, mask = cos.contiguous(), sin.contiguous(), mask.contiguous()
        slots = slots.to(torch.long).contiguous()
        first, end, step = layers.indices(len(self.layers))
        n = end - first
        assert step == 1 and n > 0, layers
        keys = (ctypes.c_void_p * n)(*[k.data_ptr() for k in k_caches[first:end]])
        values = (ctypes.c_void_p * n)(*[v.data_ptr() for v in v_caches[first:end]])
        pointers = ctypes.addressof(self.pointers) + first * ctypes.sizeof(ctypes.c_void_p)
        code = self.lib.understudy_layers(
            pointers, n, self.attend, x.data_ptr(), x.shape[0], cos.data_ptr(),
            sin.data_ptr(), slots.data_ptr(), keys, values, k_caches[0].shape[1],
            mask.data_ptr(), mask.shape[1], self.scale, self.softcap, torch.get_num_threads(),
        )  # fmt: skip
        if code == NOT_ONE_RUN:
            return False
        assert code == 0, f"fused layers failed ({code})"
        return True
