"""Where a short request's time goes: the same prompts through the Python API and through a
real `understudy serve`, alternated request by request, side by side in one run.

    python benchmarks/server_overhead.py --prompts completion --count 8 --max-tokens 96 \
        --method auto --max-num-seqs 1 --out docs/bench/server-overhead

For each prompt: the API's `engine.generate` in this process (its main thread, the engine
built here), then one streamed /v1/completions request to the server (a child process, the
same method and models, its engine on the worker thread), each timed whole. Reported per
side: tokens a second over the request (prefill included), the server's time to first token,
and the voluntary context switches a token of the process that generated (this one's
getrusage; the server's summed over its threads from /proc), the count that shows worker
threads sleeping between kernel calls (kernels/openmp.py). The two engines are never busy at
once. Greedy, EOS ignored; every server answer is checked against the API's text. It times
things: run it alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

import httpx

from understudy import Engine, SamplingParams
from understudy.bench.config import environment
from understudy.bench.prompts import load_prompts
from understudy.bench.server_process import ServerUnderTest
from understudy.bench.serving import send


def thread_switches(pid: int) -> int:
    """Voluntary context switches of process `pid`, summed over its threads (Linux /proc)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                total += int(line.split()[1])
    return total


def own_switches() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", default="completion", help="a shipped set or a .jsonl")
    parser.add_argument("--count", type=int, default=8, help="prompts (the set's first N)")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--method", default="auto", help="the engine's method, both sides")
    parser.add_argument("--max-num-seqs", default="1", help="the server's seats (1 or auto)")
    parser.add_argument("--out", type=Path, default=Path("server-overhead"))
    args = parser.parse_args()
    prompts = [p for p in load_prompts([args.prompts], args.count) if not p.is_chat]
    if not prompts:
        parser.error(f"--prompts {args.prompts}: no completion prompts (chat ones are skipped)")
    args.out.mkdir(parents=True, exist_ok=True)

    engine = Engine.from_pretrained(method=args.method)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    engine.generate(prompts[0].prompt, params)  # warm-up (this thread's OpenMP team)
    server = ServerUnderTest(
        ["--method", args.method, "--max-num-seqs", args.max_num_seqs], args.out / "server.log"
    )
    rows = []
    try:
        client = httpx.Client(timeout=600)
        model = client.get(server.url + "/v1/models").json()["data"][0]["id"]
        url = server.url + "/v1/completions"
        body = {"model": model, "max_tokens": args.max_tokens, "temperature": 0.0,
                "ignore_eos": True, "stream": True}  # fmt: skip
        send(client, url, {**body, "prompt": prompts[0].prompt})  # warm-up
        for prompt in prompts:
            switches, t0 = own_switches(), time.perf_counter()
            out = engine.generate(prompt.prompt, params)
            api_s, api_switches = time.perf_counter() - t0, own_switches() - switches
            switches = thread_switches(server.proc.pid)
            reply = send(client, url, {**body, "prompt": prompt.prompt})
            server_switches = thread_switches(server.proc.pid) - switches
            tokens = len(out.token_ids)
            rows.append({
                "id": prompt.id, "tokens": tokens, "identical": reply.text == out.text,
                "api_tok_s": tokens / api_s, "server_tok_s": tokens / reply.latency_s,
                "server_over_api": api_s / reply.latency_s, "server_ttft_s": reply.ttft_s or 0.0,
                "api_switches_per_token": api_switches / tokens,
                "server_switches_per_token": server_switches / tokens,
            })  # fmt: skip
            print(f"{prompt.id}: API {rows[-1]['api_tok_s']:.2f}, server "
                  f"{rows[-1]['server_tok_s']:.2f} tok/s", flush=True)  # fmt: skip
    finally:
        server.stop()

    def median(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    summary = {key: median(key) for key in rows[0] if key not in ("id", "tokens", "identical")}
    result = {
        "command": vars(args) | {"out": args.out.name},
        "environment": environment(engine.target),
        "method": str(engine.method),
        "identical": sum(r["identical"] for r in rows),
        "summary": summary,
        "rows": rows,
    }
    (args.out / "results.json").write_text(json.dumps(result, indent=2, default=str))
    command = " ".join(["python benchmarks/server_overhead.py", *sys.argv[1:]])
    table = [
        f"{time.strftime('%Y-%m-%d %H:%M')}: `{command}`",
        "",
        f"method {engine.method}, server seats {args.max_num_seqs}, {len(rows)} prompts of "
        f"{args.prompts}, {args.max_tokens} tokens, greedy; medians over requests",
        "",
        "| side | tok/s (request) | server / API | TTFT s | context switches a token |",
        "|---|---|---|---|---|",
        f"| API (this process) | {summary['api_tok_s']:.2f} | 1.00x | - | "
        f"{summary['api_switches_per_token']:.1f} |",
        f"| server (HTTP, streamed) | {summary['server_tok_s']:.2f} | "
        f"{summary['server_over_api']:.3f}x | {summary['server_ttft_s']:.3f} | "
        f"{summary['server_switches_per_token']:.1f} |",
        "",
        f"server answers identical to the API's: {result['identical']}/{len(rows)}",
    ]
    (args.out / "results.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()
