"""`make demo`: the same prompt decoded plainly and speculatively, side by side.

Loads the packaged default pair (fetched and converted on first use, cached after), runs
method="none" and method="draft" on one code prompt, greedy, and prints both outputs, whether
they are identical, and the measured speedup.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from understudy.config import SamplingParams
from understudy.engine.engine import Engine

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
    spec = Engine.from_pretrained(method="draft")
    plain = spec.with_method("none")
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    plain.generate(PROMPT, SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
    results = {}
    for name, engine in (("plain (method=none)", plain), ("speculative (method=draft)", spec)):
        console.rule(name)
        console.print(PROMPT, end="", style="dim", markup=False)
        out = engine.generate(
            PROMPT,
            params,
            on_token=lambda e: console.print(e.text, style=STYLE[e.origin], end="", markup=False),
        )
        console.print()
        results[name] = out
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
    base, fast = results.values()
    same = base.token_ids == fast.token_ids
    console.print(f"identical output: [bold]{'yes' if same else 'NO'}[/bold]")
    console.print(
        f"measured speedup: [bold]{fast.stats.tokens_per_s / base.stats.tokens_per_s:.2f}x[/bold]"
    )


if __name__ == "__main__":
    main()
