"""Peak resident memory of an engine in steady state, against the bytes it must hold.

    python benchmarks/memory_check.py                       # the default engine
    python benchmarks/memory_check.py --method none --dtype float32

Builds the engine, generates 64 greedy tokens, then prints one JSON object: the bytes of the
target's (and the draft model's) parameters and buffers, of their KV caches, the process's
peak RSS, and peak / (weights + caches). Linux only (ru_maxrss in KiB). A ratio well above
1 means a copy of the weights is held somewhere it should not be.
"""

from __future__ import annotations

import argparse
import json
import resource
from collections.abc import Iterable

import torch

from understudy import Engine, SamplingParams
from understudy.drafters.draft_model import DraftModelProposer


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of distinct storages (tied or shared tensors counted once)."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="draft", help="none | draft")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    engine = Engine.from_pretrained(method=args.method, dtype=args.dtype)
    engine.generate("def fib(n):\n", SamplingParams(max_tokens=64, temperature=0.0))
    models = [engine.target.model]
    if isinstance(engine.drafter, DraftModelProposer):
        models.append(engine.drafter.runner.model)
    weights = tensor_bytes(t for m in models for t in [*m.parameters(), *m.buffers()])
    caches = tensor_bytes(t for m in models for t in [*m.k_cache, *m.v_cache])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    report = {
        "method": args.method,
        "dtype": str(engine.target.model.dtype),
        "weights_bytes": weights,
        "kv_cache_bytes": caches,
        "peak_rss_bytes": peak,
        "ratio": round(peak / (weights + caches), 3),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
