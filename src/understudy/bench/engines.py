"""Method specs for the benchmark, and engines that share ONE loaded target (and draft).

A method spec is a registered method name, optionally with options after colons:
``draft``, ``draft:k=2``, ``draft:draft_quantization=none``, ``ngram:prompt_lookup_max=4``.
``k`` sets num_speculative_tokens for that entry (default: the bench's --k);
``draft_quantization`` is `Engine.from_pretrained`'s (default "auto"); every other key goes
to the drafter, as `Engine.from_pretrained(**drafter_options)` passes it. The spec string is
the label the results use, so ``draft:k=2,draft:k=auto`` compares two K side by side.

Every engine is assembled (engine/builder.py) around the same `LoadedModel`s (`ModelPool`),
so a run with five methods holds one copy of the target's weights, not five, and one copy of
the draft per quantization scheme in use (quantizing is done in place). The engines' runners
share each model's KV cache: they are used one at a time, and every request starts from
prefill.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from understudy.config import (
    DType,
    Quantization,
    UnderstudyError,
    parse_num_speculative_tokens,
    parse_option_value,
)
from understudy.drafters import DRAFTERS
from understudy.engine.builder import EngineSpec, LoadedModels, assemble
from understudy.engine.draft_setup import default_draft, load_draft, resolve_draft_quantization
from understudy.engine.engine import Engine
from understudy.models.loader import LoadedModel, load_model
from understudy.models.registry import DEFAULT_TARGET
from understudy.models.requantize import SCHEME as REQUANTIZE_SCHEME

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
        return self.method != BASELINE and DRAFTERS[self.method].traits.needs_draft_model


def registered_methods() -> tuple[str, ...]:
    return (BASELINE, *DRAFTERS)


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
                options[key] = parse_option_value(raw)
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
        self,
        target: str | None,
        draft: str | None,
        dtype: DType,
        device: str | None = None,
        quantization: Quantization = "auto",
    ) -> None:
        self.dtype, self.device, self.quantization = dtype, device, quantization
        self.target = load_model(target or DEFAULT_TARGET, dtype, device, quantization)
        self.draft_spec = default_draft(target, draft)
        self._drafts: dict[str | None, LoadedModel] = {}

    def scheme(self, requested: str | None) -> str | None:
        if requested == REQUANTIZE_SCHEME:  # the draft's own blocks: load_draft checks it
            return requested
        # the scheme depends only on the device, which the draft shares with the target
        return resolve_draft_quantization(requested, self.target)

    def draft(self, requested: str | None = None) -> LoadedModel:
        scheme = self.scheme(requested)
        if scheme not in self._drafts:
            if self.draft_spec is None:
                raise UnderstudyError("these methods need a draft model: pass --draft")
            self._drafts[scheme] = load_draft(
                self.draft_spec, self.target, requested, self.dtype, self.device, self.quantization
            )
        return self._drafts[scheme]


def assemble_engine(spec: MethodSpec, pool: ModelPool, max_context: int) -> Engine:
    """An engine for one method spec around the pool's already-loaded models (the builder's
    own `assemble`: every method of a run shares the target's weights and kernels)."""
    engine_spec = EngineSpec(
        method=spec.method,
        k=spec.k,
        max_context=max_context,
        draft_quantization=spec.draft_quantization,
        drafter_options=dict(spec.options),
    )
    draft = pool.draft(spec.draft_quantization) if spec.needs_draft_model else None
    return Engine.from_parts(assemble(LoadedModels(pool.target, draft), engine_spec))
