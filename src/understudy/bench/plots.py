"""PNG plots of a benchmark summary (matplotlib, Agg backend: no display needed).

- speedup.png: speedup vs plain per method and category (bars: median over repeats; whiskers:
  min..max).
- acceptance_per_position.png: share of rounds whose i-th drafted token was accepted.
- theory.png: each method's measured (α, speedup) per category over the theory curve
  speedup(α) = E(α, K) / (K·c + 1) (Leviathan et al. 2023, Thm 3.8) for its measured K and c.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from understudy.bench.summary import ALL
from understudy.policy.theory import expected_speedup


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plots(
    summary: dict[str, dict[str, Any]],
    labels: list[str],
    categories: list[str],
    baseline: str,
    out: Path,
    title: str,
) -> list[Path]:
    """Write the three plots into `out`; return their paths."""
    plt = _pyplot()
    paths = [
        _speedup(plt, summary, [x for x in labels if x != baseline], categories, out, title),
        _acceptance(plt, summary, labels, categories, out, title),
        _theory(plt, summary, labels, categories, out, title),
    ]
    return paths


def _speedup(plt, summary, labels, categories, out: Path, title: str) -> Path:
    cats = [*categories, ALL]
    fig, ax = plt.subplots(figsize=(max(7.5, 1.6 * len(cats) + 0.4 * len(labels) + 1.5), 4.2))
    width = 0.8 / max(len(labels), 1)
    for j, label in enumerate(labels):
        xs, ys, lo, hi = [], [], [], []
        for i, cat in enumerate(cats):
            s = summary.get(label, {}).get(cat, {}).get("speedup", {})
            if s.get("median") is None:
                continue
            xs.append(i - 0.4 + width * (j + 0.5))
            ys.append(s["median"])
            lo.append(s["median"] - s["min"])
            hi.append(s["max"] - s["median"])
        hatch = "//" if label.startswith("hf-") else None  # the peers
        bars = ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=label, hatch=hatch)
        ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=2)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(cats)), cats)
    ax.set_ylabel("speedup vs plain (tokens/s ratio)")
    ax.set_title(f"{title}\nspeedup per method and category")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.margins(y=0.15)
    path = out / "speedup.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _acceptance(plt, summary, labels, categories, out: Path, title: str) -> Path:
    cats = [*categories, ALL]
    fig, axes = plt.subplots(1, len(cats), figsize=(3.0 * len(cats), 3.4), sharey=True)
    axes = list(axes) if len(cats) > 1 else [axes]
    for ax, cat in zip(axes, cats, strict=True):
        for label in labels:
            ppa = summary.get(label, {}).get(cat, {}).get("per_position_acceptance") or []
            if ppa:
                ax.plot(range(1, len(ppa) + 1), ppa, marker="o", label=label)
        ax.set_title(cat, fontsize=10)
        ax.set_xlabel("drafted position")
        ax.set_ylim(0, 1.05)
        ax.xaxis.get_major_locator().set_params(integer=True)
    axes[0].set_ylabel("share of rounds accepted")
    handles, names = axes[-1].get_legend_handles_labels()
    if handles:
        axes[-1].legend(handles, names, fontsize=8)
    fig.suptitle(f"{title}: acceptance per drafted position", fontsize=10)
    path = out / "acceptance_per_position.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _theory(plt, summary, labels, categories, out: Path, title: str) -> Path:
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    grid = [i / 200 for i in range(201)]
    markers = "osD^v<>p*h"
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    n = 0
    for label in labels:
        overall = summary.get(label, {}).get(ALL, {})
        k, c = overall.get("theory_k"), overall.get("c")
        if not k or c is None:
            continue
        color = colors[n % len(colors)]
        n += 1
        ax.plot(
            grid,
            [expected_speedup(a, k, c) for a in grid],
            color=color,
            linewidth=1,
            label=f"{label}: theory, K={k}, c={c:.2f}",
        )
        for i, cat in enumerate(categories):
            s = summary[label].get(cat, {})
            alpha, speed = s.get("alpha_implied"), (s.get("speedup") or {}).get("median")
            if alpha is None or speed is None:
                continue
            ax.scatter([alpha], [speed], color=color, marker=markers[i % len(markers)], zorder=3)
            ax.annotate(cat, (alpha, speed), fontsize=7, xytext=(4, -8), textcoords="offset points")
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xlabel("α (per-token acceptance implied by the mean accepted length)")
    ax.set_ylabel("speedup vs plain")
    ax.set_xlim(0, 1)
    ax.set_title(
        f"{title}\nmeasured speedup (points) over Leviathan's Thm 3.8 (lines)", fontsize=10
    )
    if n:
        ax.legend(fontsize=8, loc="upper left")
    path = out / "theory.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
