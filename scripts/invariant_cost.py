"""What does the invariant path cost? One decode pass of the target, three ways, interleaved:

- transformers: the same weights as a transformers CausalLM, one token per forward, its
  DynamicCache (what `generate()` runs per token);
- understudy, 1 row: our transformer scoring exactly the one token with torch's F.linear
  (NOT row-invariant);
- understudy, invariant: the default pass, padded to the hardware's row budget over the
  fixed key window (what every understudy decode pass does, plain decoding included);
  `--also-rows 3` adds other budgets (each on its own copy of the weights, packed or not as
  build_engine would do for that budget).

    python scripts/invariant_cost.py --context 200 --repeats 15 --also-rows 3

Prints a markdown table (median ms and spread). Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from understudy.bench.hf_peer import hf_model
from understudy.factory import default_verify_rows, prepare_target_kernels
from understudy.models.loader import load_model
from understudy.models.packed import PACK_FROM_ROWS, can_pack
from understudy.models.registry import DEFAULT_TARGET
from understudy.models.runner import Runner


def copy_model(model: torch.nn.Module) -> torch.nn.Module:
    import copy

    return copy.deepcopy(model)


def invariant_pass(model, rows: int, context_len: int) -> Callable[[], None]:
    """One padded `rows`-row decode pass over a fixed window (kernels as build_engine sets)."""
    prepare_target_kernels(model, rows)
    runner = Runner(model, context_len + 64, rows=rows)
    context = torch.randint(1, 1000, (context_len,), generator=torch.Generator().manual_seed(0))
    runner.prefill(context, span=context_len + 32)
    token = torch.tensor([42])

    def step() -> None:
        runner.extend(token)
        runner.truncate(context_len)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--also-rows", default="", help="other row budgets, comma-separated")
    args = parser.parse_args()
    from transformers import DynamicCache

    loaded = load_model(args.target)
    model = loaded.model
    rows = default_verify_rows(model.dtype, model.device)
    hf = hf_model(loaded)  # dense views of the weights, taken before any packing
    context = torch.randint(1, 1000, (args.context,), generator=torch.Generator().manual_seed(0))
    token = torch.tensor([42])

    one_row = Runner(model, args.context + 64, rows=None)
    one_row.prefill(context)

    def ours_one_row() -> None:
        one_row.extend(token)
        one_row.truncate(args.context)

    with torch.inference_mode():
        cache = DynamicCache(config=hf.config)
        hf(context[None], past_key_values=cache, use_cache=True)

    @torch.inference_mode()
    def transformers_step() -> None:
        hf(token[None], past_key_values=cache, use_cache=True, logits_to_keep=1)
        cache.crop(-1)

    passes: dict[str, Callable[[], None]] = {
        "transformers forward, 1 token": transformers_step,
        "understudy, 1 row (not invariant)": ours_one_row,
    }
    # The loaded weights stay dense (transformers' views share them); a budget whose kernels
    # differ (packed, models/packed.py) runs on its own copy.
    for budget in [rows, *(int(r) for r in args.also_rows.split(",") if r)]:
        packs = budget >= PACK_FROM_ROWS and can_pack(model.device, model.dtype)
        passes[f"understudy, invariant ({budget} rows, fixed window)"] = invariant_pass(
            copy_model(model) if packs else model, budget, args.context
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
