"""Method specs for the benchmark, and engines that share ONE loaded target (and draft).

A method spec is a registered method name, optionally with options after colons:
``draft``, ``draft:k=2``, ``draft:draft_quantization=none``, ``ngram:prompt_lookup_max=4``.
``k`` sets num_speculative_tokens for that entry (default: the bench's --k);
``draft_quantization`` is `Engine.from_pretrained`'s (default "auto"); every other key goes
to the drafter, as `Engine.from_pretrained(**drafter_options)` passes it. The spec string is
the label the results use, so ``draft:k=2,draft:k=auto`` compares two K side by side.

Every engine is built around the same `LoadedModel`s (`ModelPool`), so a run with five
methods holds one copy of the target's weights, not five, and one copy of the draft per
quantization scheme in use (quantizing is done in place). The engines' runners share each
model's KV cache: they are used one at a time, and every request starts from prefill.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from understudy.config import UnderstudyError, parse_num_speculative_tokens
from understudy.drafters import DRAFTERS
from understudy.engine.builder import (
    check_compatible,
    install_row_invariant_kernels,
    measure_engine_costs,
    prepare_target_kernels,
    quantize_own_drafter,
    resolve_draft_quantization,
    target_pass_shape,
)
from understudy.engine.engine import Engine
from understudy.models.loader import LoadedModel, load_model
from understudy.models.quant import load_or_quantize
from understudy.models.registry import DEFAULT_DRAFT, DEFAULT_TARGET

BASELINE = "none"


@dataclass(frozen=True)
class MethodSpec:
    label: str
    method: str
    k: int | str
    options: dict[str, object] = field(default_factory=dict)
    draft_quantization: str | None = "auto"

    @property
    def needs_draft_model(self) -> bool:
        return self.method != BASELINE and bool(
            getattr(DRAFTERS[self.method], "needs_draft_model", False)
        )


def registered_methods() -> tuple[str, ...]:
    return (BASELINE, *DRAFTERS)


def _value(text: str) -> object:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_methods(text: str, default_k: int | str) -> list[MethodSpec]:
    """ "none,draft,draft:k=2" -> specs; the baseline "none" is always included (first)."""
    specs: list[MethodSpec] = []
    methods = registered_methods()
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, *pairs = item.split(":")
        if name not in methods:
            raise UnderstudyError(f"unknown method {name!r}: choose from {', '.join(methods)}")
        options: dict[str, object] = {}
        k: int | str = default_k
        quantization: str | None = "auto"
        for pair in pairs:
            key, sep, raw = pair.partition("=")
            if not sep or not key:
                raise UnderstudyError(f"method option {pair!r} in {item!r} is not key=value")
            if key == "k":
                k = parse_num_speculative_tokens(raw)
            elif key == "draft_quantization":
                quantization = None if raw.lower() == "none" else raw
            else:
                options[key] = _value(raw)
        if any(s.label == item for s in specs):
            raise UnderstudyError(f"method {item!r} is listed twice")
        if name == BASELINE and (pairs or any(s.method == BASELINE for s in specs)):
            raise UnderstudyError("the baseline 'none' takes no options and appears once")
        specs.append(MethodSpec(item, name, 0 if name == BASELINE else k, options, quantization))
    if not any(s.method == BASELINE for s in specs):
        specs.insert(0, MethodSpec(BASELINE, BASELINE, 0))
    specs.sort(key=lambda s: s.method != BASELINE)  # baseline first, the rest in given order
    return specs


class ModelPool:
    """The target, loaded once, and the draft: one copy per quantization scheme (None =
    the dense draft, which transformers' assisted generation uses), loaded when first asked."""

    def __init__(
        self, target: str | None, draft: str | None, dtype: str, device: str | None = None
    ) -> None:
        self.dtype, self.device = dtype, device
        self.target = load_model(target or DEFAULT_TARGET, dtype, device)
        self.draft_spec = draft or (DEFAULT_DRAFT if target in (None, DEFAULT_TARGET) else None)
        self._drafts: dict[str | None, LoadedModel] = {}

    def scheme(self, requested: str | None) -> str | None:
        # the scheme depends only on the device, which the draft shares with the target
        return resolve_draft_quantization(requested, self.target)

    def draft(self, requested: str | None = None) -> LoadedModel:
        scheme = self.scheme(requested)
        if scheme not in self._drafts:
            if self.draft_spec is None:
                raise UnderstudyError("these methods need a draft model: pass --draft")
            model = load_model(self.draft_spec, self.dtype, self.device)
            check_compatible(self.target, model)
            if scheme is not None:
                load_or_quantize(model.model, None, scheme)
            self._drafts[scheme] = model
        return self._drafts[scheme]


def assemble_engine(spec: MethodSpec, pool: ModelPool, max_context: int) -> Engine:
    """What `factory.build_engine` does, around the pool's already-loaded models.

    The target's kernels are chosen once, so every method of a run shares them: row-invariant
    kernels where they build (unpadded passes, any K exact), else padded passes at the
    hardware's default row budget, which the baseline then always uses.
    """
    target_model = pool.target
    model = target_model.model
    default_rows, pad = target_pass_shape(model)
    k = spec.k
    rows = default_rows if k == "auto" else max(default_rows, int(k) + 1)
    if pad:
        prepare_target_kernels(model, default_rows)
        exact = rows == default_rows
    else:  # row-invariant kernels: any K is exact (factory.build_engine)
        install_row_invariant_kernels(model, max(rows, default_rows))
        exact = True
    if spec.method == BASELINE:
        return Engine(target_model, None, BASELINE, 0, max_context, default_rows, True, pad=pad)
    if not exact:
        warnings.warn(
            f"{spec.label}: target passes hold {rows} rows, not this hardware's default "
            f"{default_rows}: greedy output may differ from plain on near-ties",
            stacklevel=2,
        )
    drafter = DRAFTERS[spec.method]
    draft_model = pool.draft(spec.draft_quantization) if spec.needs_draft_model else None
    proposer = drafter.from_models(target_model, draft_model, max_context, **spec.options)
    quantize_own_drafter(proposer, spec.draft_quantization, target_model)
    engine = Engine(target_model, proposer, spec.method, k, max_context, rows, exact, pad=pad)
    measure_engine_costs(engine)
    return engine
