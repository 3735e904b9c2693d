"""`understudy bench`: methods side by side on the same prompts, with the peers and plots.

    from understudy.bench import BenchConfig, run_bench
    bench = run_bench(BenchConfig(methods="none,draft", compare="hf"))
    bench.results["summary"]["draft"]["completion"]["speedup"]["median"]

Importing this package is light (no torch); the run imports what it needs.
"""

from typing import TYPE_CHECKING, Any

__all__ = ["Bench", "BenchConfig", "run_bench", "load_prompts", "SHIPPED_SETS"]

if TYPE_CHECKING:
    from understudy.bench.prompts import SHIPPED_SETS, load_prompts
    from understudy.bench.run import Bench, BenchConfig, run_bench


def __getattr__(name: str) -> Any:
    if name in ("SHIPPED_SETS", "load_prompts"):
        from understudy.bench import prompts

        return getattr(prompts, name)
    if name in ("Bench", "BenchConfig", "run_bench"):
        from understudy.bench import run

        return getattr(run, name)
    raise AttributeError(f"module 'understudy.bench' has no attribute {name!r}")
