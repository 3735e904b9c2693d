"""The serving benchmark's table (rich and markdown) and its plot: aggregate tokens/s
against concurrency, one line per method, and p50 latency beside it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

COLUMNS = ("method", "clients", "tok/s", "vs 1 client", "vs first method", "latency p50/p95 s",
           "TTFT p50/p95 s", "identical")  # fmt: skip


def _pair(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None else f"{a:.2f} / {b:.2f}"


def _identical(level: dict[str, Any]) -> str:
    """yes / NO against the first method's answers; where they differ, whether the answers
    equal the same engine's first server at its first level (a peer against itself)."""
    word = {True: "yes", False: "NO", None: "-"}
    own = level.get("identical_same_engine")
    if level["identical"] is False and own is not None:
        return f"NO (own engine: {word[own]})"
    return word[level["identical"]]


def rows(results: dict[str, Any]) -> list[list[str]]:
    """One row per (method, concurrency): the ratios are against the same method with one
    client, and against the first method at the same concurrency."""
    levels = results["levels"]
    one = {lv["method"]: lv["tok_s"] for lv in levels if lv["concurrency"] == 1}
    first = levels[0]["method"] if levels else None
    base = {lv["concurrency"]: lv["tok_s"] for lv in levels if lv["method"] == first}
    out = []
    for lv in levels:
        solo, same = one.get(lv["method"]), base.get(lv["concurrency"])
        out.append([
            lv["method"],
            str(lv["concurrency"]),
            f"{lv['tok_s']:.2f}",
            "-" if solo is None else f"{lv['tok_s'] / solo:.2f}x",
            "-" if same is None else f"{lv['tok_s'] / same:.2f}x",
            _pair(lv["latency_p50_s"], lv["latency_p95_s"]),
            _pair(lv["ttft_p50_s"], lv["ttft_p95_s"]),
            _identical(lv),
        ])  # fmt: skip
    return out


def markdown(results: dict[str, Any]) -> str:
    config = results["config"]
    lines = [
        f"Serving benchmark, {results['date']}: {config['requests']} requests of "
        f"{config['max_tokens']} tokens (EOS ignored) at each concurrency, temperature "
        f"{config['temperature']}, through the HTTP server.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows(results)]
    peers = {k: v for k, v in results.get("servers", {}).items() if v.get("engine") == "vllm"}
    if peers:
        lines.append("")
    for label, peer in peers.items():
        spec = peer.get("speculative_config")
        lines.append(
            f"- {label}: vLLM {peer['version']}, {peer['weights']}"
            + (f", speculative_config {spec}" if spec else ", plain decoding")
        )
    return "\n".join(lines) + "\n"


def rich_table(results: dict[str, Any]) -> Any:
    from rich.table import Table

    table = Table(title="serving: the same requests at each concurrency")
    for name in COLUMNS:
        table.add_column(name, justify="left" if name == "method" else "right")
    for row in rows(results):
        table.add_row(*row)
    return table


def plot(results: dict[str, Any], out: Path) -> Path:
    """throughput.png: tokens/s and p50 latency against concurrency, per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    methods = list(dict.fromkeys(lv["method"] for lv in results["levels"]))
    for method in methods:
        levels = [lv for lv in results["levels"] if lv["method"] == method]
        xs = [lv["concurrency"] for lv in levels]
        left.plot(xs, [lv["tok_s"] for lv in levels], marker="o", label=method)
        right.plot(xs, [lv["latency_p50_s"] for lv in levels], marker="o", label=method)
    for ax, label in ((left, "aggregate tokens/s"), (right, "request latency p50 (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"serving benchmark, {results['date']}")
    fig.tight_layout()
    path = out / "throughput.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
