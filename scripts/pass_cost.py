"""What does one target decode pass cost, by how many of its rows are real, on each path?

For each dtype given, builds the default target the way `Engine.from_pretrained` would
(float32: row-invariant kernels, unpadded passes; bfloat16: padded passes of the row budget)
and times one decode pass after a 400-token context at a 480-slot key window (a typical
request), for 1, 8 and 16 real rows. On the padded path it times the pass both as decode
passes run (split_attention, exact for trees) and with one SDPA call over the shared slots
(what it cost before).

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


def median_pass_ms(
    runner: Runner, context: torch.Tensor, rows: int, repeats: int, modes: tuple[bool, ...]
) -> dict[bool, float]:
    """Median wall time of extending `context` by `rows` tokens, rolled back each time, for
    each mode (split True: as decode passes run; False: a padded pass with one SDPA call
    instead of split_attention), the modes interleaved repeat by repeat."""
    runner.prefill(context, span=480)
    times: dict[bool, list[float]] = {mode: [] for mode in modes}
    for _ in range(repeats):
        for split in modes:
            runner.truncate(context.shape[0])
            t0 = time.perf_counter()
            if split:
                runner.extend(torch.arange(5, 5 + rows))
            else:
                with torch.inference_mode():
                    runner._pass(torch.arange(5, 5 + rows), runner.rows, slice(None))
            times[split].append(time.perf_counter() - t0)
    return {mode: statistics.median(ts) * 1000 for mode, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--repeats", type=int, default=12)
    args = parser.parse_args()
    context = torch.arange(1000, 1400)  # [400]
    for name in args.dtypes.split(","):
        engine = Engine.from_pretrained(method="none", dtype=getattr(torch, name))
        runner = engine.runner
        modes = (True, False) if runner.pad else (True,)
        median_pass_ms(runner, context, 16, 1, modes)  # warm-up
        timings = {n: median_pass_ms(runner, context, n, args.repeats, modes) for n in (1, 8, 16)}
        for split in modes:
            shown = ", ".join(f"{n} real rows {ms[split]:.1f} ms" for n, ms in timings.items())
            attention = "split_attention" if split else "one SDPA call"
            print(f"{name}, {'padded' if runner.pad else 'unpadded'}, {attention}: {shown}")


if __name__ == "__main__":
    main()
