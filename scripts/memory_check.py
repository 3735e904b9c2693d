"""Peak resident memory of the default engine in steady state vs the bytes it must hold.

Run after the first conversion is cached:  .venv/bin/python scripts/memory_check.py
Prints one JSON object: weights and KV-cache bytes of both models, peak RSS, and the ratio.
"""

from __future__ import annotations

import json
import resource

from understudy import Engine, SamplingParams


def tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def main() -> None:
    engine = Engine.from_pretrained()
    engine.generate("def fib(n):\n", SamplingParams(max_tokens=64, temperature=0.0))
    models = [engine.target.model, engine.drafter.runner.model]
    weights = sum(tensor_bytes(m.parameters()) for m in models)
    caches = sum(tensor_bytes([*m.k_cache, *m.v_cache]) for m in models)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    print(
        json.dumps(
            {
                "dtype": str(engine.target.model.dtype),
                "weights_bytes": weights,
                "kv_cache_bytes": caches,
                "peak_rss_bytes": peak,
                "ratio": round(peak / (weights + caches), 3),
            }
        )
    )


if __name__ == "__main__":
    main()
