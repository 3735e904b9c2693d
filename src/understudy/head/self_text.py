"""Training text the target writes itself: docstring prompts and file openers, continued
greedily (head/features.py decodes them in lockstep batches, head/lockstep.py).

A head drafts what the target writes, so the text it learns from should be the target's own
(measured: 2.25x more standard-library text raised held-out agreement on stdlib code, but
not acceptance on completion prompts). Here every prompt is one function's signature and
docstring from the standard library (`docstring_prompts`), the kind of prompt a completion
user gives, and the target continues it greedily to the sequence length.

A second kind of prompt (`opener_prompts`) reaches the languages the standard library has
none of: a few characters that open a source file in JavaScript, C, Go, Rust, SQL, ...
(`OPENERS`), after which the target samples the rest of the prompt itself (OPENER_SAMPLED
tokens at OPENER_TEMPERATURE), then continues greedily like the docstring prompts
(measured: a head trained on Python only made 1.3 tokens per target pass on a JavaScript
completion prompt and 2.2-3.4 on the Python ones; adding text begun this way raised the
JavaScript one to 1.7 and the C one from 1.9 to 2.9; docs/eagle.md).

A third kind (`chat_prompts`) reaches chat and editing requests: a user message in the
target's chat template that asks something of one whole documented function (CHAT_ASKS:
explain, review, edit, test, translate), which the target answers greedily.

Invariant of the shards made from them: row t of a sequence holds the target's features
after tokens[:t+1] and its argmax; for t >= the prompt's length - 1 that argmax is the
token the sequence holds at t + 1 (greedy), the last one excepted; for openers, for t >=
the prompt's length + OPENER_SAMPLED - 1.
"""

from __future__ import annotations

import ast
import random
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from understudy.head.shards import SHARD

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
# what a chat user asks of a piece of code (chat_prompts): to explain it, review it, edit it,
# test it or carry it to another language; half the answers prose, half code
CHAT_ASKS = (
    "Explain what this function does, in a few sentences.",
    "Add type hints to this function. Return only the code.",
    "Is there a bug or an edge case this function gets wrong? Answer briefly.",
    "Rewrite this function so it is easier to read. Return only the code.",
    "Write two pytest tests for this function.",
    "Translate this function to JavaScript.",
    "Give the variables of this function clearer names. Return only the updated code.",
    "How would you make this function faster? Explain briefly, with code if it helps.",
)


def function_prompts(source: str) -> Iterator[str]:
    """Each documented function of a module's source: its decorators, signature and
    docstring, dedented and ending in a newline (what follows is the body to write)."""
    for node, lines in documented_functions(source):
        doc = node.body[0]
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        yield textwrap.dedent("\n".join(lines[first - 1 : doc.end_lineno])) + "\n"


def documented_functions(
    source: str,
) -> Iterator[tuple[ast.FunctionDef | ast.AsyncFunctionDef, list[str]]]:
    """Each function of a module's source with a docstring of MIN_DOCSTRING characters and
    a body past it, with the source's lines."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    lines = source.splitlines()
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        text = ast.get_docstring(node)
        if not text or len(text) < MIN_DOCSTRING or len(node.body) < 2:
            continue
        yield node, lines


def docstring_prompts(
    files: list[Path], tokenizer: Any, limit: int, max_tokens: int = MAX_PROMPT, seed: int = 0
) -> list[list[int]]:
    """Up to `limit` prompts (token ids, at most min(max_tokens, MAX_PROMPT) each) from the
    files' documented functions, in an order fixed by `seed` (so cached shards stay valid):
    shuffled, then sorted by length within runs of LENGTH_RUN, so a packed batch wastes few
    passes. The list for a smaller `limit` is a prefix of the list for a larger one."""
    max_tokens = min(max_tokens, MAX_PROMPT)
    found: list[list[int]] = []
    for source in readable_sources(files):
        for prompt in function_prompts(source):
            ids = tokenizer(prompt)["input_ids"]
            if 4 <= len(ids) <= max_tokens:
                found.append(ids)
    return fixed_order(found, limit, seed)


def readable_sources(files: list[Path]) -> Iterator[str]:
    """The text of each file that reads as UTF-8 (others are skipped)."""
    for path in files:
        try:
            yield path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue


def fixed_order(found: list[list[int]], limit: int, seed: int) -> list[list[int]]:
    """The first `limit` of `found` shuffled by `seed`, then sorted by length within runs of
    LENGTH_RUN: a shard's prompts then end near together, so a packed batch wastes few
    passes. The runs are cut before the limit is applied, so a larger limit extends a
    smaller one's list and cached shards stay valid when a user asks for more text."""
    random.Random(seed).shuffle(found)
    runs = [sorted(found[i : i + LENGTH_RUN], key=len) for i in range(0, len(found), LENGTH_RUN)]
    return [prompt for run in runs for prompt in run][:limit]


def opener_prompts(tokenizer: Any, limit: int) -> list[list[int]]:
    """`limit` prompts: the OPENERS' token ids in turn (a smaller limit's list is a prefix
    of a larger one's). Each is to be continued with `sample_to` = its length +
    OPENER_SAMPLED, so the target writes the rest of the prompt itself."""
    ids = [tokenizer(opener)["input_ids"] for opener in OPENERS]
    return [ids[i % len(ids)] for i in range(limit)]


def function_sources(source: str) -> Iterator[str]:
    """Each documented function of a module's source, whole (decorators to its last line),
    dedented."""
    for node, lines in documented_functions(source):
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        yield textwrap.dedent("\n".join(lines[first - 1 : node.end_lineno]))


def chat_prompts(
    files: list[Path], tokenizer: Any, limit: int, max_tokens: int = MAX_PROMPT, seed: int = 0
) -> list[list[int]]:
    """Up to `limit` chat prompts (the tokenizer's chat template, the assistant's turn open;
    at most min(max_tokens, MAX_PROMPT) tokens each): a user message that asks one of
    CHAT_ASKS (in turn) of one documented function of the files, its whole source in a
    fenced block. What the target answers is what a head drafts in chat and editing
    requests, where the text is the chat template's and half of it prose (measured: a head
    trained on code continuations alone kept 1.6 tokens a pass on chat prompts against 2.1
    on completion ones). The order is fixed by `seed` as docstring_prompts' is."""
    from understudy.engine.prompts import apply_chat_template

    max_tokens = min(max_tokens, MAX_PROMPT)
    found: list[list[int]] = []
    for source in readable_sources(files):
        for code in function_sources(source):
            ask = CHAT_ASKS[len(found) % len(CHAT_ASKS)]
            message = {"role": "user", "content": f"{ask}\n\n```python\n{code}\n```"}
            ids = apply_chat_template(tokenizer, [message])
            if len(ids) <= max_tokens:
                found.append(ids)
    return fixed_order(found, limit, seed)
