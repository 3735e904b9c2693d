"""Batched decoding through the Python API, side by side in one run: the same prompts served
one at a time and together, plain (method none) and speculative (the default method).

    python benchmarks/batch_engine.py --seqs 1,2,4,8 --max-tokens 64 --out docs/bench/batch-engine

For each batch size n: the first n prompts, each run alone (one after another) and then as one
batch of n (`engine.generate([...])`); aggregate tokens/s of both, their ratio, and whether
every batched answer equals its solo answer token for token (greedy). Prints a Markdown
table and writes results.json beside it. It times things: run it alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from understudy import Engine, SamplingParams
from understudy.bench.config import environment
from understudy.bench.prompts import load_prompts
from understudy.engine.seats import kv_bytes_per_seat


def timed(run) -> tuple[list, float]:
    t0 = time.perf_counter()
    out = run()
    return out, time.perf_counter() - t0


def measure(engine: Engine, prompts: list, params: SamplingParams, n: int) -> dict:
    chosen = prompts[:n]
    solo, solo_s = timed(lambda: [engine.generate(p, params) for p in chosen])
    together, batch_s = timed(lambda: engine.generate(chosen, params))
    tokens = sum(len(o.token_ids) for o in together)
    return {
        "seqs": n,
        "tokens": tokens,
        "solo_tok_s": sum(len(o.token_ids) for o in solo) / solo_s,
        "batch_tok_s": tokens / batch_s,
        "identical": all(a.token_ids == b.token_ids for a, b in zip(solo, together, strict=True)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", default="1,2,4,8")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--methods", default="none,draft")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    sizes = [int(x) for x in args.seqs.split(",")]
    prompts = [p.prompt for p in load_prompts(["completion", "chat"])]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    rows = []
    for method in args.methods.split(","):
        engine = Engine.from_pretrained(method=method, max_num_seqs=max(sizes), max_context=1024)
        for n in sizes:
            row = {"method": method, **measure(engine, prompts, params, n)}
            row["kv_bytes_per_seq"] = kv_bytes_per_seat(engine.scheduler.seats)
            rows.append(row)
            print(json.dumps(row), flush=True)
    lines = [
        "| method | sequences | one at a time tok/s | together tok/s | ratio | identical |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = r["batch_tok_s"] / r["solo_tok_s"]
        lines.append(
            f"| {r['method']} | {r['seqs']} | {r['solo_tok_s']:.2f} | {r['batch_tok_s']:.2f} "
            f"| {ratio:.2f}x | {r['identical']} |"
        )
    print("\n".join(lines))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        payload = {"rows": rows, "environment": environment(engine.target), "argv": vars(args)}
        (args.out / "results.json").write_text(json.dumps(payload, indent=2, default=str))
        (args.out / "results.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
