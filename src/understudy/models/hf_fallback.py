"""Any other causal LM that transformers runs: transformers' own modelling code, driven by
models/runner.py exactly as our Transformer is.

`FallbackLM` takes the Transformer's pass contract (score rows at positions, write their keys
and values to cache slots, return logits) over a static KV cache of transformers' own
`StaticLayer`s, one full-length layer per attention layer: rolling back is position
arithmetic (the runner's `length`; the cache's write offset is cropped back to the next pass's
first slot), and sliding-window or chunked layers keep every slot too, their window being a
mask that transformers builds from positions. So the runner's passes work unchanged, padded
to a fixed shape or unpadded over row-invariant kernels.

Why greedy speculative output is plain decoding's, bit for bit (`why_inexact` is None): a
row's logits must not depend on the other rows of its pass, nor on its index in it.
- Attention is models/row_attention.py's, registered with transformers: each row attends
  alone over the keys its own mask row shows. A probe pass at load counts that every
  attention layer calls it.
- Linear layers: where the target runs float32 on a CPU with the rowgemm kernel (the
  builder's choice, as for our Transformer), every nn.Linear (and GPT-2's Conv1D) becomes
  kernels/rowgemm's RowInvariantLinear: one FMA chain per output, whatever the rows; passes
  then hold only their real rows. Norms, activations and embeddings work row by row.
  Elsewhere (CUDA, bfloat16) passes are padded to the hardware's fixed row budget, the
  mechanism measured bitwise on transformers' own models in bfloat16 at 16 rows. Not on a
  CPU in float32 without rowgemm: there torch's matmul can give a row other bits at another
  index of the call (docs/design.md, section 2), so that case is reported inexact.
- A mixture of experts gathers each expert's rows into a call whose size depends on the
  pass; a weight multiplied outside the swapped linears escapes the kernel: both inexact.
The builder warns with `why_inexact`'s reason and reports stats.exact = False.

Refused at load, with one line each: models whose state is a recurrence (convert.RECURRENT, or
any layer kind that is not attention over a KV cache), which position arithmetic cannot roll
back; multimodal wrappers. Refused when asked: trees, batched seats and hidden states (eagle),
which need the fast path's slot-level control.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from understudy.config import TreeMode, UnderstudyError
from understudy.models.convert import RECURRENT, UnsupportedArchitecture
from understudy.models.hardware import cpu_has_native_bf16
from understudy.models.row_attention import (
    ATTENTION,
    COUNT_KWARG,
    ROWS_APART_UPTO,
    CallCount,
    register,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel
    from transformers.cache_utils import Cache

ATTENTION_KINDS = ("full_attention", "sliding_attention", "chunked_attention")
STATELESS_KINDS = ("dummy",)  # layers that keep nothing (they read another layer's KV)
RECURRENT_KINDS = ("conv", "linear_attention", "hybrid", "hybrid_sliding")
# config fields that make a model a mixture of experts
EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
CHAINS_ONLY = (
    "the transformers fallback scores chains of consecutive positions only: token trees, "
    "batched seats and hidden states need a fast-path architecture"
)


@dataclass(frozen=True)
class FallbackConfig:
    """The shape the engine reads of a model (vocabulary, KV bytes per slot)."""

    model_type: str
    vocab_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int


class FallbackLM:
    """A transformers causal LM behind the pass contract of models/transformer.Transformer
    (module docstring). One sequence, at cache slots equal to positions."""

    def __init__(
        self, hf: PreTrainedModel, cfg: FallbackConfig, kinds: list[str], unproved: str | None
    ) -> None:
        self.hf = hf
        self.cfg = cfg
        self.kinds = kinds  # per layer: ATTENTION_KINDS or STATELESS_KINDS
        self.unproved = unproved  # what the model itself does that is not row-invariant
        # the 2-D weights left outside row-invariant linears (None: the kernels are not in)
        self.outside: list[str] | None = None
        self.cache: Cache | None = None
        self.slots = 0
        self.written = 0  # the cache's write offset: the slot after the last pass's rows

    @property
    def device(self) -> torch.device:
        return self.hf.device

    @property
    def dtype(self) -> torch.dtype:
        return self.hf.dtype

    @property
    def cache_slots(self) -> int:
        return self.slots

    def allocate_cache(self, slots: int) -> None:
        """A static cache of `slots` slots per layer (allocated by transformers at its first
        write, in the model's dtype and device)."""
        from transformers.cache_utils import STATIC_LAYER_TYPE_MAPPING, Cache, StaticLayer

        layers = [
            StaticLayer(max_cache_len=slots)
            if kind in ATTENTION_KINDS
            else STATIC_LAYER_TYPE_MAPPING[kind](max_cache_len=slots)
            for kind in self.kinds
        ]
        self.cache = Cache(layers=layers)
        self.slots, self.written = slots, 0

    def __call__(
        self,
        tokens: torch.Tensor,  # [R]
        positions: torch.Tensor,  # [R]
        slots: torch.Tensor,  # [R]
        mask: torch.Tensor,  # [R, L]
        logit_rows: slice | None = None,
        key_slots: torch.Tensor | None = None,
        split: object | None = None,
    ) -> torch.Tensor:
        """Logits [len(logit_rows), vocab] (float32) of rows at consecutive positions written
        to the same slots. `mask` and `split` say what a chain pass's rows see (the causal
        prefix, in chain order); transformers builds that mask itself from the positions, with
        the model's own windows, and each row attends over its prefix (row_attention.py)."""
        rows = tokens.shape[0]
        start = int(positions[0])
        chain = torch.arange(start, start + rows, device=positions.device)  # [R]
        is_chain = torch.equal(positions, chain) and torch.equal(slots, chain)
        if key_slots is not None or not is_chain:
            raise UnderstudyError(CHAINS_ONLY)
        assert self.cache is not None and start + rows <= self.slots, (start, rows, self.slots)
        if self.written > start:  # roll the write offset back to this pass's first slot
            self.cache.crop(start - self.written)
        kept = range(rows)[logit_rows or slice(None)]
        last_only = list(kept) == [rows - 1]  # a prompt's chunk: its last row's logits only
        out = self.hf(
            input_ids=tokens[None],
            position_ids=positions[None],
            cache=self.cache,
            use_cache=True,
            logits_to_keep=1 if last_only else 0,
        ).logits[0]  # [R, V], or [1, V]: the last row's, where the model honours logits_to_keep
        self.written = start + rows
        if out.shape[0] == rows and logit_rows is not None:
            out = out[logit_rows]
        return out.float()

    def use_row_invariant_kernels(self) -> None:
        """Swap every nn.Linear, and GPT-2's Conv1D (x W + b, W [in, out]), for rowgemm's
        RowInvariantLinear (float32, CPU); record in `outside` the 2-D weights left that are
        not an embedding table. Idempotent."""
        from transformers.pytorch_utils import Conv1D

        from understudy.kernels.rowgemm import RowInvariantLinear, use_row_invariant_linears

        for module in list(self.hf.modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, Conv1D):
                    linear = torch.nn.Linear(child.nx, child.nf, device="meta")
                    linear.weight = torch.nn.Parameter(child.weight.t(), requires_grad=False)
                    linear.bias = child.bias
                    setattr(module, name, linear)
        use_row_invariant_linears(self.hf)
        self.outside = [
            f"{name}.{key}"
            for name, module in self.hf.named_modules()
            if not isinstance(module, torch.nn.Embedding | RowInvariantLinear)
            for key, p in module.named_parameters(recurse=False)
            if p.ndim >= 2
        ]

    def why_inexact(self, padded: bool, rows: int) -> str | None:
        """Why greedy speculative output may differ from plain decoding on a near-tie, with
        passes of `rows` rows (`padded`: fixed-shape; else row-invariant kernels); None when
        the argument of the module docstring covers this model (no reason to doubt it)."""
        if self.unproved is not None:
            return self.unproved
        if rows > ROWS_APART_UPTO:
            return f"passes of {rows} rows attend in one batched call"
        if not padded and self.outside:
            return f"{', '.join(self.outside[:3])} multiply outside row-invariant linears"
        native = self.device.type == "cuda" or (
            self.dtype == torch.bfloat16 and cpu_has_native_bf16()
        )
        if padded and not native:
            return (
                f"its padded {str(self.dtype).removeprefix('torch.')} passes on this CPU "
                "(no rowgemm kernel) run torch's matmuls, which can give a row other bits "
                "at another index of the pass"
            )
        return None

    def hidden_states(self, *args: object, **kwargs: object) -> torch.Tensor:
        raise UnderstudyError(CHAINS_ONLY)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise UnderstudyError(CHAINS_ONLY)

    def keep_slots(self, src: torch.Tensor, dst_start: int) -> None:
        raise UnderstudyError(CHAINS_ONLY)

    def probe(self) -> int:
        """One 2-row pass on a throwaway cache; returns how many attention calls went through
        the row-invariant function (row_attention.CallCount)."""
        count = CallCount()
        self.allocate_cache(8)
        with torch.inference_mode():
            self.hf(
                input_ids=torch.zeros(1, 2, dtype=torch.long, device=self.device),
                position_ids=torch.arange(2, device=self.device)[None],
                cache=self.cache,
                use_cache=True,
                **{COUNT_KWARG: count},
            )
        self.cache, self.slots, self.written = None, 0, 0
        return count.calls


def fallback_model(
    hf: PreTrainedModel, refusal: UnsupportedArchitecture, device: torch.device
) -> FallbackLM:
    """`hf` (loaded by transformers, refused by the fast path with `refusal`) as a FallbackLM
    on `device`; UnsupportedArchitecture, one line, for what cannot be rolled back by position."""
    cfg, kinds = prepare_fallback(hf, refusal)
    hf = hf.to(device).eval().requires_grad_(False)
    model = FallbackLM(hf, cfg, kinds, None)
    try:
        calls = model.probe()
    except Exception as err:  # any failure here is the model's: refuse it, saying why
        first = (str(err).splitlines() or [""])[0]
        raise UnsupportedArchitecture(
            f"model type {cfg.model_type!r}: a pass over a static KV cache failed "
            f"({type(err).__name__}: {first})"
        ) from None
    model.unproved = unproved(hf.config.get_text_config(decoder=True), calls, len(kinds))
    return model


def prepare_fallback(
    hf: PreTrainedModel, refusal: UnsupportedArchitecture
) -> tuple[FallbackConfig, list[str]]:
    """What fallback_model checks before any pass, which reads no weight (a model on the meta
    device will do): UnsupportedArchitecture, one line, for a model whose state cannot be
    rolled back by position or whose attention row_attention's cannot replace; else its
    FallbackConfig and its layers' kinds, its attention set to row_attention's."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    config = hf.config
    model_type = str(config.model_type)
    if model_type in RECURRENT:
        raise refusal
    text = config.get_text_config(decoder=True)
    if text is not config:
        raise UnsupportedArchitecture(
            f"model type {model_type!r} is multimodal: the transformers fallback runs "
            f"text-only causal LMs (load its text model, model type {text.model_type!r})"
        )
    kinds, _ = get_layer_types_and_kwargs(text)
    for kind in kinds:
        if kind in RECURRENT_KINDS:
            raise UnsupportedArchitecture(
                f"model type {model_type!r} has {kind!r} layers, whose state is a recurrence, "
                "not a cache indexed by position: a rejected guess could not be rolled back"
            )
        if kind not in (*ATTENTION_KINDS, *STATELESS_KINDS):
            raise UnsupportedArchitecture(
                f"model type {model_type!r} has {kind!r} layers, whose cache the "
                "transformers fallback does not know how to roll back"
            )
    register()
    hf.set_attn_implementation(ATTENTION)
    if hf.config._attn_implementation != ATTENTION:  # its masks would skip the static cache's
        raise UnsupportedArchitecture(
            f"model type {model_type!r} does not let transformers' AttentionInterface replace "
            "its attention, which the fallback needs to run it over a static KV cache"
        )
    heads = text.num_attention_heads
    cfg = FallbackConfig(
        model_type=model_type,
        vocab_size=int(text.vocab_size),
        num_layers=len(kinds),
        num_kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(text, "head_dim", None) or text.hidden_size // heads),
    )
    return cfg, list(kinds)


def unproved(text_config: object, calls: int, layers: int) -> str | None:
    """What in this model's own arithmetic is not proved row-invariant (None: nothing):
    a mixture of experts, or attention layers that do not call row_attention's function."""
    experts = [f for f in EXPERT_FIELDS if (getattr(text_config, f, None) or 0) > 1]
    if experts:
        return (
            "its mixture of experts gathers each expert's rows into a call whose size "
            "depends on the pass (not proved row-invariant)"
        )
    if calls != layers:
        return (
            f"{calls} of its {layers} attention layers run understudy's row-invariant "
            "attention (the others use their own)"
        )
    return None


class NamedModel(Protocol):
    """What `refuse_on_fallback` reads of a loaded model (loader.py's LoadedModel), stated
    here because the loader builds on this module and so cannot be imported by it."""

    @property
    def name(self) -> str: ...

    @property
    def model(self) -> object: ...


def refuse_on_fallback(
    target: NamedModel, draft: NamedModel | None, wants_hidden: bool, tree: TreeMode = "off"
) -> None:
    """At build: refuse, saying why, a drafter that reads the target's hidden states of a
    FallbackLM target, or drafts token trees where a FallbackLM is in play (chains only)."""
    if wants_hidden and isinstance(target.model, FallbackLM):
        raise UnderstudyError(
            f"this method reads the target's hidden states, which {target.name!r} (on "
            "transformers' own code: its architecture has no fast path) does not expose"
        )
    on_fallback = [
        m.name for m in (target, draft) if m is not None and isinstance(m.model, FallbackLM)
    ]
    if tree != "off" and on_fallback:
        raise UnderstudyError(
            f"tree={tree!r} drafts token trees, but {', '.join(map(repr, on_fallback))} runs "
            "on transformers' own code, which scores chains only: use tree='off'"
        )
