"""The benchmark's table: rich on the terminal, Markdown for the README (same rows)."""

from __future__ import annotations

from typing import Any

from understudy.bench.summary import ALL

COLUMNS = (
    "category",
    "method",
    "tok/s",
    "× plain",
    "× plain decode",
    "tok/pass",
    "accept",
    "acc. len",
    "accept @1..4",
    "c",
    "identical",
)
NOTES = (
    "× plain: tokens/s (prefill included) over method none's on the same prompts, same run; "
    "× plain decode: the same without prefill. accept: accepted / drafted; acc. len: mean "
    "accepted length (bonus/correction included); accept @i: share of rounds whose i-th "
    "drafted token was kept; c: one drafted token's cost / one target pass, measured; "
    "identical: outputs equal to plain greedy decoding (ours; llama.cpp's rows: to "
    "llama.cpp-plain's text). llama.cpp's rows are its llama-completion (plain) and "
    "llama-speculative-simple (draft) on the same GGUF files and prompts, timed by themselves."
)


def _num(value: float | None, fmt: str = ".2f") -> str:
    return "—" if value is None else format(value, fmt)


def _spread(s: dict[str, Any] | None, fmt: str = ".2f", suffix: str = "") -> str:
    if not s or s.get("median") is None:
        return "—"
    text = f"{s['median']:{fmt}}{suffix}"
    if len(s.get("values", [])) > 1:
        text += f" ({s['min']:{fmt}}–{s['max']:{fmt}})"
    return text


def rows(
    summary: dict[str, dict[str, Any]], labels: list[str], categories: list[str]
) -> list[list[list[str]]]:
    """Table rows grouped by category (one group per category, then "all")."""
    groups = []
    for cat in [*categories, ALL]:
        group = []
        for label in labels:
            s = summary.get(label, {}).get(cat)
            if s is None:
                continue
            ident = s.get("identical")
            ppa = s.get("per_position_acceptance") or []
            group.append(
                [
                    cat,
                    label,
                    _spread(s["tokens_per_s"]),
                    _spread(s["speedup"], suffix="×"),
                    _spread(s["decode_speedup"], suffix="×"),
                    _num(s.get("tokens_per_pass")),
                    _num(s.get("acceptance_rate"), ".0%"),
                    _num(s.get("mean_accepted_length")),
                    " ".join(f"{v:.2f}" for v in ppa[:4]) or "—",
                    _num(s.get("c")),
                    "—" if ident is None else f"{ident['count']}/{ident['of']}",
                ]
            )
        if group:
            groups.append(group)
    return groups


def rich_table(
    summary: dict[str, dict[str, Any]], labels: list[str], categories: list[str], title: str
) -> Any:
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for i, name in enumerate(COLUMNS):
        table.add_column(name, justify="left" if i < 2 else "right", no_wrap=i < 2)
    for group in rows(summary, labels, categories):
        for j, row in enumerate(group):
            table.add_row(*row, end_section=j == len(group) - 1)
    return table


def markdown_table(
    summary: dict[str, dict[str, Any]], labels: list[str], categories: list[str]
) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for group in rows(summary, labels, categories):
        for row in group:
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)
