"""Training text the target writes itself: docstring prompts, continued greedily in batches.

A head drafts what the target writes, so the text it learns from should be the target's own
(measured: 2.25x more standard-library text raised held-out agreement on stdlib code, but
not acceptance on completion prompts). Here every prompt is one function's signature and
docstring from the standard library (`docstring_prompts`), the kind of prompt a completion
user gives, and the target continues it greedily to `seq_len` tokens.

The continuation is decoded in batches (`continue_in_batches`): the sequences of a batch
run in lockstep, one row each in every pass of the single-sequence model, each sequence in
its own region of cache slots (sequence b's token at position p is written to slot
b * T + p) and each row attending only to its own region (`regions`, one batched SDPA call
over views of the cache). A pass streams the weights once however many rows it holds, so a
batch of 256 writes about 3x the tokens per second of packing fewer sequences with each
row's keys gathered (docs/eagle.md has the timings). The features come out of the same
passes, so there is no second run over the text.

A second kind of prompt (`opener_prompts`) reaches the languages the standard library has
none of: a few characters that open a source file in JavaScript, C, Go, Rust, SQL, ...
(`OPENERS`), after which the target samples the rest of the prompt itself (`sampled` tokens
at `temperature`), then continues greedily like the docstring prompts (measured: a head
trained on Python only made 1.3 tokens per target pass on a JavaScript completion prompt
and 2.2-3.4 on the Python ones; adding text begun this way raised the JavaScript one to
1.7 and the C one from 1.9 to 2.9; docs/eagle.md).

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
def continue_in_batches(
    model: Transformer,
    prompts: list[list[int]],
    seq_len: int,
    sample_to: list[int] | None = None,
    temperature: float = OPENER_TEMPERATURE,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Continue every prompt greedily to `seq_len` tokens, all in one batch; with
    `sample_to`, sequence b's tokens at positions < sample_to[b] past its prompt are sampled
    (at `temperature`, from `generator`) and only the rest is greedy.

    The sequences run in lockstep: pass p feeds every sequence's token at position p (its
    prompt's, or the one it wrote) as one row, so all rows share a position and sequence b's
    keys fill slots b * T .. b * T + p of the cache (`regions`: each row attends to its own
    region, batched by SDPA with no gather). A prompt is read one token a pass like the text
    written after it; the passes cost the same either way and the batch needs no padding.

    Returns tokens [B, T] int64, features [B, T, hidden] float32, argmax [B, T] int64
    (B = len(prompts), T = seq_len), as head/features.py's `target_features` would give
    for each sequence (up to the rounding of a pass of a different shape)."""
    batch, T = len(prompts), seq_len
    assert all(0 < len(p) < T for p in prompts), "each prompt must be shorter than seq_len"
    assert sample_to is None or len(sample_to) == batch
    device = model.device
    model.allocate_cache(batch * T)
    tokens = torch.zeros(batch, T, dtype=torch.long)
    for b, prompt in enumerate(prompts):
        tokens[b, : len(prompt)] = torch.tensor(prompt)
    features = torch.zeros(batch, T, model.cfg.hidden_size)
    argmax = torch.zeros(batch, T, dtype=torch.long)
    prompt_len = torch.tensor([len(p) for p in prompts])  # [B]
    until = torch.zeros(batch, dtype=torch.long) if sample_to is None else torch.tensor(sample_to)
    slot_base = torch.arange(batch) * T  # [B] the first slot of each sequence's region
    for p in range(T):
        hidden = model.hidden_states(  # [B, hidden]
            tokens[:, p].to(device),
            torch.full((batch,), p, device=device),
            (slot_base + p).to(device),
            torch.ones(batch, p + 1, dtype=torch.bool, device=device),  # [B, p + 1]
            regions=T,
        )
        features[:, p] = hidden.float().cpu()
        writes = (prompt_len <= p + 1) & (p + 1 < T)  # [B] rows past their prompt
        sampled = writes & (p + 1 < until)  # [B]
        top, pick = choose_next(model.lm_head(hidden), sampled, temperature, generator)
        argmax[:, p] = top
        if p + 1 < T:
            tokens[writes, p + 1] = pick[writes]
    return tokens, features, argmax


def extract_self_text(
    model: Transformer,
    prompts: list[list[int]],
    seq_len: int,
    folder: Path,
    progress: bool = True,
    shards_per_pass: int = 16,
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
    16 shards (256 sequences) a batch: see the module docstring for what the batch size buys;
    the cache then holds 256 x T slots a layer (1.9 GB for the 1.5B target at T = 256)."""
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
