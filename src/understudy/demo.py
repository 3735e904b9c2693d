"""`make demo`: the same prompt decoded plainly and speculatively, side by side.

Loads the packaged default target (fetched and converted on first use, cached after) and
runs method="none", the default (method="auto": for this target the head the package ships,
method="eagle") and method="draft" (the 0.5B draft model) on one code prompt, greedy, and
prints the outputs, whether each speculative one is
identical to plain decoding's, its measured speedup, and beside it the speedup the theory
predicts for this machine (policy/theory.py): that engine's measured costs, the run's
acceptance and K, its rounds of free guesses (method eagle's free_drafts) apart.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from understudy.config import SamplingParams
from understudy.engine.engine import Engine
from understudy.engine.outputs import RoundEvent
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
    rounds: dict[str, list[RoundEvent]] = {}  # per run: every round, as the Lab sees it
    runs = {
        "plain (method=none)": plain,
        f"the default (method=auto: {default.method})": default,
        "speculative (method=draft)": spec,
    }
    for name, engine in runs.items():
        console.rule(name)
        console.print(PROMPT, end="", style="dim", markup=False)
        seen = rounds[name] = []
        stream = engine.stream(PROMPT, params, on_round=seen.append)
        for event in stream:
            console.print(event.text, style=STYLE[event.origin], end="", markup=False)
        assert stream.output is not None  # set once the stream is exhausted
        results[name] = stream.output
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
        console.print(machine_bound(engine.costs, rounds[name], measured))


@dataclass(frozen=True)
class RoundKind:
    """A run's rounds of one kind that guessed: how many, their mean K and acceptance, and
    what the theory makes of them at this machine's costs (c: 0 for free guesses)."""

    rounds: int
    k: int
    acceptance: float
    tokens: float  # E over these rounds
    cost: float  # K·c + T(K+1) over these rounds
    cost_flat: float  # the same with rows free

    @staticmethod
    def of(rounds: list[RoundEvent], c: float, passes: PassCost) -> RoundKind:
        drafted = sum(len(r.drafted) for r in rounds)
        k = max(1, round(drafted / len(rounds)))
        rate = sum(r.accepted for r in rounds) / drafted
        e = expected_tokens_per_round(alpha_from_acceptance_rate(rate, k), k)
        n = len(rounds)
        return RoundKind(n, k, rate, n * e, n * round_cost(k, c, passes), n * round_cost(k, c))


def machine_bound(costs: Costs, rounds: list[RoundEvent], measured: float) -> str:
    """The theory at this machine's costs (c and the pass curve, measured when the engine was
    built) and the run's own acceptance and K, beside the measured speedup and Leviathan et
    al.'s flat-pass figure, which leaves the rows' cost out. A round the drafter drafted
    yields E and costs K·c + T(K+1); a round of free guesses (read off the text:
    RoundEvent.free) yields E at its own acceptance and K and costs T(K+1); each other round
    (the engine's automatic K judged a guess not worth it there) 1 token for 1 pass."""
    passes = PassCost(row=costs.row, curve=costs.pass_curve.ratios)
    drafted = [r for r in rounds if r.drafted and not r.free]
    free = [r for r in rounds if r.drafted and r.free]
    plain = len(rounds) - len(drafted) - len(free)
    kinds = [RoundKind.of(drafted, costs.draft_step, passes)] if drafted else []
    kinds += [RoundKind.of(free, 0.0, passes)] if free else []
    if not kinds:
        return "the theory: the engine drafted nothing in this run (speculation did not pay)"
    tokens = plain + sum(kind.tokens for kind in kinds)
    predicted = tokens / (plain + sum(kind.cost for kind in kinds))
    flat = tokens / (plain + sum(kind.cost_flat for kind in kinds))
    first = kinds[0]
    how = "its measured pass curve" if costs.pass_curve else "padded passes: rows are free"
    parts = [] if not drafted else [f"the {first.rounds} of {len(rounds)} rounds that drafted"]
    if free:
        kind = kinds[-1]
        parts.append(
            f"{kind.rounds} round{'s' if kind.rounds > 1 else ''} of free guesses (c = 0) at "
            f"{kind.acceptance:.0%}, K = {kind.k}"
        )
    if plain:
        parts.append(f"1 token a pass in the other {plain}")
    return (
        f"this machine: a draft step costs c = {costs.draft_step:.2f} one-row target passes, "
        f"a pass of {first.k + 1} rows {passes.rows(first.k + 1):.2f} ({how})\n"
        f"the theory at the run's acceptance {first.acceptance:.0%} and K = {first.k} "
        f"(the mean of {', '.join(parts)}): "
        f"E / (K·c + T(K+1)) = [bold]{predicted:.2f}x[/bold] predicted, {measured:.2f}x "
        f"measured ({flat:.2f}x if rows were free)"
    )


if __name__ == "__main__":
    main()
