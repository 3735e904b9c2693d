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

import warnings
from dataclasses import dataclass, field, replace
from typing import Literal

import torch

from understudy.config import BuiltMethod, DType, Quantization, UnderstudyError
from understudy.drafters import DRAFTERS
from understudy.drafters.base import Drafter
from understudy.engine.draft_setup import default_draft, load_draft, resolve_draft_quantization
from understudy.engine.pass_shape import (
    install_row_invariant_kernels,
    prepare_target_kernels,
    target_pass_shape,
)
from understudy.engine.request import Seat
from understudy.engine.seats import make_seats
from understudy.measure.passes import measure_batch_costs, measure_costs
from understudy.models.hf_fallback import FallbackLM, refuse_on_fallback
from understudy.models.loader import LoadedModel, load_model
from understudy.models.registry import DEFAULT_TARGET
from understudy.models.requantize import SCHEME as REQUANTIZE_SCHEME
from understudy.models.runner import Runner
from understudy.models.transformer import Transformer
from understudy.policy.batch_plan import BatchCosts
from understudy.policy.costs import Costs

METHODS = ("none", *DRAFTERS)


@dataclass(frozen=True)
class EngineSpec:
    """What to assemble, apart from the models: the method, K, the context and options."""

    method: BuiltMethod = "draft"
    k: int | Literal["auto"] = "auto"
    max_context: int = 4096
    verify_rows: int | None = None  # rows of a target pass; default: the hardware's
    draft_quantization: str | None = "auto"
    drafter_options: dict[str, object] = field(default_factory=dict)
    max_num_seqs: int | Literal["auto"] = (
        1  # seats: sequences decoded together (engine/batch.py), or "auto"
    )

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
        return drafter is not None and drafter.traits.needs_draft_model


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
    method: BuiltMethod
    num_speculative_tokens: int | Literal["auto"]
    max_context: int
    exact: bool
    costs: Costs
    seats: list[Seat] | None = None  # max_num_seqs > 1: every seat, the engine's own first
    batch_costs: BatchCosts | None = None


def load_models(
    target: str | None,
    draft: str | None,
    spec: EngineSpec,
    dtype: DType | torch.dtype = "auto",
    device: str | None = None,
    quantization: Quantization = "auto",
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
    assert isinstance(model, Transformer)  # only our Transformer has a limit
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
    drafter = None if spec.drafter is None else build_drafter(models, spec, runner, draft)
    costs = Costs()
    if drafter is not None:
        if spec.k == "auto" or drafter.tree == "auto" or drafter.traits.plans_length:
            costs = measure_costs(
                runner, drafter.timed_step(), drafter.draft_runner(), not runner.pad,
                drafter.tree == "auto",
            )  # fmt: skip
        drafter.settle(costs, spec.k == "auto")
    k = 0 if drafter is None else spec.k
    seats = make_seats(runner, drafter, spec.max_num_seqs)
    batch_costs = None
    if len(seats) > 1:
        drafts = [s.drafter.draft_runner() for s in seats if s.drafter is not None]
        most_rows = len(seats) * (runner.rows or 1)
        batch_costs = measure_batch_costs(
            [s.runner for s in seats], [d for d in drafts if d is not None], most_rows
        )
    return EngineParts(
        target, runner, drafter, spec.method, k, spec.max_context, exact, costs, seats,
        batch_costs,
    )  # fmt: skip


def build_drafter(
    models: LoadedModels, spec: EngineSpec, runner: Runner, draft: str | None
) -> Drafter:
    """The method's drafter over the loaded models, its own network quantized, the target's
    runner set to keep the hidden states it reads."""
    drafter_cls = spec.drafter
    assert drafter_cls is not None
    target = models.target
    options = dict(spec.drafter_options)
    if drafter_cls.traits.draft_names_head and draft is not None:
        options["head"] = draft
    refuse_on_fallback(target, models.draft, drafter_cls.traits.wants_hidden)
    drafter = drafter_cls.from_models(target, models.draft, spec.max_context, **options)
    refuse_on_fallback(target, models.draft, False, drafter.tree)
    request = spec.draft_quantization
    if request == REQUANTIZE_SCHEME and models.draft is not None:
        request = None  # the draft model's, applied at its load (load_draft)
    scheme = resolve_draft_quantization(request, target)
    if scheme is not None:
        drafter.quantize(scheme)  # a network of the drafter's own (eagle's head)
    runner.keep_hidden = drafter.traits.wants_hidden
    return drafter
