"""Our methods' decode speed over llama.cpp's, from one bench run's own figures.

llama.cpp's plain decoding is the faster of two measures of it: llama-completion on the
bench's prompts, and llama-bench's tg test, one repetition after each prompt's methods
(interleaved with ours, so that both are timed in the same minutes: the speed of a shared
machine drifts by tens of percent within minutes, and a peer timed after all our runs is
timed in other conditions). llama.cpp's best is that or its speculative example, whichever
is faster. Every figure is decode only (prefill excluded), the "all" category's median over
repeats, so a ratio compares the same prompts and minutes.
"""

from __future__ import annotations

import statistics
from typing import Any

from understudy.bench.summary import ALL


def interleaved_tg(samples: list[dict[str, Any]]) -> dict[str, float] | None:
    """samples: {"tokens_per_s": ...} per llama-bench repetition -> mean, sd and count."""
    values = [float(s["tokens_per_s"]) for s in samples]
    if not values:
        return None
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"mean": statistics.fmean(values), "sd": sd, "n": len(values)}


def _decode(summary: dict[str, dict[str, Any]], label: str) -> float | None:
    figures = summary.get(label, {}).get(ALL)
    return None if figures is None else figures["decode_tokens_per_s"]["median"]


def against_llama_cpp(
    summary: dict[str, dict[str, Any]],
    ours: list[str],
    llama_plain: str | None,
    llama_speculative: list[str],
    tg: dict[str, float] | None,
) -> dict[str, Any] | None:
    """Each of `ours` (labels) over llama.cpp's fastest plain decoding and over its best.
    `llama_plain`: the llama-completion label (None if not run); `llama_speculative`: the
    speculative example's labels; `tg`: interleaved_tg's figures. None without llama.cpp."""
    plain = {
        name: value
        for name, value in [
            (llama_plain, _decode(summary, llama_plain) if llama_plain else None),
            ("llama-bench tg", tg["mean"] if tg else None),
        ]
        if name is not None and value
    }
    if not plain:
        return None
    plain_name = max(plain, key=lambda name: plain[name])
    best = {plain_name: plain[plain_name]}
    best |= {s: v for s in llama_speculative if (v := _decode(summary, s))}
    best_name = max(best, key=lambda name: best[name])
    rows = {}
    for label in ours:
        value = _decode(summary, label)
        if value:
            rows[label] = {
                "decode_tokens_per_s": value,
                "over_llama_plain": value / plain[plain_name],
                "over_llama_best": value / best[best_name],
            }
    return {
        "llama_plain": {"source": plain_name, "decode_tokens_per_s": plain[plain_name]},
        "llama_best": {"source": best_name, "decode_tokens_per_s": best[best_name]},
        "ours": rows,
    }


def against_markdown(figures: dict[str, Any], tg: dict[str, float] | None) -> str:
    """The figures as a Markdown table, with what llama.cpp's two references were."""
    plain, best = figures["llama_plain"], figures["llama_best"]
    lines = [
        "| method | decode tok/s | × llama.cpp plain | × llama.cpp best |",
        "|---|---|---|---|",
    ]
    for label, row in figures["ours"].items():
        lines.append(
            f"| {label} | {row['decode_tokens_per_s']:.2f} | {row['over_llama_plain']:.2f}× "
            f"| {row['over_llama_best']:.2f}× |"
        )
    interleaved = (
        f"llama-bench tg, one repetition after each prompt's methods: {tg['mean']:.2f} ± "
        f"{tg['sd']:.2f} tok/s over {tg['n']}. "
        if tg
        else ""
    )
    return (
        "Against llama.cpp, decode only, in this run:\n\n"
        + "\n".join(lines)
        + f"\n\n{interleaved}llama.cpp plain: {plain['source']}, "
        f"{plain['decode_tokens_per_s']:.2f} tok/s (the faster of llama-completion and "
        f"llama-bench tg); llama.cpp best: {best['source']}, "
        f"{best['decode_tokens_per_s']:.2f} tok/s (the faster of that and its speculative "
        "example)."
    )
