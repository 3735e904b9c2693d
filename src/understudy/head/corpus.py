"""The offline training corpus: the Python standard library's own source files.

Every machine that runs understudy has them, they are real code with real docstrings, and
their licence (PSF) allows this use. Files are taken in a fixed shuffled order (so a small
budget still covers many modules), joined by blank lines, tokenized with the target's
tokenizer and cut into sequences of `seq_len` tokens.

Invariant: for one Python installation, tokenizer and seed, `stdlib_sequences` returns the
same sequences in the same order, so cached features (head/features.py) stay valid and a
resumed extraction continues where it stopped.
"""

from __future__ import annotations

import random
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SKIP_DIRS = {"test", "tests", "site-packages", "dist-packages", "__pycache__", "idle_test"}


def stdlib_files(seed: int = 0) -> list[Path]:
    """The standard library's .py files (tests and installed packages excluded), shuffled."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p for p in root.rglob("*.py") if not SKIP_DIRS & set(p.relative_to(root).parts[:-1])
    )
    random.Random(seed).shuffle(files)
    return files


def text_files(paths: list[Path], seed: int = 0) -> list[Path]:
    """User-given --data: files, or directories searched for .py/.md/.txt files, shuffled."""
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.suffix in (".py", ".md", ".txt"))
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"--data {path}: no such file or directory")
    random.Random(seed).shuffle(files)
    return files


def token_sequences(
    files: list[Path], tokenizer: Any, seq_len: int, limit: int
) -> Iterator[list[int]]:
    """Up to `limit` sequences of exactly `seq_len` token ids from the files, in order."""
    buffer: list[int] = []
    made = 0
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        buffer += tokenizer(text + "\n\n")["input_ids"]
        while len(buffer) >= seq_len:
            yield buffer[:seq_len]
            buffer = buffer[seq_len:]
            made += 1
            if made >= limit:
                return
