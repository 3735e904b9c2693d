"""What does one target decode pass cost, by how many of its rows are real, on each path?

For each dtype given, builds the default target the way `Engine.from_pretrained` would
(float32: row-invariant kernels, unpadded passes; bfloat16: padded passes of the row budget)
and times one decode pass after a 400-token context at a 480-slot key window (a typical
request), for 1, 8 and 16 real rows. On the padded path it also times the pass with each row
in its own attention call (what row-invariant attention would cost there).

    python scripts/pass_cost.py --dtypes bfloat16,float32 --repeats 12

Prints one line per setting: median ms. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from understudy import Engine
from understudy.models.runner import Runner


def median_pass_ms(runner: Runner, context: torch.Tensor, rows: int, repeats: int) -> float:
    """Median wall time of extending `context` by `rows` tokens, rolled back each time."""
    runner.prefill(context, span=480)
    times = []
    for _ in range(repeats):
        runner.truncate(context.shape[0])
        t0 = time.perf_counter()
        runner.extend(torch.arange(5, 5 + rows))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--repeats", type=int, default=12)
    args = parser.parse_args()
    context = torch.arange(1000, 1400)  # [400]
    for name in args.dtypes.split(","):
        engine = Engine.from_pretrained(method="none", dtype=getattr(torch, name))
        runner, layers = engine.runner, engine.target.model.layers
        modes = [0, runner.rows] if runner.pad else [layers[0].attn.rows_apart_upto]
        for apart in modes:
            for layer in layers:
                layer.attn.rows_apart_upto = apart
            timings = {n: median_pass_ms(runner, context, n, args.repeats) for n in (1, 8, 16)}
            shown = ", ".join(f"{n} real rows {ms:.1f} ms" for n, ms in timings.items())
            attention = "per-row attention" if apart else "batched attention"
            print(f"{name}, {'padded' if runner.pad else 'unpadded'}, {attention}: {shown}")


if __name__ == "__main__":
    main()
