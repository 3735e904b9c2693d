"""The soak run's tables: requests by kind and status, what the mix exercised, throughput
and latency, and each invariant's verdict (soak_checks.py)."""

from __future__ import annotations

from typing import Any

from rich.table import Table


def rich_tables(results: dict[str, Any]) -> list[Table]:
    return [requests_table(results), summary_table(results), invariants_table(results)]


def requests_table(results: dict[str, Any]) -> Table:
    """One row per kind: its count by status, and the status it must get."""
    statuses = sorted({s for by in results["requests"].values() for s in by},
                      key=lambda s: (not s.isdigit(), s))  # fmt: skip
    config = results["config"]
    table = Table(title=f"Soak: {config['clients']} clients, {config['duration_s']:g} s, "
                  f"seed {config['seed']}", title_justify="left")  # fmt: skip
    table.add_column("kind")
    table.add_column("must get")
    for status in statuses:
        table.add_column(status, justify="right")
    for kind in sorted(results["requests"], key=lambda k: (k.startswith("bad: "), k)):
        by = results["requests"][kind]
        must = results["expected"].get(kind, "200")
        table.add_row(kind, must, *(str(by.get(s, "")) for s in statuses))
    features = ", ".join(f"{name} {n}" for name, n in sorted(results["features"].items()))
    table.caption = f"well-formed calls exercised: {features}"
    return table


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def summary_table(results: dict[str, Any]) -> Table:
    t = results["throughput"]
    memory = {k: f"{v / 2**20:.0f}" for k, v in results["memory"].items()}
    table = Table(title="Throughput, latency (s), resident memory (MiB)", title_justify="left")
    for column in ("requests", "req/s", "tokens/s", "latency p50 / p95 / p99",
                   "ttft p50 / p95", "refusals p50 / p95", "RSS start / warm / end / peak"):  # fmt: skip
        table.add_column(column, justify="right")
    table.add_row(
        str(t["requests"]),
        f"{t['requests_per_s']:.2f}",
        f"{t['tokens_per_s']:.2f}",
        " / ".join(seconds(t[f"latency_p{q}_s"]) for q in (50, 95, 99)),
        " / ".join(seconds(t[f"ttft_p{q}_s"]) for q in (50, 95)),
        " / ".join(seconds(t[f"refusal_p{q}_s"]) for q in (50, 95)),
        " / ".join(memory[k] for k in ("start", "warm", "end", "peak")),
    )
    return table


def invariants_table(results: dict[str, Any]) -> Table:
    table = Table(title="Invariants", title_justify="left")
    table.add_column("invariant")
    table.add_column("held")
    table.add_column("detail", overflow="fold")
    for name, verdict in results["invariants"].items():
        mark = "[green]yes[/green]" if verdict["ok"] else "[red]NO[/red]"
        table.add_row(name, mark, verdict["detail"])
    return table
