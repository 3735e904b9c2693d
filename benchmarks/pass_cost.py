"""What one target decode pass costs, by how many rows it scores, against transformers.

Rows of the table, timed interleaved (repeat by repeat, so drift of a shared machine falls
on every variant alike), median of `--repeats`:

- transformers forward, 1 token: the same weights as a transformers CausalLM with its
  DynamicCache (what `generate()` runs per token): the reference;
- understudy, torch kernels, 1 row: our transformer with torch's own matmuls, NOT
  row-invariant (what identity would cost nothing over);
- understudy, the engine's target pass, N rows for each N of `--rows`: the target exactly as
  `Engine.from_pretrained(method="none", dtype=...)` builds it. In float32 on a CPU that is
  the row-invariant, unpadded path (plain decoding scores 1 row, verifying K guesses K + 1);
  elsewhere (bfloat16, CUDA) every pass is padded to the row budget, so N only says how many
  of its rows are real.

    python benchmarks/pass_cost.py --context 200 --repeats 15 --rows 1,6,16
    python benchmarks/pass_cost.py --dtype bfloat16 --context 400 --repeats 12 --rows 1,8,16

Prints a Markdown table. It times things: run it alone on the machine. It holds two copies of
the target's weights (the reference's and the engine's).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from transformers import DynamicCache

from understudy import Engine
from understudy.bench.hf_peer import hf_model
from understudy.models.loader import load_model
from understudy.models.registry import DEFAULT_TARGET
from understudy.models.runner import Runner

REFERENCE = "transformers forward, 1 token"


def decode_pass(runner: Runner, context: torch.Tensor, rows: int) -> Callable[[], None]:
    """One pass scoring `rows` tokens after `context` [n], then rolled back."""
    runner.prefill(context, span=context.shape[0] + 32)
    tokens = torch.arange(42, 42 + rows)  # [rows]

    def step() -> None:
        runner.extend(tokens)
        runner.truncate(context.shape[0])

    return step


def transformers_pass(target: str, dtype: str, context: torch.Tensor) -> Callable[[], None]:
    """transformers' one-token decode step after `context`, on a dense copy of the weights."""
    hf = hf_model(load_model(target, dtype, quantization="none"))
    token = torch.tensor([[42]])  # [1, 1]
    with torch.inference_mode():
        cache = DynamicCache(config=hf.config)
        hf(context[None], past_key_values=cache, use_cache=True)

    @torch.inference_mode()
    def step() -> None:
        hf(token, past_key_values=cache, use_cache=True, logits_to_keep=1)
        cache.crop(-1)

    return step


def time_passes(passes: dict[str, Callable[[], None]], repeats: int) -> dict[str, list[float]]:
    """Wall times in ms of every pass, interleaved, after one warm-up call each."""
    times: dict[str, list[float]] = {name: [] for name in passes}
    for fn in passes.values():
        fn()
    for _ in range(repeats):
        for name, fn in passes.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    parser.add_argument("--context", type=int, default=200, help="tokens before the pass")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--rows", default="1,6,16", help="rows of the engine's passes")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",") if r]
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(1, 1000, (args.context,), generator=generator)  # [context]
    span = args.context + 64

    dense = load_model(args.target, args.dtype, quantization="none").model
    passes = {
        REFERENCE: transformers_pass(args.target, args.dtype, context),
        "understudy, torch kernels, 1 row (not row-invariant)": decode_pass(
            Runner(dense, span, rows=None), context, 1
        ),
    }
    engine = Engine.from_pretrained(
        target=args.target, method="none", dtype=args.dtype, quantization="none"
    )
    runner = engine.runner
    path = f"padded to {runner.rows} rows" if runner.pad else "row-invariant, unpadded"
    for n in rows:
        what = "plain decoding" if n == 1 else f"verifying K = {n - 1}"
        passes[f"understudy, {path}, {n} real row(s) ({what})"] = decode_pass(runner, context, n)

    times = time_passes(passes, args.repeats)
    ref = statistics.median(times[REFERENCE])
    print(f"target {args.target}, {args.dtype}, context {args.context}, {args.repeats} repeats\n")
    print("| pass | median ms | min-max ms | vs transformers |")
    print("|---|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med:.1f} | {min(ts):.0f}-{max(ts):.0f} | {med / ref:.2f}x |")


if __name__ == "__main__":
    main()
