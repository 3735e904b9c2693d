"""The draft side of building an engine: which draft, whether its tokens mean the target's,
and how it is quantized (none of which can change the output: the target decides every
token).
"""

from __future__ import annotations

import torch

from understudy.config import DType, Quantization, UnderstudyError
from understudy.engine.pass_shape import ROW_INVARIANT_ROWS, use_fused_layers, use_span_attention
from understudy.kernels import qgemm
from understudy.models.block_linears import BLOCK_SCHEMES
from understudy.models.hf_fallback import FallbackLM
from understudy.models.loader import LoadedModel, load_model
from understudy.models.quant import SCHEMES, load_or_quantize
from understudy.models.registry import DEFAULT_DRAFT, DEFAULT_TARGET
from understudy.models.requantize import SCHEME as REQUANTIZE_SCHEME
from understudy.models.requantize import requantize_linears
from understudy.models.transformer import Transformer

DEFAULT_CPU_DRAFT_QUANTIZATION = "int4-g32"  # measured fastest on this CPU: docs/quantized-draft.md
AUTO_BLOCKS_SCHEME = REQUANTIZE_SCHEME  # "auto" for a draft running from its GGUF blocks
HEAD_BLOCKS_SCHEME = "q4_0"  # "auto" for a head beside a target running from its blocks


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
    if not draft_model and (value in BLOCK_SCHEMES or (value == "auto" and draft.from_blocks)):
        return head_block_scheme(value, draft)
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
            f"draft_quantization must be auto, none, {REQUANTIZE_SCHEME} (a GGUF draft), "
            f"{' or '.join(BLOCK_SCHEMES)} (eagle's head) or one of {', '.join(SCHEMES)}; "
            f"got {value!r}"
        )
    return value


def head_block_scheme(value: str, target: LoadedModel) -> str | None:
    """A head's linears in GGUF blocks (models/block_linears.py): "auto" -> HEAD_BLOCKS_SCHEME
    beside a target that runs from its blocks, where qgemm builds (else the dense default);
    q8_0 / q4_0 as asked, on a CPU with qgemm, else refused."""
    usable = target.model.device.type == "cpu" and qgemm.available()
    if value == "auto":
        return HEAD_BLOCKS_SCHEME if usable else DEFAULT_CPU_DRAFT_QUANTIZATION
    if not usable:
        raise UnderstudyError(
            f"draft_quantization={value!r} runs a head's linears on our GGUF-block kernels, "
            "which need a CPU where they build; use auto, none or an int8/int4 scheme"
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


def default_draft(target: str | None, draft: str | None) -> str | None:
    """The draft to load: the one given, or the packaged default pair's draft for its target."""
    return draft or (DEFAULT_DRAFT if target in (None, DEFAULT_TARGET) else None)


def load_draft(
    spec: str,
    target: LoadedModel,
    scheme_request: str | None,
    dtype: DType | torch.dtype,
    device: str | None,
    quantization: Quantization,
) -> LoadedModel:
    """Load a draft model, refuse it unless its tokens mean the target's, quantize it."""
    draft = load_model(spec, dtype, device, quantization)
    check_compatible(target, draft)
    scheme = resolve_draft_quantization(scheme_request, draft, draft_model=True)
    # resolve_draft_quantization gives a FallbackLM draft no scheme: with one, a Transformer
    if scheme == REQUANTIZE_SCHEME:  # before the fused layers take the linears' weights
        assert isinstance(draft.model, Transformer)
        requantize_linears(draft.model)
    use_span_attention(draft.model, ROW_INVARIANT_ROWS)  # its chain steps and catch-ups
    use_fused_layers(draft.model)
    if scheme not in (None, REQUANTIZE_SCHEME):
        assert isinstance(draft.model, Transformer)
        load_or_quantize(draft.model, None, scheme)
    return draft
