"""Training text the target writes itself: docstring prompts, continued greedily in batches.

A head drafts what the target writes, so the text it learns from should be the target's own
(session 10: 2.25x more standard-library text raised held-out agreement on stdlib code, but
not acceptance on completion prompts). Here every prompt is one function's signature and
docstring from the standard library (`docstring_prompts`), the kind of prompt a completion
user gives, and the target continues it greedily to `seq_len` tokens.

The continuation is decoded in packed batches (`continue_in_batches`): the rows of many
sequences share one pass of the single-sequence model, each sequence in its own region of
cache slots (sequence b's token at position p is written to slot b * T + p) and each row
attending only to its own region (`key_slots`, scored by batched matmuls: transformer.py's
`rows_attention`). A pass streams the weights once however many rows it holds: on the 1.5B
bf16 target on a 2-core CPU the layers of a pass of 32 / 48 / 64 rows took 0.38 / 0.49 /
0.65 s (session 13; 0.66 s for 32 rows with one SDPA call a row) against 0.22 s for one
row. The features come out of the same passes, so there is no second run over the text.

A second kind of prompt (`opener_prompts`) reaches the languages the standard library has
none of: a few characters that open a source file in JavaScript, C, Go, Rust, SQL, ...
(`OPENERS`), after which the target samples the rest of the prompt itself (`sampled` tokens
at `temperature`), then continues greedily like the docstring prompts (session 13: the head,
trained on Python only, made 1.3 tokens per target pass on a JavaScript completion prompt
and 2.2-3.4 on the Python ones; session 14: text begun this way raised the JavaScript one to
1.7 and the C one from 1.9 to 2.9).

Shards have the layout of head/features.py (tokens, features, argmax), so training reads
them like any corpus. Invariant: row t of a sequence holds the target's final hidden state
after tokens[:t+1] and its argmax; for t >= the prompt's length - 1 that argmax is the
token the sequence holds at t + 1 (greedy), the last one excepted; with `sample_to`, for
t >= max(prompt length, sample_to) - 1.
"""

from __future__ import annotations

import ast
import random
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from understudy.head.features import SHARD, shard_path, write_shard
from understudy.models.packed import can_pack, pack_linears
from understudy.models.transformer import Transformer

MAX_PROMPT = 160  # tokens: longer signatures + docstrings are skipped
MIN_DOCSTRING = 20  # characters: a docstring shorter than this says too little to continue
LENGTH_RUN = 16 * SHARD  # prompts sorted by length within runs this long (see below)
# the openings of source files in languages a code model is asked to complete; the target
# writes the rest of each prompt (opener_prompts). None ends in a space: the tokenizer puts
# a word's space in front of it, so the target samples " name" after "function", not "name"
OPENERS = (
    "//",
    "/**\n *",
    "function",
    "const",
    "export function",
    "import React from 'react';\n",
    "interface",
    "#include <stdio.h>\n",
    "#include <stdlib.h>\n#include <string.h>\n",
    "/*",
    "#include <vector>\n",
    "template <typename T>\n",
    "public class",
    "import java.util.",
    "package main\n\nimport",
    "func",
    "fn",
    "use std::",
    "#!/bin/bash\n",
    "SELECT",
    "CREATE TABLE",
    "<!DOCTYPE html>\n",
    "using System;\n",
    "<?php\n",
    "def",
    "class",
    "import",
    "#",
)
OPENER_SAMPLED = 48  # tokens the target samples after an opener: the rest of its prompt
OPENER_TEMPERATURE = 0.8


def function_prompts(source: str) -> Iterator[str]:
    """Each documented function of a module's source: its decorators, signature and
    docstring, dedented and ending in a newline (what follows is the body to write)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    lines = source.splitlines()
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        doc = node.body[0] if node.body else None
        text = ast.get_docstring(node)
        if doc is None or not text or len(text) < MIN_DOCSTRING or len(node.body) < 2:
            continue
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        yield textwrap.dedent("\n".join(lines[first - 1 : doc.end_lineno])) + "\n"


def docstring_prompts(
    files: list[Path], tokenizer: Any, limit: int, max_tokens: int = MAX_PROMPT, seed: int = 0
) -> list[list[int]]:
    """Up to `limit` prompts (token ids, at most min(max_tokens, MAX_PROMPT) each) from the
    files' documented functions, in an order fixed by `seed` (so cached shards stay valid):
    shuffled, then sorted by length within runs of LENGTH_RUN, so a packed batch wastes few
    passes. The list for a smaller `limit` is a prefix of the list for a larger one."""
    max_tokens = min(max_tokens, MAX_PROMPT)
    found: list[list[int]] = []
    for path in files:
        try:
            source = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for prompt in function_prompts(source):
            ids = tokenizer(prompt)["input_ids"]
            if 4 <= len(ids) <= max_tokens:
                found.append(ids)
    random.Random(seed).shuffle(found)
    # sorted by length within runs of LENGTH_RUN: a shard's prompts then end near together.
    # The runs are cut before the limit is applied, so a larger limit extends a smaller
    # one's list and cached shards stay valid when a user asks for more text
    runs = [sorted(found[i : i + LENGTH_RUN], key=len) for i in range(0, len(found), LENGTH_RUN)]
    return [prompt for run in runs for prompt in run][:limit]


def opener_prompts(tokenizer: Any, limit: int) -> list[list[int]]:
    """`limit` prompts: the OPENERS' token ids in turn (a smaller limit's list is a prefix
    of a larger one's). Each is to be continued with `sample_to` = its length +
    OPENER_SAMPLED, so the target writes the rest of the prompt itself."""
    ids = [tokenizer(opener)["input_ids"] for opener in OPENERS]
    return [ids[i % len(ids)] for i in range(limit)]


def choose_next(
    logits: torch.Tensor,  # [r, V] the target's logits after position p of each row
    positions: torch.Tensor,  # [r] p
    sample_to: torch.Tensor | None,  # [r] the token at t is sampled while t < this
    temperature: float,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(argmax [r], the token each row writes at p + 1 [r]): the argmax, or a sample of
    softmax(logits / temperature) for rows whose position p + 1 is still to be sampled."""
    top = logits.argmax(-1).cpu()  # [r]
    pick = top.clone()
    if sample_to is not None:
        sampled = positions + 1 < sample_to  # [r]
        if sampled.any():
            probs = torch.softmax(logits[sampled.to(logits.device)].float() / temperature, -1)
            pick[sampled] = torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1)
    return top, pick


@torch.inference_mode()
def continue_in_batches(
    model: Transformer,
    prompts: list[list[int]],
    seq_len: int,
    sample_to: list[int] | None = None,
    temperature: float = OPENER_TEMPERATURE,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Continue every prompt greedily to `seq_len` tokens, all in one packed batch; with
    `sample_to`, sequence b's tokens at positions < sample_to[b] past its prompt are sampled
    (at `temperature`, from `generator`) and only the rest is greedy.

    Returns tokens [B, T] int64, features [B, T, hidden] float32, argmax [B, T] int64
    (B = len(prompts), T = seq_len), as head/features.py's `target_features` would give
    for each sequence (up to the rounding of a pass of a different shape)."""
    batch, T = len(prompts), seq_len
    assert all(0 < len(p) < T for p in prompts), "each prompt must be shorter than seq_len"
    assert sample_to is None or len(sample_to) == batch
    until = None if sample_to is None else torch.tensor(sample_to)  # [B]
    device = model.device
    model.allocate_cache(batch * T)
    tokens = torch.zeros(batch, T, dtype=torch.long)
    features = torch.zeros(batch, T, model.cfg.hidden_size)
    argmax = torch.zeros(batch, T, dtype=torch.long)
    # prefill: every prompt's rows in one pass, each row seeing its own prompt's past
    rows = [(b, p) for b, prompt in enumerate(prompts) for p in range(len(prompt))]
    seq = torch.tensor([b for b, _ in rows])  # [R]
    pos = torch.tensor([p for _, p in rows])  # [R]
    slot = seq * T + pos  # [R]
    keys = torch.arange(batch * T)  # [B*T]
    mask = (keys[None] // T == seq[:, None]) & (keys[None] % T <= pos[:, None])  # [R, B*T]
    ids = torch.tensor([t for prompt in prompts for t in prompt])  # [R]
    hidden = model.hidden_states(ids.to(device), pos.to(device), slot.to(device), mask.to(device))
    tokens[seq, pos] = ids
    features[seq, pos] = hidden.float().cpu()
    last_rows = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1  # [B] each prompt's last
    logits = model.lm_head(hidden)  # [R, V]
    argmax[seq, pos] = logits.argmax(-1).cpu()
    upto = None if until is None else until[seq[last_rows]]
    _, following = choose_next(  # [B] the token each sequence writes next
        logits[last_rows.to(device)], pos[last_rows], upto, temperature, generator
    )
    del logits
    # decode: one row per unfinished sequence, attending to its own region of slots, all
    # rows in batched matmuls (rows_attention; a 1-row SDPA call per row cost 1.7x a pass)
    attns = [layer.attn for layer in model.layers]
    saved = [(a.rows_apart_upto, a.rows_share_calls) for a in attns]
    for a in attns:
        a.rows_apart_upto, a.rows_share_calls = 0, True
    try:
        length = torch.tensor([len(p) for p in prompts])  # [B] tokens held so far
        while True:
            live = (length < T).nonzero().flatten()  # [r]
            if live.numel() == 0:
                break
            p = length[live]  # [r] the position each live row writes
            last = following[live]  # [r] the token chosen after position p - 1
            tokens[live, p] = last
            key_slots = live[:, None] * T + torch.arange(T)[None]  # [r, T]
            row_mask = torch.arange(T)[None] <= p[:, None]  # [r, T]
            hidden = model.hidden_states(
                last.to(device),
                p.to(device),
                (live * T + p).to(device),
                row_mask.to(device),
                key_slots.to(device),
            )
            features[live, p] = hidden.float().cpu()
            upto = None if until is None else until[live]
            top, pick = choose_next(model.lm_head(hidden), p, upto, temperature, generator)
            argmax[live, p] = top
            following[live] = pick
            length[live] += 1
    finally:
        for a, (apart, share) in zip(attns, saved, strict=True):
            a.rows_apart_upto, a.rows_share_calls = apart, share
    return tokens, features, argmax


def extract_self_text(
    model: Transformer,
    prompts: list[list[int]],
    seq_len: int,
    folder: Path,
    progress: bool = True,
    shards_per_pass: int = 3,
    sampled: int = 0,
    temperature: float = OPENER_TEMPERATURE,
    seed: int = 0,
) -> list[Path]:
    """Shards of the target's own continuations of `prompts`, in head/features.py's format;
    `shards_per_pass` shards (of SHARD sequences) are decoded in one packed batch. Complete
    shards are kept (an interrupted run resumes). Returns all shard paths. `sampled` > 0:
    the first `sampled` tokens after each prompt are sampled at `temperature` (the draws of
    a pass seeded by `seed` and its first shard), the rest greedy (opener_prompts).

    Packs the target's linears for passes of that many rows, in place (models/packed.py).
    3 shards (48 rows) a pass: per token, 48 rows cost 12% less than 32 and 64 rows 1% less
    than 48 (the 1.5B bf16 target on a 2-core CPU, session 13)."""
    folder.mkdir(parents=True, exist_ok=True)
    per_pass = SHARD * shards_per_pass
    if can_pack(model.device, model.dtype):
        pack_linears(model, per_pass)
    starts = list(range(0, len(prompts), SHARD))
    paths = [shard_path(folder, s // SHARD) for s in starts]
    todo = [s for s, path in zip(starts, paths, strict=True) if not path.exists()]
    bar = tqdm(
        total=sum(len(prompts[s : s + SHARD]) for s in todo) * seq_len,
        unit="tok",
        desc="target writes",
        disable=not progress,
    )
    for i in range(0, len(todo), shards_per_pass):
        group = todo[i : i + shards_per_pass]
        batch = [prompt for s in group for prompt in prompts[s : s + SHARD]]
        sample_to = [min(len(p) + sampled, seq_len) for p in batch] if sampled else None
        generator = torch.Generator().manual_seed(seed * 100_003 + group[0] // SHARD)
        tokens, features, argmax = continue_in_batches(
            model, batch, seq_len, sample_to, temperature, generator
        )
        row = 0
        for s in group:
            n = len(prompts[s : s + SHARD])
            part = slice(row, row + n)
            row += n
            write_shard(shard_path(folder, s // SHARD), tokens[part], features[part], argmax[part])
        bar.update(len(batch) * seq_len)
    bar.close()
    return paths
