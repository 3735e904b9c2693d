"""Method specs for the benchmark, and engines that share ONE loaded target (and draft).

A method spec is a registered method name, optionally with options after colons:
``draft``, ``draft:k=2``, ``ngram:prompt_lookup_max=4``. ``k`` sets num_speculative_tokens
for that entry (default: the bench's --k); every other key goes to the drafter, as
`Engine.from_pretrained(**drafter_options)` would pass it. The spec string is the label
the results use, so ``draft:k=2,draft:k=auto`` compares two K side by side.

Every engine is built around the same `LoadedModel`s, so a run with five methods holds one
copy of the target's weights (and one of the draft's), not five. The engines' runners share
each model's KV cache: they are used one at a time, and every request starts from prefill.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from understudy.config import UnderstudyError, parse_num_speculative_tokens
from understudy.drafters import DRAFTERS
from understudy.engine import Engine
from understudy.factory import check_compatible, default_verify_rows, measure_cost_ratio
from understudy.models.loader import LoadedModel, load_model
from understudy.models.registry import DEFAULT_DRAFT, DEFAULT_TARGET

BASELINE = "none"


@dataclass(frozen=True)
class MethodSpec:
    label: str
    method: str
    k: int | str
    options: dict[str, object] = field(default_factory=dict)

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
        for pair in pairs:
            key, sep, raw = pair.partition("=")
            if not sep or not key:
                raise UnderstudyError(f"method option {pair!r} in {item!r} is not key=value")
            if key == "k":
                k = parse_num_speculative_tokens(raw)
            else:
                options[key] = _value(raw)
        if any(s.label == item for s in specs):
            raise UnderstudyError(f"method {item!r} is listed twice")
        if name == BASELINE and (pairs or any(s.method == BASELINE for s in specs)):
            raise UnderstudyError("the baseline 'none' takes no options and appears once")
        specs.append(MethodSpec(item, name, 0 if name == BASELINE else k, options))
    if not any(s.method == BASELINE for s in specs):
        specs.insert(0, MethodSpec(BASELINE, BASELINE, 0))
    specs.sort(key=lambda s: s.method != BASELINE)  # baseline first, the rest in given order
    return specs


def load_models(
    target: str | None,
    draft: str | None,
    dtype: str,
    need_draft: bool,
    device: str | None = None,
) -> tuple[LoadedModel, LoadedModel | None]:
    """Load the target once, and the draft once if any method (or the HF peer) needs it."""
    target_model = load_model(target or DEFAULT_TARGET, dtype, device)
    if not need_draft:
        return target_model, None
    draft_spec = draft or (DEFAULT_DRAFT if target in (None, DEFAULT_TARGET) else None)
    if draft_spec is None:
        raise UnderstudyError("these methods need a draft model: pass --draft")
    draft_model = load_model(draft_spec, dtype, device)
    check_compatible(target_model, draft_model)
    return target_model, draft_model


def assemble_engine(
    spec: MethodSpec,
    target_model: LoadedModel,
    draft_model: LoadedModel | None,
    max_context: int,
) -> Engine:
    """What `factory.build_engine` does after loading, around already-loaded models.

    The baseline always uses the hardware's default row budget (the fastest plain decoding,
    and the pass shape that speculative methods at their default K share bit for bit).
    """
    model = target_model.model
    default_rows = default_verify_rows(model.dtype, model.device)
    if spec.method == BASELINE:
        return Engine(target_model, None, BASELINE, 0, max_context, default_rows, True)
    k = spec.k
    rows = default_rows if k == "auto" else max(default_rows, int(k) + 1)
    exact = rows == default_rows
    if not exact:
        warnings.warn(
            f"{spec.label}: target passes hold {rows} rows, not this hardware's default "
            f"{default_rows}: greedy output may differ from plain on near-ties",
            stacklevel=2,
        )
    drafter = DRAFTERS[spec.method]
    if getattr(drafter, "needs_draft_model", False) and draft_model is None:
        raise UnderstudyError(f"method {spec.method!r} needs a draft model: pass --draft")
    proposer = drafter.from_models(target_model, draft_model, max_context, **spec.options)
    engine = Engine(target_model, proposer, spec.method, k, max_context, rows, exact)
    if k == "auto":
        engine.cost_ratio = measure_cost_ratio(engine)
    return engine
