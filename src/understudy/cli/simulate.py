"""`understudy simulate`: what speculative decoding buys for a given acceptance α and cost c.

Prints the analytic expectations of Leviathan et al. 2023 ("Fast Inference from Transformers
via Speculative Decoding", eq. 1 and Theorem 3.8), with each round charged its target pass of
K + 1 rows (T(K+1) one-row passes: flat, a slope v, or a measured pass curve), beside a Monte
Carlo estimate, and the speedup-vs-K curve. See `understudy.policy.theory`. This path must
start fast: it never imports torch, unless --measure builds an engine.

    python -m understudy.cli.simulate --alpha 0.8 --c 0.1 [--k 4] [--row-cost 0.05] [--json]
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from understudy.config import UnderstudyError
from understudy.policy.theory import PassCost, parse_pass_curve, simulate_report

ERROR_EXIT_CODE = 2
_CURVE_K = 16  # the text sparkline shows K = 1..16
_SPARK = "▁▂▃▄▅▆▇█"


def simulate(
    alpha: Annotated[
        float,
        typer.Option("--alpha", help="Expected per-token acceptance α, in [0, 1]."),
    ],
    c: Annotated[
        float | None,
        typer.Option(
            "--c",
            help="Cost of one drafter step / cost of a one-row target pass (>= 0). "
            "Required unless --measure reads it off the default engine.",
        ),
    ] = None,
    k: Annotated[
        int | None,
        typer.Option("--k", "-k", help="Tokens drafted per round, 1..64 (default: optimal K)."),
    ] = None,
    row_cost: Annotated[
        float | None,
        typer.Option(
            "--row-cost",
            help="v: what one more row adds to a target pass, in one-row passes (>= 0); "
            "a pass of n rows then costs 1 + (n - 1)·v.",
        ),
    ] = None,
    pass_curve: Annotated[
        str | None,
        typer.Option(
            "--pass-curve",
            help="A measured pass curve t(n)/t(1) for n = 1, 2, ... rows, comma-separated "
            "(e.g. 1,1.01,1.06,1.3); past its end, the line from 1 to its last point.",
        ),
    ] = None,
    measure: Annotated[
        bool,
        typer.Option(
            "--measure",
            help="Build the default engine and use the costs it measures (c, unless --c "
            "is given, and its pass curve). SLOW: loads both models (fetching and "
            "converting them on first use) and times their passes, a minute or more.",
        ),
    ] = False,
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
    """Expected tokens per round and speedup of speculative decoding (Leviathan et al. 2023),
    with each round's target pass charged for its rows. Without --row-cost, --pass-curve or
    --measure a pass costs the same whatever its rows (v = 0), and the output says so."""
    try:
        c, passes, source = cost_model(c, row_cost, pass_curve, measure)
        report = simulate_report(
            alpha, c, k, passes=passes, rounds=rounds, spread=spread, seed=seed
        )
    except UnderstudyError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(ERROR_EXIT_CODE) from None
    report["pass_cost"]["source"] = source
    if json_out:
        typer.echo(json.dumps(report))
    else:
        _print_report(report)


def cost_model(
    c: float | None, row_cost: float | None, pass_curve: str | None, measure: bool
) -> tuple[float, PassCost, str]:
    """(c, the pass cost model, where it came from) from the command's options: one of
    --row-cost, --pass-curve and --measure at most (each says all there is to say about a
    pass's rows), and c given or measured."""
    given = [name for name, on in (("--row-cost", row_cost is not None),
             ("--pass-curve", pass_curve is not None), ("--measure", measure)) if on]  # fmt: skip
    if len(given) > 1:
        raise UnderstudyError(f"give only one of {' and '.join(given)}: each sets what rows cost")
    if measure:
        measured_c, passes = measured_costs()
        return (measured_c if c is None else c), passes, "measured on the default engine"
    if c is None:
        raise UnderstudyError("--c is required (or --measure, to read it off the default engine)")
    if row_cost is not None:
        return c, PassCost(row=row_cost), "--row-cost"
    if pass_curve is not None:
        return c, PassCost.from_curve(parse_pass_curve(pass_curve)), "--pass-curve"
    return c, PassCost(), "none given: v = 0"


def measured_costs() -> tuple[float, PassCost]:
    """The default engine's measured c and pass cost (its curve and slope v; flat where its
    passes are padded to one shape, which costs the same whatever the real rows)."""
    from understudy.engine.engine import Engine  # torch: only here

    costs = Engine.from_pretrained().costs
    return costs.draft_step, PassCost(row=costs.row, curve=costs.pass_curve.ratios)


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
        f"round cost K·c + T({k + 1})", f"{report['round_cost']:.4f}", f"{mc['round_cost']:.4f}"
    )
    table.add_row(
        "accepted / drafted",
        f"{report['expected_acceptance_rate']:.4f}",
        f"{mc['acceptance_rate']:.4f}",
    )
    table.add_row(
        "optimal K (1..64)", f"{report['optimal_k']}  ({report['optimal_speedup']:.4f}×)", ""
    )
    passes = report["pass_cost"]
    if not passes["flat"]:
        table.add_row(
            "speedup if rows were free",
            f"{report['leviathan_speedup']:.4f}×",
            "",
        )
        table.add_row(
            "optimal K if rows were free",
            f"{report['leviathan_optimal_k']}  ({report['leviathan_optimal_speedup']:.4f}×)",
            "",
        )
    console = Console()
    console.print(
        f"a target pass of n rows costs T(n) one-row passes: {passes['model']} "
        f"({passes['source']})",
        highlight=False,
    )
    console.print(table)
    console.print(_curve_line(report["speedup_by_k"][:_CURVE_K]), highlight=False)
    if report["optimal_speedup"] < 1.0:
        console.print("no K pays at these costs: plain decoding is faster", highlight=False)
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
