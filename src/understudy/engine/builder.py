"""Build an engine in two steps: load, then assemble.

    load_models(names)  -> LoadedModels   fetch, convert, quantize; check the pair agrees
    assemble(models)    -> EngineParts    target kernels and pass shape, the drafter, costs

Everything slow (fetching, converting, packing, timing the costs) happens here, never in the
first generate(). The bench assembles many engines around one LoadedModels, so a run with
five methods holds one copy of the target's weights; `Engine.from_pretrained` does both steps.
The costs the round planner weighs are measured before the engine exists and handed to it as
one frozen value (policy/costs.py).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field, replace

import torch

from understudy.config import UnderstudyError
from understudy.drafters import DRAFTERS
from understudy.drafters.base import Drafter
from understudy.engine.request import Seat
from understudy.engine.seats import make_seats
from understudy.kernels import rowgemm, span_attention
from understudy.models.fused import FusedLayer, FusedStack
from understudy.models.hf_fallback import FallbackLM, refuse_on_fallback
from understudy.models.loader import LoadedModel, cpu_has_native_bf16, load_model
from understudy.models.packed import PACK_FROM_ROWS, can_pack, pack_linears
from understudy.models.quant import SCHEMES, load_or_quantize
from understudy.models.registry import DEFAULT_DRAFT, DEFAULT_TARGET
from understudy.models.requantize import SCHEME as REQUANTIZE_SCHEME
from understudy.models.requantize import requantize_linears
from understudy.models.runner import Runner
from understudy.models.transformer import Transformer
from understudy.policy.batch_plan import BatchCosts, measure_batch_costs
from understudy.policy.costs import Costs, measure_costs

METHODS = ("none", *DRAFTERS)


ROW_INVARIANT_ROWS = 16  # most rows of an unpadded pass (K <= 15) unless told otherwise


def row_invariant_kernels(model: Transformer | FallbackLM) -> bool:
    """Whether the target runs row-invariant kernels (kernels/rowgemm.py): float32 on a CPU
    where the kernel could be built. Then passes are not padded at all: plain decoding scores
    one row, verification K+1, and a row's logits are bitwise the same either way. A model
    running from GGUF blocks (kernels/qgemm.py, which needs rowgemm too) is one of these, and
    so is a transformers fallback model (models/hf_fallback.py) once its linears are swapped."""
    return model.device.type == "cpu" and model.dtype == torch.float32 and rowgemm.available()


def target_pass_shape(model: Transformer | FallbackLM) -> tuple[int, bool]:
    """(rows, pad) of the target's passes by default: (16, False) with row-invariant kernels,
    else (the hardware's padded budget, True)."""
    if row_invariant_kernels(model):
        return ROW_INVARIANT_ROWS, False
    return default_verify_rows(model.dtype, model.device), True


def install_row_invariant_kernels(model: Transformer | FallbackLM, rows: int) -> None:
    """Swap the target's linears for rowgemm and score each row of a pass of up to `rows`
    rows in its own attention call (models/transformer.py), so no op of a decode pass
    depends on how many rows it holds. Idempotent. A fallback model's attention is row by
    row already (models/row_attention.py): only its linears change."""
    if isinstance(model, FallbackLM):
        model.use_row_invariant_kernels()
        return
    rowgemm.use_row_invariant_linears(model)
    for layer in model.layers:
        layer.attn.rows_apart_upto = max(layer.attn.rows_apart_upto, rows)
    use_span_attention(model, rows)
    use_fused_layers(model)


def use_span_attention(model: Transformer | FallbackLM, rows: int) -> None:
    """Score the decode rows of passes of up to `rows` rows with kernels/span_attention
    (float32 on a CPU, where it builds): one call a layer instead of a torch call a row."""
    if isinstance(model, FallbackLM) or model.device.type != "cpu":
        return
    if model.dtype != torch.float32 or not span_attention.available():
        return
    for layer in model.layers:
        layer.attn.span_rows = max(layer.attn.span_rows, rows)


def use_fused_layers(model: Transformer | FallbackLM) -> None:
    """Run each layer of a model on GGUF blocks through kernels/fused_layer (two C calls a
    layer around its attention) where the layer is of a kind it computes; every pass then
    takes that path, so no token's bits depend on its pass; where every layer is fused (one
    rope, no window, no softcap), the passes attended by span_attention alone run all the
    layers in one call, the same calls in C. $UNDERSTUDY_FUSED_LAYERS=0: off."""
    if isinstance(model, FallbackLM) or os.environ.get("UNDERSTUDY_FUSED_LAYERS", "1") == "0":
        return
    for layer in model.layers:
        if layer.fused is None:
            layer.fused = FusedLayer.of(layer)
    fused = [layer.fused for layer in model.layers if layer.fused is not None]
    attn = model.layers[0].attn
    one_call = len(fused) == len(model.layers) and not model.windowed and attn.softcap is None
    if one_call and span_attention.available():  # the attention it calls between layers
        model.fused_stack = FusedStack(fused, attn.row_scale)  # every layer in one call


def default_verify_rows(dtype: torch.dtype, device: torch.device) -> int:
    """Rows per padded target pass (every decode pass, plain included, has exactly this
    many) where row-invariant kernels are not available (CUDA, bfloat16, no C compiler).

    Chosen by measurement (docs/design.md, section 2): where matmuls are flat in rows (CUDA,
    CPUs with native bf16) a wide budget is nearly free. On a CPU without native bf16 (fp32,
    linears prepacked for oneDNN from 4 rows on) a 1.5B pass costs ~270 ms at 3 rows and
    ~320 ms at 6, and 6 rows gave the fastest draft and n-gram decoding (8 rows: no faster).
    """
    if device.type == "cuda" or (dtype == torch.bfloat16 and cpu_has_native_bf16()):
        return 16
    return 6


def prepare_target_kernels(model: Transformer | FallbackLM, rows: int) -> None:
    """Pack the target's linears for oneDNN when its passes hold >= 4 rows on a CPU (from 4
    rows on, F.linear repacks every weight on every call; models/packed.py). Our
    Transformer's only: a fallback model keeps transformers' own layers."""
    if isinstance(model, FallbackLM):
        return
    if rows >= PACK_FROM_ROWS and can_pack(model.device, model.dtype):
        pack_linears(model, rows)


DEFAULT_CPU_DRAFT_QUANTIZATION = "int4-g32"  # measured fastest on this CPU: docs/quantized-draft.md
AUTO_BLOCKS_SCHEME = REQUANTIZE_SCHEME  # "auto" for a draft running from its GGUF blocks


def resolve_draft_quantization(
    value: str | None, draft: LoadedModel, draft_model: bool = False
) -> str | None:
    """ "auto" -> int4 (group 32) on a CPU, none on CUDA (torch's packed kernels are CPU ones).
    `draft`: the model whose device decides (the draft, or the target it shares one with).
    `draft_model`: `draft` is the draft model itself; running from its GGUF blocks
    (quantization="gguf") it is quantized already: "auto" is then AUTO_BLOCKS_SCHEME (its
    Q5_0 tensors requantized to Q4_0, models/requantize.py), a dense scheme refused."""
    if value in (None, "none"):
        return None
    if value == REQUANTIZE_SCHEME and not (draft_model and draft.from_blocks):
        raise UnderstudyError(
            f"draft_quantization={REQUANTIZE_SCHEME!r} requantizes a draft model's GGUF blocks, "
            f"for a .gguf draft run from them (quantization auto or gguf); {draft.name!r} is "
            "not one"
        )
    if draft_model and isinstance(draft.model, FallbackLM):
        if value == "auto":
            return None
        raise UnderstudyError(
            f"draft_quantization={value!r} quantizes our Transformer's linears, but the draft "
            f"{draft.name!r} runs on transformers' own code (its architecture has no fast "
            "path): use auto or none"
        )
    if draft_model and draft.from_blocks:
        if value == "auto":
            return AUTO_BLOCKS_SCHEME
        if value == REQUANTIZE_SCHEME:
            return value
        raise UnderstudyError(
            f"draft_quantization={value!r} re-quantizes dense weights, but the draft runs "
            f"from its GGUF blocks (quantization='gguf'): use auto, none or {REQUANTIZE_SCHEME}"
        )
    if value == "auto":
        return DEFAULT_CPU_DRAFT_QUANTIZATION if draft.model.device.type == "cpu" else None
    if value not in SCHEMES:
        raise UnderstudyError(
            f"draft_quantization must be auto, none, {REQUANTIZE_SCHEME} or one of "
            f"{', '.join(SCHEMES)}; got {value!r}"
        )
    return value


def check_compatible(target: LoadedModel, draft: LoadedModel) -> None:
    """Refuse a draft whose tokens do not mean the target's tokens (cf. llama.cpp's
    are_compatible). With tokenizers: same vocabulary and special ids; without: same vocab
    size and EOS ids."""
    t_cfg, d_cfg = target.model.cfg, draft.model.cfg
    if t_cfg.vocab_size != d_cfg.vocab_size:
        raise UnderstudyError(
            f"draft {draft.name!r} has a vocabulary of {d_cfg.vocab_size} tokens, the target "
            f"{target.name!r} {t_cfg.vocab_size}: they cannot share token ids"
        )
    if set(draft.eos_token_ids) - set(target.eos_token_ids) and target.eos_token_ids:
        raise UnderstudyError(
            f"draft {draft.name!r} and target {target.name!r} disagree on end-of-text ids "
            f"({sorted(draft.eos_token_ids)} vs {sorted(target.eos_token_ids)})"
        )
    t_tok, d_tok = target.tokenizer, draft.tokenizer
    if t_tok is not None and d_tok is not None:
        if t_tok.get_vocab() != d_tok.get_vocab():
            raise UnderstudyError(
                f"draft {draft.name!r} and target {target.name!r} have different tokenizers"
            )


@dataclass(frozen=True)
class EngineSpec:
    """What to assemble, apart from the models: the method, K, the context and options."""

    method: str = "draft"
    k: int | str = "auto"
    max_context: int = 4096
    verify_rows: int | None = None  # rows of a target pass; default: the hardware's
    draft_quantization: str | None = "auto"
    drafter_options: dict[str, object] = field(default_factory=dict)
    max_num_seqs: int | str = 1  # seats: sequences decoded together (engine/batch.py), or "auto"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise UnderstudyError(
                f"unknown method {self.method!r}: choose one of {', '.join(METHODS)}"
            )
        if isinstance(self.max_context, bool) or not isinstance(self.max_context, int):
            raise UnderstudyError(f"max_context must be an integer >= 8, got {self.max_context!r}")
        if self.max_context < 8:
            raise UnderstudyError(f"max_context must be an integer >= 8, got {self.max_context!r}")

    @property
    def drafter(self) -> type[Drafter] | None:
        return None if self.method == "none" else DRAFTERS[self.method]

    @property
    def needs_draft_model(self) -> bool:
        drafter = self.drafter
        return drafter is not None and drafter.needs_draft_model


@dataclass
class LoadedModels:
    target: LoadedModel
    draft: LoadedModel | None = None  # only for drafters that need a draft model


@dataclass
class EngineParts:
    """Exactly what `Engine.__init__` takes."""

    target: LoadedModel
    runner: Runner
    drafter: Drafter | None
    method: str
    num_speculative_tokens: int | str
    max_context: int
    exact: bool
    costs: Costs
    seats: list[Seat] | None = None  # max_num_seqs > 1: every seat, the engine's own first
    batch_costs: BatchCosts | None = None


def default_draft(target: str | None, draft: str | None) -> str | None:
    """The draft to load: the one given, or the packaged default pair's draft for its target."""
    return draft or (DEFAULT_DRAFT if target in (None, DEFAULT_TARGET) else None)


def load_draft(
    spec: str, target: LoadedModel, scheme_request: str | None, dtype, device, quantization: str
) -> LoadedModel:
    """Load a draft model, refuse it unless its tokens mean the target's, quantize it."""
    draft = load_model(spec, dtype, device, quantization)
    check_compatible(target, draft)
    scheme = resolve_draft_quantization(scheme_request, draft, draft_model=True)
    if scheme == REQUANTIZE_SCHEME:  # before the fused layers take the linears' weights
        requantize_linears(draft.model)
    use_span_attention(draft.model, ROW_INVARIANT_ROWS)  # its chain steps and catch-ups
    use_fused_layers(draft.model)
    if scheme not in (None, REQUANTIZE_SCHEME):
        load_or_quantize(draft.model, None, scheme)
    return draft


def load_models(
    target: str | None,
    draft: str | None,
    spec: EngineSpec,
    dtype: str | torch.dtype = "auto",
    device: str | None = None,
    quantization: str = "auto",
) -> LoadedModels:
    """Names -> loaded models: the target, and the draft model when the method needs one."""
    target_model = load_model(target or DEFAULT_TARGET, dtype, device, quantization)
    if not spec.needs_draft_model:
        return LoadedModels(target_model)
    draft_spec = default_draft(target, draft)
    if draft_spec is None:
        raise UnderstudyError(f"method {spec.method!r} needs a draft model: pass draft=...")
    draft_model = load_draft(
        draft_spec, target_model, spec.draft_quantization, dtype, device, quantization
    )
    return LoadedModels(target_model, draft_model)


def target_runner(target: LoadedModel, spec: EngineSpec) -> tuple[Runner, bool]:
    """The target's kernels and pass shape for `spec`: (runner, exact). Row-invariant kernels
    make any number of rows exact; padded passes are exact only at the hardware's budget."""
    model = target.model
    default_rows, pad = target_pass_shape(model)
    k = spec.k
    rows = spec.verify_rows or (default_rows if k in ("auto", 0) else max(default_rows, int(k) + 1))
    if k not in ("auto", 0) and rows < int(k) + 1:
        raise UnderstudyError(f"verify_rows={rows} cannot hold K+1={int(k) + 1} tokens")
    if pad:
        exact = rows == default_rows
        prepare_target_kernels(model, rows)
    else:
        exact = True
        install_row_invariant_kernels(model, rows)
    if not exact:
        warnings.warn(
            f"target passes hold {rows} rows, not this hardware's default {default_rows}: "
            "greedy output may differ from method='none' on near-ties (stats.exact = False)",
            stacklevel=4,
        )
    elif isinstance(model, FallbackLM) and spec.method != "none":
        why = model.why_inexact(pad, rows)
        if why is not None:
            exact = False
            warnings.warn(
                f"{target.name!r} runs on transformers' own code, and {why}: greedy output "
                "may differ from method='none' on near-ties (stats.exact = False)",
                stacklevel=4,
            )
    return Runner(model, spec.max_context, rows=rows, pad=pad), exact


def within_exact_rope(target: LoadedModel, spec: EngineSpec) -> EngineSpec:
    """`spec` with max_context lowered, with a warning, to the length up to which the
    target's rope is transformers' own in every pass (Transformer.exact_context): "dynamic"
    and "longrope" switch frequencies with the sequence's length past it, which no KV cache
    follows exactly (models/rope.py says why). Unchanged where the rope has no such length."""
    model = target.model
    limit = model.exact_context if isinstance(model, Transformer) else None
    if limit is None or spec.max_context <= limit:
        return spec
    scaling = model.cfg.rope_scaling
    assert scaling is not None  # only a scaled rope has a limit
    warnings.warn(
        f"max_context lowered from {spec.max_context} to {limit} tokens: {target.name!r} uses "
        f"{scaling.kind!r} rope scaling, whose frequencies change past {limit} tokens, and a "
        "KV cache cannot follow that exactly",
        stacklevel=4,
    )
    return replace(spec, max_context=limit)


def assemble(models: LoadedModels, spec: EngineSpec, draft: str | None = None) -> EngineParts:
    """Loaded models -> the parts of a ready engine. `draft`: for a drafter whose `draft=`
    names a trained head's folder (eagle), that folder."""
    target = models.target
    spec = within_exact_rope(target, spec)
    runner, exact = target_runner(target, spec)
    drafter_cls = spec.drafter
    drafter: Drafter | None = None
    costs = Costs()
    if drafter_cls is not None:
        options = dict(spec.drafter_options)
        if drafter_cls.draft_names_head and draft is not None:
            options["head"] = draft
        refuse_on_fallback(target, models.draft, drafter_cls.wants_hidden)
        drafter = drafter_cls.from_models(target, models.draft, spec.max_context, **options)
        refuse_on_fallback(target, models.draft, False, drafter.tree)
        request = spec.draft_quantization
        if request == REQUANTIZE_SCHEME and models.draft is not None:
            request = None  # the draft model's, applied at its load (load_draft)
        scheme = resolve_draft_quantization(request, target)
        if scheme is not None:
            drafter.quantize(scheme)  # a network of the drafter's own (eagle's head)
        if spec.k == "auto" or drafter.tree == "auto" or drafter.plans_length:
            costs = measure_costs(
                runner, drafter, unpadded=not runner.pad, trees=drafter.tree == "auto"
            )
            drafter.use_costs(costs)
    k = 0 if drafter is None else spec.k
    seats = make_seats(runner, drafter, spec.max_num_seqs)
    batch_costs = None
    if len(seats) > 1:
        draft = None if drafter is None else drafter.draft_runner()
        drafts = None if draft is None else [s.drafter.draft_runner() for s in seats]
        most_rows = len(seats) * (runner.rows or 1)
        batch_costs = measure_batch_costs(
            [s.runner for s in seats], [d for d in drafts or [] if d is not None], most_rows
        )
    return EngineParts(
        target, runner, drafter, spec.method, k, spec.max_context, exact, costs, seats,
        batch_costs,
    )  # fmt: skip
