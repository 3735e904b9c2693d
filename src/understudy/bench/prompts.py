"""Benchmark prompt sets: JSONL files, one object per line.

    {"id": "cmp-01", "category": "completion", "prompt": "def fib(n):"}
    {"id": "edit-01", "category": "editing", "messages": [{"role": "user", "content": "..."}]}

`prompt` is a string (or a list of token ids); `messages` a chat message list (the chat
template is applied). The package ships four sets written for this project
(`understudy/data/<name>.jsonl`): completion, editing, chat, summarize.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from understudy.config import UnderstudyError

SHIPPED_SETS = ("completion", "editing", "chat", "summarize")
# The headline subset: the first 3 prompts of each category, 96 new tokens, so that
# `understudy bench --compare hf` (none, draft and the three transformers peers, ~2 minutes a
# prompt on a 2-core CPU) stays under half an hour (docs/benchmarks.md).
DEFAULT_PER_CATEGORY = 3


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    category: str
    prompt: Any  # str | list[int] | list[dict[str, str]]: what Engine.generate takes
    source: str  # the file (or shipped set) it came from

    @property
    def is_chat(self) -> bool:
        return (
            isinstance(self.prompt, list) and bool(self.prompt) and isinstance(self.prompt[0], dict)
        )


def shipped_path(name: str) -> Path:
    return Path(str(resources.files("understudy") / "data" / f"{name}.jsonl"))


def _where(source: str, line_no: int) -> str:
    return f"{source}:{line_no}"


def _parse_line(obj: Any, where: str, source: str) -> BenchPrompt:
    if not isinstance(obj, dict):
        raise UnderstudyError(f"{where}: each line must be a JSON object")
    pid, category = obj.get("id"), obj.get("category")
    if not isinstance(pid, str) or not pid:
        raise UnderstudyError(f"{where}: 'id' must be a non-empty string")
    if not isinstance(category, str) or not category or category == "all":
        raise UnderstudyError(f"{where}: 'category' must be a non-empty string other than 'all'")
    has_prompt, has_messages = "prompt" in obj, "messages" in obj
    if has_prompt == has_messages:
        raise UnderstudyError(f"{where}: give exactly one of 'prompt' and 'messages'")
    if has_prompt:
        prompt = obj["prompt"]
        is_ids = isinstance(prompt, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        )
        if not (isinstance(prompt, str) or is_ids) or not prompt:
            raise UnderstudyError(
                f"{where}: 'prompt' must be a non-empty string or list of token ids"
            )
    else:
        prompt = obj["messages"]
        ok = (
            isinstance(prompt, list)
            and prompt
            and all(
                isinstance(m, dict)
                and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)
                and m["content"]
                for m in prompt
            )
        )
        if not ok:
            raise UnderstudyError(
                f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} strings"
            )
    return BenchPrompt(pid, category, prompt, source)


def load_prompt_file(spec: str | Path) -> list[BenchPrompt]:
    """Load a JSONL file, or a shipped set by name ("completion", ...)."""
    text_spec = str(spec)
    path = shipped_path(text_spec) if text_spec in SHIPPED_SETS else Path(text_spec)
    if not path.is_file():
        raise UnderstudyError(
            f"prompt file not found: {text_spec} (a .jsonl path, or one of {', '.join(SHIPPED_SETS)})"
        )
    source = text_spec if text_spec in SHIPPED_SETS else str(path)
    prompts = []
    for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise UnderstudyError(f"{_where(source, line_no)}: not JSON ({err.msg})") from None
        prompts.append(_parse_line(obj, _where(source, line_no), source))
    if not prompts:
        raise UnderstudyError(f"{source}: no prompts")
    return prompts


def load_prompts(specs: list[str] | None = None, per_category: int = 0) -> list[BenchPrompt]:
    """Prompts from `specs` (default: the four shipped sets), ids unique across them; with
    `per_category` > 0, only the first that many of each category (file order)."""
    if per_category < 0:
        raise UnderstudyError(f"per_category must be >= 0 (0 = all), got {per_category}")
    prompts: list[BenchPrompt] = []
    seen: dict[str, str] = {}
    for spec in specs or list(SHIPPED_SETS):
        for p in load_prompt_file(spec):
            if p.id in seen:
                raise UnderstudyError(
                    f"prompt id {p.id!r} appears twice ({seen[p.id]}, {p.source})"
                )
            seen[p.id] = p.source
            prompts.append(p)
    if per_category:
        counts: dict[str, int] = {}
        kept = []
        for p in prompts:
            counts[p.category] = counts.get(p.category, 0) + 1
            if counts[p.category] <= per_category:
                kept.append(p)
        prompts = kept
    return prompts


def categories(prompts: list[BenchPrompt]) -> list[str]:
    """Categories in order of first appearance."""
    return list(dict.fromkeys(p.category for p in prompts))
