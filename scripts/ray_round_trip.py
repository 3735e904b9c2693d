"""What one message between two Ray processes costs on this machine (docs/scale.md).

    .venv/bin/python scripts/ray_round_trip.py --calls 200 --out rtt.json

Starts a private Ray instance on 127.0.0.1 (as `understudy serve --replicas` does), then
times, interleaved round robin and reported as medians (the machine is shared):
- an actor call carrying the payload of one disaggregated-draft round, one way each:
  the target's verdict (accepted count + the token it emitted: two int32) and the draft's
  K token ids back (K int32), K = 4;
- the same call also carrying the draft's K probability rows q (K x vocab fp32: what the
  rejection sampler needs when the draft samples), vocab 151,936 (Qwen2.5's);
- one row of q only (the residual max(0, p - q) needs only the row at the first rejection);
- a call through a Ray Serve DeploymentHandle, the path every request of
  `understudy serve --replicas` takes, with the same small payload.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import numpy as np

VOCAB = 151_936
K = 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # node address 127.0.0.1
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    temp_dir = tempfile.mkdtemp(prefix="understudy-ray-")
    import ray
    from ray import serve

    ray.init(address="local", include_dashboard=False, _temp_dir=temp_dir, logging_level="ERROR")
    try:

        @ray.remote(num_cpus=0)
        class Draft:
            def round(self, verdict: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray]:
                return np.zeros(K, np.int32), np.zeros((rows, VOCAB), np.float32)

        @serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
        class Echo:
            def round(self, verdict: np.ndarray) -> np.ndarray:
                return np.zeros(K, np.int32)

        serve.start(proxy_location="Disabled")
        handle = serve.run(Echo.bind(), name="rtt", route_prefix=None)
        draft = Draft.remote()
        verdict = np.zeros(2, np.int32)
        cases = {
            "actor call, ids only": lambda: ray.get(draft.round.remote(verdict, 0)),
            f"actor call, ids + {K} q rows": lambda: ray.get(draft.round.remote(verdict, K)),
            "actor call, ids + 1 q row": lambda: ray.get(draft.round.remote(verdict, 1)),
            "serve handle call, ids only": lambda: handle.round.remote(verdict).result(),
        }
        for call in cases.values():  # warm up: workers started, code shipped
            for _ in range(5):
                call()
        times: dict[str, list[float]] = {name: [] for name in cases}
        names = list(cases)
        for i in range(args.calls):
            for name in names[i % len(names) :] + names[: i % len(names)]:
                start = time.perf_counter()
                cases[name]()
                times[name].append((time.perf_counter() - start) * 1e3)
        result = {
            "load_average": os.getloadavg(),
            "calls": args.calls,
            "bytes": {
                "verdict": 2 * 4,
                "ids": K * 4,
                "q_row": VOCAB * 4,
                f"q_{K}_rows": K * VOCAB * 4,
            },
            "median_ms": {name: statistics.median(ms) for name, ms in times.items()},
            "p10_ms": {name: float(np.percentile(ms, 10)) for name, ms in times.items()},
        }
        print(json.dumps(result, indent=2))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=2)
    finally:
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
