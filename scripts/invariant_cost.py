"""What does the invariant path cost? One decode pass of the target, interleaved:

- transformers: the same weights as a transformers CausalLM, one token per forward, its
  DynamicCache (what `generate()` runs per token);
- understudy, torch kernels, 1 row: our transformer with F.linear (NOT row-invariant);
- understudy, row-invariant (the float32 CPU default, kernels/rowgemm.py): 1 row (what plain
  decoding runs) and `--rows` rows (what verifying K = rows - 1 guesses runs), unpadded;
- `--padded 6` adds the padded path (every pass `6` rows, oneDNN-packed linears), the
  default before rowgemm and still the fallback (needs memory for one more weight copy).

    python scripts/invariant_cost.py --context 200 --repeats 15 --rows 6,16

Prints a markdown table (median ms and spread). Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable

import torch

from understudy.bench.hf_peer import hf_model
from understudy.engine.builder import install_row_invariant_kernels, prepare_target_kernels
from understudy.models.loader import load_model
from understudy.models.registry import DEFAULT_TARGET
from understudy.models.runner import Runner


def decode_pass(runner: Runner, context: torch.Tensor, rows: int) -> Callable[[], None]:
    """One pass scoring `rows` tokens after `context` (then rolled back)."""
    runner.prefill(context, span=context.shape[0] + 32)
    tokens = torch.arange(42, 42 + rows)

    def step() -> None:
        runner.extend(tokens)
        runner.truncate(context.shape[0])

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--rows", default="6,16", help="row counts of verification passes")
    parser.add_argument("--padded", type=int, default=0, help="also time the padded path")
    args = parser.parse_args()
    from transformers import DynamicCache

    loaded = load_model(args.target)
    model = loaded.model
    hf = hf_model(loaded)  # dense views of the weights, taken before any swap
    context = torch.randint(1, 1000, (args.context,), generator=torch.Generator().manual_seed(0))
    token = torch.tensor([42])
    span = args.context + 64

    with torch.inference_mode():
        cache = DynamicCache(config=hf.config)
        hf(context[None], past_key_values=cache, use_cache=True)

    @torch.inference_mode()
    def transformers_step() -> None:
        hf(token[None], past_key_values=cache, use_cache=True, logits_to_keep=1)
        cache.crop(-1)

    passes: dict[str, Callable[[], None]] = {
        "transformers forward, 1 token": transformers_step,
        "understudy, torch kernels, 1 row (not invariant)": decode_pass(
            Runner(model, span, rows=None), context, 1
        ),
    }
    rows = [int(r) for r in args.rows.split(",") if r]
    invariant = copy.deepcopy(model)  # the swap re-lays the weights: its own copy
    install_row_invariant_kernels(invariant, max(rows))
    for n in [1, *rows]:
        runner = Runner(invariant, span, rows=max(rows), pad=False)
        what = "plain decoding" if n == 1 else f"verifying K={n - 1}"
        passes[f"understudy, row-invariant, {n} row(s) ({what})"] = decode_pass(runner, context, n)
    if args.padded:
        padded = copy.deepcopy(model)
        prepare_target_kernels(padded, args.padded)
        runner = Runner(padded, span, rows=args.padded)
        passes[f"understudy, padded to {args.padded} rows (any K < {args.padded})"] = decode_pass(
            runner, context, 1
        )
    times: dict[str, list[float]] = {name: [] for name in passes}
    for fn in passes.values():
        fn()  # warm-up
    for _ in range(args.repeats):
        for name, fn in passes.items():  # interleaved: drift hits every variant alike
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    ref = statistics.median(times["transformers forward, 1 token"])
    print(f"target {args.target}, {model.dtype}, context {args.context}, {args.repeats} repeats\n")
    print("| pass | median ms | min-max ms | vs transformers |")
    print("|---|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med:.1f} | {min(ts):.0f}-{max(ts):.0f} | {med / ref:.2f}x |")


if __name__ == "__main__":
    main()
