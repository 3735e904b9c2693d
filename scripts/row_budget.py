"""Which row budget is fastest here? Tokens/s of plain, draft (auto K) and ngram (auto K)
at several target row budgets, on a few shipped prompts, greedy; each method's output is
checked against plain decoding at the same budget.

    python scripts/row_budget.py --rows 3,4,6,8 --per-category 1 --max-tokens 64

Budgets >= 4 use prepacked oneDNN linears for the target (models/packed.py). Run it on a
quiet machine: it times things.
"""

from __future__ import annotations

import argparse
import gc
import time
import warnings

from understudy import Engine, SamplingParams
from understudy.bench.prompts import load_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="3,4,6,8")
    parser.add_argument("--methods", default="none,draft,ngram")
    parser.add_argument("--categories", default="completion,editing")
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    wanted = args.categories.split(",")
    prompts = [p for p in load_prompts(per_category=args.per_category) if p.category in wanted]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    print("rows | method | category | tok/s | tok/pass | identical")
    for rows in (int(r) for r in args.rows.split(",")):
        plain_out: dict[str, list[int]] = {}
        for method in args.methods.split(","):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                engine = Engine.from_pretrained(method=method, verify_rows=rows)
            engine.generate(prompts[0].prompt, SamplingParams(max_tokens=4))  # warm-up
            for p in prompts:
                t0 = time.perf_counter()
                out = engine.generate(p.prompt, params)
                dt = time.perf_counter() - t0
                if method == "none":
                    plain_out[p.id] = out.token_ids
                same = out.token_ids == plain_out.get(p.id)
                print(
                    f"{rows} | {method} | {p.category} | {len(out.token_ids) / dt:.2f} | "
                    f"{out.stats.tokens_per_pass:.2f} | {same}",
                    flush=True,
                )
            del engine
            gc.collect()


if __name__ == "__main__":
    main()
