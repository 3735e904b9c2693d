"""Row-invariant attention for transformers' own modelling code (models/hf_fallback.py).

transformers lets a model's attention layers call a registered function instead of SDPA
(`AttentionInterface`), and builds their masks with a registered mask function
(`AttentionMaskInterface`). We register `rows_apart_attention` under ATTENTION and transformers'
SDPA mask (never skipped for `is_causal`) beside it, so transformers still decides who sees
whom (causal, sliding windows, chunks) and we decide the arithmetic.

Invariant: in a pass of at most ROWS_APART_UPTO query rows, row r's output is one SDPA call
of that row alone over the keys up to the last one its mask row lets it see. Its inputs are
its own query, the cache's keys and values at the slots before it, and its own mask row: none
depends on which other rows share the pass, on how many there are, or on where the pass
starts. So a token scored as row 3 of a verification pass and as row 0 of a plain decoding
pass goes through the same attention arithmetic, bit for bit. Longer passes (a prompt's
chunks, identical for every method) attend in one batched call.

Each call also counts itself in a `CallCount` handed in by keyword (COUNT_KWARG): that is how
the fallback checks, once at load, that every layer of a model really calls this function.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from understudy.config import UnderstudyError

ATTENTION = "understudy_rows"  # the name transformers knows this function and its mask by
ROWS_APART_UPTO = 128  # passes of up to this many rows attend row by row (every decode pass)
COUNT_KWARG = "understudy_attention_calls"
# keyword arguments a layer may hand its attention function that change the arithmetic in a
# way this function does not implement (gpt-oss's sinks, T5-style position biases)
UNSUPPORTED_KWARGS = ("s_aux", "sinks", "position_bias")


@dataclass
class CallCount:
    """How many attention calls one forward pass made through `rows_apart_attention`."""

    calls: int = 0


def attend(
    q: torch.Tensor,  # [B, H, R, D]
    keys: torch.Tensor,  # [B, Hkv, L, D]
    values: torch.Tensor,  # [B, Hkv, L, Dv]
    mask: torch.Tensor,  # [B, 1 | H, R, L], bool (True = may see) or additive float
    scale: float | None,
    softcap: float | None,
) -> torch.Tensor:
    """Scaled dot-product attention -> [B, H, R, Dv]; with `softcap`, transformers' eager
    arithmetic with a tanh cap on the scores (Gemma 2's), which SDPA lacks."""
    gqa = q.shape[1] != keys.shape[1]
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa
        )
    if gqa:
        group = q.shape[1] // keys.shape[1]
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.tanh(torch.matmul(q, keys.transpose(-1, -2)) * scale / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, values)


def visible_prefix(mask: torch.Tensor) -> list[int]:
    """Per query row of mask [B, h, R, L]: how many leading keys hold every key the row may
    see (in any batch entry or head), i.e. its last visible column + 1."""
    seen = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    columns = torch.arange(1, mask.shape[-1] + 1, device=mask.device)  # [L]
    return (seen * columns).amax(dim=(0, 1, 3)).clamp(min=1).tolist()  # [R]


def rows_apart_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, H, R, D]
    key: torch.Tensor,  # [B, Hkv, L, D]: the whole static cache, this pass's rows written
    value: torch.Tensor,  # [B, Hkv, L, Dv]
    attention_mask: torch.Tensor | None,  # [B, 1 | H, R, L]
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: returns ([B, R, H, Dv], no weights). See
    the module docstring for the invariant. Refuses what it cannot honour."""
    if attention_mask is None:  # over a static cache, no mask would let rows see stale slots
        raise UnderstudyError(
            f"{type(module).__name__} attended without a mask: it cannot run over a static cache"
        )
    if dropout:
        raise UnderstudyError("attention dropout is on: the model must be in eval mode")
    given = [name for name in UNSUPPORTED_KWARGS if kwargs.get(name) is not None]
    if given:
        raise UnderstudyError(
            f"{type(module).__name__} hands its attention {', '.join(given)}, which the "
            "transformers fallback does not implement"
        )
    count = kwargs.get(COUNT_KWARG)
    if isinstance(count, CallCount):
        count.calls += 1
    rows = query.shape[2]
    if rows > ROWS_APART_UPTO:
        out = attend(query, key, value, attention_mask, scaling, softcap)
    else:
        out = torch.cat(
            [
                attend(
                    query[:, :, r : r + 1],  # [B, H, 1, D]
                    key[:, :, :seen],  # [B, Hkv, seen, D]
                    value[:, :, :seen],
                    attention_mask[:, :, r : r + 1, :seen],  # [B, h, 1, seen]
                    scaling,
                    softcap,
                )
                for r, seen in enumerate(visible_prefix(attention_mask))
            ],
            dim=2,
        )  # [B, H, R, Dv]
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Make ATTENTION known to transformers (idempotent): the attention function above and
    transformers' SDPA mask with its `is_causal` shortcut off (with a static cache the
    shortcut would let a lone row see every slot, stale ones included)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def mask(*args: object, **kwargs: object) -> torch.Tensor | None:
        kwargs["allow_is_causal_skip"] = False
        return sdpa_mask(*args, **kwargs)

    AttentionInterface.register(ATTENTION, rows_apart_attention)
    AttentionMaskInterface.register(ATTENTION, mask)
