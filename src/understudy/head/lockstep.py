"""The target decodes many sequences in lockstep, one row each a pass: how head/ reads text.

Pass p feeds every sequence's token at position p as one row (its prompt's, or the one it
wrote at p - 1), so all rows share a position; sequence b's keys fill cache slots b * T ..
b * T + p and each row attends only to its own region (Transformer.hidden_states'
`regions`: views of the cache, no gather). A pass streams the weights once for all its rows.

Invariant (where the engine runs the target with row-invariant kernels: float32 on a CPU,
a GGUF target from its own blocks): the features of row (b, p) are bitwise what the engine's
runner keeps for that token when it scores it in a decode pass (Runner.last_hidden). The
target runs the engine's own kernels (`prepare_target`); every linear computes a row alone
(kernels/qgemm, kernels/rowgemm), every row's attention is span_attention over exactly its
own keys, as in a decode pass, and the fused layers are the same C calls. So the head trains
on the very bits it reads when drafting. (One exception the engine makes, not this module:
a prompt of more than ROW_INVARIANT_ROWS tokens is prefilled in passes whose attention is
batched, and their last bits depend on the request's key window.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from understudy.engine.pass_shape import (
    ROW_INVARIANT_ROWS,
    install_row_invariant_kernels,
    row_invariant_kernels,
)
from understudy.models.transformer import Transformer


@dataclass
class Decoded:
    """B sequences of T tokens and what the target computed after each token."""

    tokens: torch.Tensor  # [B, T] int64
    features: torch.Tensor  # [B, T, hidden] float32: final hidden state after tokens[:, :t+1]
    argmax: torch.Tensor  # [B, T] int64: the target's next-token argmax there
    kept: torch.Tensor | None  # [B, T, F] float32: the feature layers' outputs (None: none)


def prepare_target(model: Transformer) -> None:
    """Give the target the kernels the engine runs it with (engine/builder.py), where those
    are row-invariant, so lockstep passes compute each row as the engine's passes do."""
    if row_invariant_kernels(model):
        install_row_invariant_kernels(model, ROW_INVARIANT_ROWS)


def choose_next(
    logits: torch.Tensor,  # [B, V] the target's logits after position p of each row
    sampled: torch.Tensor,  # [B] bool: the row's token at p + 1 is drawn, not the argmax
    temperature: float,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(argmax [B], the token each row writes at p + 1 [B]): the argmax, or for the `sampled`
    rows a draw from softmax(logits / temperature)."""
    top = logits.argmax(-1).cpu()  # [B]
    pick = top.clone()
    if sampled.any():
        probs = torch.softmax(logits[sampled.to(logits.device)].float() / temperature, -1)
        pick[sampled] = torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1)
    return top, pick


@torch.inference_mode()
def decode_in_lockstep(
    model: Transformer,
    prompts: list[list[int]],
    seq_len: int,
    sample_to: list[int] | None = None,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
) -> Decoded:
    """Continue every prompt greedily to `seq_len` tokens, all in one batch (a prompt of
    `seq_len` tokens is only read); with `sample_to`, sequence b's tokens at positions <
    sample_to[b] past its prompt are sampled (at `temperature`, from `generator`) and only
    the rest is greedy. A prompt is read one token a pass like the text written after it:
    the passes cost the same either way and the batch needs no padding. The feature layers'
    outputs are kept where the model names some (Transformer.feature_layers)."""
    batch, T = len(prompts), seq_len
    assert all(0 < len(p) <= T for p in prompts), "each prompt must be 1..seq_len tokens"
    assert sample_to is None or len(sample_to) == batch
    device = model.device
    model.allocate_cache(batch * T)
    tokens = torch.zeros(batch, T, dtype=torch.long)
    for b, prompt in enumerate(prompts):
        tokens[b, : len(prompt)] = torch.tensor(prompt)
    features = torch.zeros(batch, T, model.cfg.hidden_size)
    width = len(model.feature_layers) * model.cfg.hidden_size
    kept = torch.zeros(batch, T, width) if width else None
    argmax = torch.zeros(batch, T, dtype=torch.long)
    prompt_len = torch.tensor([len(p) for p in prompts])  # [B]
    until = torch.zeros(batch, dtype=torch.long) if sample_to is None else torch.tensor(sample_to)
    slot_base = torch.arange(batch) * T  # [B] the first slot of each sequence's region
    for p in range(T):
        taps: list[torch.Tensor] | None = [] if kept is not None else None
        hidden = model.hidden_states(  # [B, hidden]
            tokens[:, p].to(device),
            torch.full((batch,), p, device=device),
            (slot_base + p).to(device),
            torch.ones(batch, p + 1, dtype=torch.bool, device=device),  # [B, p + 1]
            regions=T,
            features=taps,
        )
        features[:, p] = hidden.float().cpu()
        if kept is not None and taps is not None:
            kept[:, p] = torch.cat(taps, dim=-1).float().cpu()
        writes = (prompt_len <= p + 1) & (p + 1 < T)  # [B] rows past their prompt
        sampled = writes & (p + 1 < until)  # [B]
        top, pick = choose_next(model.lm_head(hidden), sampled, temperature, generator)
        argmax[:, p] = top
        if p + 1 < T:
            tokens[writes, p + 1] = pick[writes]
    return Decoded(tokens, features, argmax, kept)
