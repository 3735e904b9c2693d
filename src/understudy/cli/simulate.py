"""`understudy simulate`: what speculative decoding buys for a given acceptance α and cost c.

Prints the analytic expectations of Leviathan et al. 2023 ("Fast Inference from Transformers
via Speculative Decoding", eq. 1 and Theorem 3.8) beside a Monte Carlo estimate, and the
speedup-vs-K curve. See `understudy.policy.theory`. This path must start fast: it never imports torch.

    python -m understudy.cli.simulate --alpha 0.8 --c 0.1 [--k 4] [--json]
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from understudy.config import UnderstudyError
from understudy.policy.theory import simulate_report

ERROR_EXIT_CODE = 2
_CURVE_K = 16  # the text sparkline shows K = 1..16
_SPARK = "▁▂▃▄▅▆▇█"


def simulate(
    alpha: Annotated[
        float,
        typer.Option("--alpha", help="Expected per-token acceptance α, in [0, 1]."),
    ],
    c: Annotated[
        float,
        typer.Option("--c", help="Cost of one drafter step / cost of one target pass (>= 0)."),
    ],
    k: Annotated[
        int | None,
        typer.Option("--k", "-k", help="Tokens drafted per round, 1..64 (default: optimal K)."),
    ] = None,
    rounds: Annotated[int, typer.Option(help="Monte Carlo rounds.")] = 20_000,
    spread: Annotated[
        float,
        typer.Option(help="Std. dev. of the per-round acceptance α' around α (0 = fixed α)."),
    ] = 0.1,
    seed: Annotated[int, typer.Option(help="Monte Carlo seed.")] = 0,
    json_out: Annotated[
        bool, typer.Option("--json", help="Print one JSON object and nothing else.")
    ] = False,
) -> None:
    """Expected tokens per round and speedup of speculative decoding (Leviathan et al. 2023)."""
    try:
        report = simulate_report(alpha, c, k, rounds=rounds, spread=spread, seed=seed)
    except UnderstudyError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(ERROR_EXIT_CODE) from None
    if json_out:
        typer.echo(json.dumps(report))
    else:
        _print_report(report)


def sparkline(values: list[float]) -> str:
    """One block character per value, scaled between the smallest and largest value."""
    low, high = min(values), max(values)
    if high - low <= 1e-12 * max(1.0, abs(high)):
        return _SPARK[len(_SPARK) // 2] * len(values)
    top = len(_SPARK) - 1
    return "".join(_SPARK[round((v - low) / (high - low) * top)] for v in values)


def _print_report(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    mc = report["monte_carlo"]
    k = report["k"]
    k_note = "optimal" if report["k_source"] == "optimal" else "given"
    table = Table(title=f"speculative decoding, α = {report['alpha']:g}, c = {report['c']:g}")
    table.add_column("quantity")
    table.add_column("analytic", justify="right")
    table.add_column(f"Monte Carlo ({mc['rounds']} rounds)", justify="right")
    table.add_row(f"K ({k_note})", str(k), str(k))
    table.add_row(
        "tokens / round",
        f"{report['expected_tokens_per_round']:.4f}",
        f"{mc['tokens_per_round']:.4f} ± {mc['stderr']:.4f}",
    )
    table.add_row(
        f"speedup at K = {k}",
        f"{report['speedup']:.4f}×",
        f"{mc['speedup']:.4f}× ± {mc['speedup_stderr']:.4f}",
    )
    table.add_row(
        "accepted / drafted",
        f"{report['expected_acceptance_rate']:.4f}",
        f"{mc['acceptance_rate']:.4f}",
    )
    table.add_row(
        "optimal K (1..64)", f"{report['optimal_k']}  ({report['optimal_speedup']:.4f}×)", ""
    )
    console = Console()
    console.print(table)
    console.print(_curve_line(report["speedup_by_k"][:_CURVE_K]), highlight=False)
    if mc["spread_effective"] > 0:
        console.print(
            f"Monte Carlo: per-round α' ~ Beta(mean {report['alpha']:g}, "
            f"sd {mc['spread_effective']:.3g}); the analytic column assumes a fixed α.",
            highlight=False,
        )


def _curve_line(curve: list[float]) -> str:
    best = max(range(len(curve)), key=lambda i: (curve[i], -i))
    return (
        f"speedup vs K=1..{len(curve)}: {sparkline(curve)}  "
        f"({min(curve):.2f}× .. {max(curve):.2f}×, best K={best + 1} in this range)"
    )


def main() -> None:
    typer.run(simulate)


if __name__ == "__main__":
    main()
