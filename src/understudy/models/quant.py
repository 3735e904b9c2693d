"""Weight-only int8 / int4 quantization of a Transformer's Linear layers (the draft's).

A draft model's output never reaches the user unchecked: the target decides every token, so
quantizing the draft cannot change what is generated (greedy output stays bitwise the target's,
sampled output keeps the target's distribution); it only changes how often guesses are kept.
A one-token draft step reads every weight once and is memory-bound, so fewer bytes per weight
make it cheaper (docs/quantized-draft.md has the measurements).

Schemes (torch's own CPU kernels, no extra dependency):

    "int8"        per-output-channel symmetric int8, `torch._weight_int8pack_mm`
    "int4"        group-wise asymmetric int4, group size 128,
                  `aten._convert_weight_to_int4pack_for_cpu` + `aten._weight_int4pack_mm_for_cpu`
    "int4-g32"    the same with group size 32 (also -g64, -g256): smaller error, a few more bytes

(`_weight_int8pack_mm` takes one scale per output row, so int8 is per channel, not per group.)
Both kernels are fast only with bf16 activations (their fp32 paths are 10-25x slower on this
CPU), so a quantized layer casts its input to bf16 and its output back to the input's dtype;
the rest of the model (norms, rotary, attention, KV cache) keeps its dtype.

Layers whose shapes the kernel cannot take stay as they are (`fits`): int8 needs
in_features % 32 == 0 (the bf16 kernel returns garbage or crashes for in_features % 16 != 0);
int4 needs in_features % group_size == 0 and out_features % 16 == 0.

Packing is done once and cached (`load_or_quantize`): a safetensors file per scheme in a
directory that identifies the weights (the caller's, e.g. next to the converted weights, or one
named by a fingerprint of the weights), keyed by torch version and CPU capability because the
int4 layout is the kernel's own.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from understudy.config import UnderstudyError

log = logging.getLogger(__name__)

SCHEMES = ("int8", "int4", "int4-g32", "int4-g64", "int4-g128", "int4-g256")
FORMAT_VERSION = 1
COMPUTE_DTYPE = torch.bfloat16  # the activations' dtype inside the kernels (their fast path)


@dataclass(frozen=True)
class Scheme:
    bits: int  # 8 or 4
    group_size: int  # int4 only; 0 for int8 (one scale per output channel)

    @property
    def name(self) -> str:
        return "int8" if self.bits == 8 else f"int4-g{self.group_size}"


def parse_scheme(scheme: str) -> Scheme:
    """ "int8" | "int4" (= int4-g128) | "int4-g32" | "int4-g64" | "int4-g128" | "int4-g256"."""
    if scheme == "int8":
        return Scheme(8, 0)
    if scheme == "int4":
        return Scheme(4, 128)
    match = re.fullmatch(r"int4-g(32|64|128|256)", scheme or "")
    if match:
        return Scheme(4, int(match.group(1)))
    raise UnderstudyError(
        f"unknown quantization scheme {scheme!r}: use one of {', '.join(SCHEMES)}"
    )


def fits(linear: nn.Linear, scheme: Scheme) -> bool:
    """Whether the kernel of `scheme` can take this layer's shape."""
    n, k = linear.out_features, linear.in_features
    if scheme.bits == 8:
        return k % 32 == 0
    return k % scheme.group_size == 0 and n % 16 == 0


# -- the quantized layers -------------------------------------------------------------------


class Int8Linear(nn.Module):
    """y = x @ (q * scale[:, None]).T + bias, q int8 [N, K], one bf16 scale per output row."""

    def __init__(
        self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight)  # [N, K] int8
        self.register_buffer("scales", scales)  # [N] bf16
        self.register_buffer("bias", bias)  # [N] in the model's dtype, or None

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        w = linear.weight.detach().float()
        scales = (w.abs().amax(dim=1).clamp(min=1e-8) / 127).to(COMPUTE_DTYPE)
        q = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(q.contiguous(), scales, _bias(linear))

    def dequantized(self) -> torch.Tensor:
        return self.qweight.float() * self.scales.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).to(COMPUTE_DTYPE)
        y = torch._weight_int8pack_mm(x2, self.qweight, self.scales).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


class Int4Linear(nn.Module):
    """Group-wise asymmetric int4: w[n, g*G + i] = (q - 8) * scale[g, n] + zero[g, n]."""

    def __init__(
        self,
        packed: torch.Tensor,
        scales_and_zeros: torch.Tensor,
        bias: torch.Tensor | None,
        in_features: int,
        group_size: int,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = packed.shape[0], in_features
        self.group_size = group_size
        self.register_buffer("packed", packed)  # the CPU kernel's layout, uint8 [N, K/2]
        self.register_buffer("scales_and_zeros", scales_and_zeros)  # [K/G, N, 2] bf16
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int) -> Int4Linear:
        q, scales_and_zeros = quantize_int4(linear.weight.detach(), group_size)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 8)  # inner_k_tiles: unused
        return cls(packed, scales_and_zeros, _bias(linear), linear.in_features, group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).to(COMPUTE_DTYPE)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x2, self.packed, self.group_size, self.scales_and_zeros
        ).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"int4 group_size={self.group_size}"
        )


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q int32 [N, K] in 0..15, scales_and_zeros bf16 [K/G, N, 2]).

    Min/max per group (gpt-fast / torchao's layout): scale = (max - min) / 15,
    zero = min + 8 * scale. The codes are rounded against the bf16-rounded scale and zero the
    kernel will use, so rounding the parameters adds no error of its own."""
    n, k = w.shape
    groups = w.float().reshape(n, k // group_size, group_size)  # [N, K/G, G]
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)  # [N, K/G]
    scale = ((hi - lo).clamp(min=1e-8) / 15).to(COMPUTE_DTYPE)
    zero = (lo + 8 * scale.float()).to(COMPUTE_DTYPE)
    q = torch.round((groups - zero.float()[..., None]) / scale.float()[..., None] + 8)
    q = q.clamp(0, 15).to(torch.int32).reshape(n, k)
    scales_and_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
    return q, scales_and_zeros


def dequantize_int4(q: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """The weight [N, K] (float32) that `quantize_int4`'s output stands for."""
    n, k = q.shape
    groups = scales_and_zeros.shape[0]
    scale = scales_and_zeros[..., 0].float().T[..., None]  # [N, K/G, 1]
    zero = scales_and_zeros[..., 1].float().T[..., None]
    return ((q.reshape(n, groups, k // groups).float() - 8) * scale + zero).reshape(n, k)


def _bias(linear: nn.Linear) -> torch.Tensor | None:
    return None if linear.bias is None else linear.bias.detach().clone()


# -- whole models ---------------------------------------------------------------------------


@dataclass
class QuantInfo:
    """What `quantize_model` / `load_or_quantize` did; stored as `model.quantization`."""

    scheme: str
    quantized: list[str] = field(default_factory=list)  # module names swapped
    skipped: list[str] = field(default_factory=list)  # Linear layers that did not fit
    from_cache: bool = False
    bytes_before: int = 0  # bytes of the swapped layers' weights, before and after
    bytes_after: int = 0


def _linears(model: nn.Module) -> list[tuple[str, nn.Module, str, nn.Linear]]:
    """(full name, parent module, attribute name, layer) of every nn.Linear in `model`."""
    found = []
    for name, module in model.named_modules():
        for attr, child in module.named_children():
            if isinstance(child, nn.Linear):
                full = f"{name}.{attr}" if name else attr
                found.append((full, module, attr, child))
    return found


def _check_device(model: nn.Module) -> None:
    device = next(model.parameters()).device
    if device.type != "cpu":
        raise UnderstudyError(
            f"draft quantization uses torch's CPU kernels; this model is on {device} "
            "(use draft_quantization=None there)"
        )


def _already_quantized(model: nn.Module) -> str | None:
    """The scheme `model` was quantized with, or None when none of its layers is."""
    if not any(isinstance(m, (Int8Linear, Int4Linear)) for m in model.modules()):
        return None
    info = getattr(model, "quantization", None)
    return info.scheme if isinstance(info, QuantInfo) else "unknown"


def quantize_model(model: nn.Module, scheme: str) -> nn.Module:
    """Swap every fitting nn.Linear of `model` (lm_head included) for its quantized version,
    in place; returns `model`, with a QuantInfo as `model.quantization`. A model that is
    already quantized is refused (its weights are gone; quantizing twice compounds error)."""
    spec = parse_scheme(scheme)
    _check_device(model)
    done = _already_quantized(model)
    if done is not None:
        raise UnderstudyError(f"this model is already quantized ({done}); load it afresh")
    info = QuantInfo(spec.name)
    for full, parent, attr, linear in _linears(model):
        if not fits(linear, spec):
            info.skipped.append(full)
            continue
        if spec.bits == 8:
            new: nn.Module = Int8Linear.from_linear(linear)
        else:
            new = Int4Linear.from_linear(linear, spec.group_size)
        info.bytes_before += linear.weight.numel() * linear.weight.element_size()
        info.bytes_after += sum(b.numel() * b.element_size() for b in new.buffers())
        setattr(parent, attr, new)
        info.quantized.append(full)
    model.quantization = info
    return model


def _cache_tag(spec: Scheme) -> str:
    capability = torch.backends.cpu.get_cpu_capability().lower()
    version = torch.__version__.split("+")[0]
    return f"{spec.name}-torch{version}-{capability}-v{FORMAT_VERSION}"


def model_fingerprint(model: nn.Module) -> str:
    """A cheap content key for a model's weights: shapes, dtypes and ~4k sampled values per
    tensor. For `load_or_quantize` when the caller has no cache directory of its own."""
    h = hashlib.sha256()
    cfg = getattr(model, "cfg", None)
    h.update(repr(cfg).encode())
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().reshape(-1)
        step = max(1, flat.numel() // 4096)
        h.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        h.update(flat[::step].float().numpy().tobytes())
    return h.hexdigest()[:24]


def default_cache_dir(model: nn.Module) -> Path:
    from understudy.cache import cache_dir

    return cache_dir() / "quantized" / model_fingerprint(model)


def load_or_quantize(model: nn.Module, cache_key_dir: str | Path | None, scheme: str) -> nn.Module:
    """Quantize `model` in place with `scheme`, reading the packed weights from
    `cache_key_dir` when a previous call left them there (seconds -> a fraction of one).

    `cache_key_dir` must identify the model's weights (e.g. the loader's converted-weights
    directory, which is keyed by file and dtype); None derives one from the weights
    (`default_cache_dir`). The file is quant-<scheme>-torch<ver>-<cpu>-v<n>.safetensors."""
    spec = parse_scheme(scheme)
    _check_device(model)
    done = _already_quantized(model)
    if done == spec.name:
        return model  # idempotent: e.g. a model the factory has already quantized
    if done is not None:
        raise UnderstudyError(f"this model is already quantized ({done}); load it afresh")
    directory = Path(cache_key_dir) if cache_key_dir is not None else default_cache_dir(model)
    path = directory / f"quant-{_cache_tag(spec)}.safetensors"
    if path.exists():
        try:
            _load_packed(model, spec, path)
            return model
        except Exception as err:  # a stale or partial file: quantize afresh
            log.warning("ignoring quantized cache %s: %s", path, err)
    quantize_model(model, spec.name)
    if model.quantization.quantized:  # nothing fits: nothing worth a file
        _save_packed(model, path)
    return model


def _save_packed(model: nn.Module, path: Path) -> None:
    info: QuantInfo = model.quantization
    tensors: dict[str, torch.Tensor] = {}
    modules = dict(model.named_modules())
    for name in info.quantized:
        for buf_name, buf in modules[name].named_buffers():
            tensors[f"{name}.{buf_name}"] = buf.contiguous()
    meta = {
        "scheme": info.scheme,
        "quantized": json.dumps(info.quantized),
        "skipped": json.dumps(info.skipped),
        "bytes_before": str(info.bytes_before),
        "bytes_after": str(info.bytes_after),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # concurrent writers do not collide
    save_file(tensors, str(tmp), metadata=meta)
    tmp.replace(path)  # atomic: a concurrent reader sees no file or a whole one


def _aligned(t: torch.Tensor, alignment: int = 64) -> torch.Tensor:
    return t if t.data_ptr() % alignment == 0 else t.clone()


def _load_packed(model: nn.Module, spec: Scheme, path: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    if meta.get("scheme") != spec.name:
        raise ValueError(f"file holds {meta.get('scheme')}, wanted {spec.name}")
    names = json.loads(meta["quantized"])
    # The kernels assume the allocator's alignment (an int8 weight at an odd address
    # crashed `_weight_int8pack_mm`); safetensors packs tensors back to back.
    tensors = {k: _aligned(v) for k, v in load_file(str(path)).items()}
    linears = {full: (parent, attr, linear) for full, parent, attr, linear in _linears(model)}
    if sorted(names) != sorted(n for n, (_, _, lin) in linears.items() if fits(lin, spec)):
        raise ValueError("the cached layers do not match this model's")
    swaps = []
    for name in names:
        parent, attr, linear = linears[name]
        bias = tensors.get(f"{name}.bias")
        if spec.bits == 8:
            new: nn.Module = Int8Linear(tensors[f"{name}.qweight"], tensors[f"{name}.scales"], bias)
        else:
            new = Int4Linear(
                tensors[f"{name}.packed"],
                tensors[f"{name}.scales_and_zeros"],
                bias,
                linear.in_features,
                spec.group_size,
            )
        if new.out_features != linear.out_features or (bias is None) != (linear.bias is None):
            raise ValueError(f"layer {name} has another shape than the cached one")
        swaps.append((parent, attr, new))
    for parent, attr, new in swaps:  # all or nothing
        setattr(parent, attr, new)
    model.quantization = QuantInfo(
        spec.name,
        names,
        json.loads(meta["skipped"]),
        from_cache=True,
        bytes_before=int(meta["bytes_before"]),
        bytes_after=int(meta["bytes_after"]),
    )
