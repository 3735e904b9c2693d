"""The serving benchmark: the real HTTP server under many concurrent clients.

    understudy bench --concurrency 1,2,4,8,16 [--methods none,draft] [--requests 16]

For each method, one `understudy serve` child process on a free loopback port, with
--max-num-seqs the largest concurrency asked for. For each concurrency c, the same R requests
(R = --requests, default the largest c: the benchmark's prompts in order, repeated if too
few) are sent by c client threads, each streaming its answer (httpx, server-sent events) and
taking the next request when it has one. EOS is ignored, so every request generates
max_tokens tokens and the levels do the same work. Measured per (method, c):

- aggregate tokens/s: the completion tokens of all R requests / the wall time from the first
  request sent to the last answer;
- each request's latency (sent -> last chunk) and time to first token, p50 and p95;
- identical: every answer equals the same request's answer from the first method at
  concurrency 1 (greedy only: sampled answers of different methods differ by design).

Methods, then peers (--compare vllm: vllm_peer.py), run one after another, level by level, on
one machine: the ratios within one run are the result (a shared machine moves the figures).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from understudy.bench import vllm_peer
from understudy.bench.config import loadavg, write_json
from understudy.bench.prompts import BenchPrompt, load_prompts
from understudy.bench.server_process import ServerUnderTest
from understudy.config import DType, UnderstudyError

SCHEMA = "understudy-serving-bench/1"
REQUEST_TIMEOUT_S = 1800.0


@dataclass
class ServingConfig:
    concurrency: list[int]
    methods: list[str]
    requests: int
    max_tokens: int = 96
    temperature: float = 0.0
    seed: int = 0
    k: str = "auto"
    prompts: list[str] | None = None
    per_category: int = 0
    target: str | None = None
    draft: str | None = None
    dtype: DType = "auto"
    max_context: int = 4096
    out: Path = Path("bench-results")
    compare: list[str] = field(default_factory=list)  # the vLLM peer's labels (vllm_peer.py)

    def __post_init__(self) -> None:
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise UnderstudyError(f"--concurrency needs integers >= 1, got {self.concurrency}")
        if self.requests < 1:
            raise UnderstudyError(f"--requests must be >= 1, got {self.requests}")
        if not self.methods:
            raise UnderstudyError("--methods is empty")
        from understudy.engine.builder import METHODS

        for method in self.methods:
            if method not in METHODS:
                raise UnderstudyError(
                    f"serving mode takes method names ({', '.join(METHODS)}), got {method!r}"
                )
        self.compare = vllm_peer.vllm_labels(self.compare)


@dataclass
class Reply:
    text: str
    tokens: int
    latency_s: float
    ttft_s: float | None


def parse_concurrency(text: str) -> list[int]:
    """ "1,2,4,8" -> [1, 2, 4, 8] (sorted, unique), or UnderstudyError naming what is wrong."""
    try:
        levels = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise UnderstudyError(f"--concurrency takes integers like 1,2,4,8, got {text!r}") from None
    if not levels or levels[0] < 1:
        raise UnderstudyError(f"--concurrency takes integers >= 1, got {text!r}")
    return levels


def request_body(prompt: BenchPrompt, model: str, config: ServingConfig) -> tuple[str, dict]:
    """The route and JSON body of one benchmark request (streamed, with a usage chunk)."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": config.max_tokens,
        "temperature": config.temperature,
        "seed": config.seed,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if prompt.is_chat:
        return "/v1/chat/completions", {**body, "messages": prompt.prompt}
    return "/v1/completions", {**body, "prompt": prompt.prompt}


def send(client: httpx.Client, url: str, body: dict) -> Reply:
    """One streamed request: its text, completion tokens, latency and time to first token."""
    t0 = time.perf_counter()
    ttft, pieces, tokens = None, [], 0
    with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            raise UnderstudyError(f"{url}: HTTP {response.status_code}: {response.read()[:300]!r}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise UnderstudyError(f"{url}: {chunk['error'].get('message')}")
            for choice in chunk.get("choices") or []:
                piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                if piece and ttft is None:
                    ttft = time.perf_counter() - t0
                pieces.append(piece)
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return Reply("".join(pieces), tokens, time.perf_counter() - t0, ttft)


def percentile(values: list[float], q: float) -> float | None:
    """The q-quantile (0..1) by linear interpolation; None for no values."""
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def run_level(server: ServerUnderTest, bodies: list[tuple[str, dict]], clients: int) -> dict:
    """Send every body with `clients` concurrent clients; the level's measurements."""
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    with httpx.Client(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            replies = list(pool.map(lambda rb: send(client, server.url + rb[0], rb[1]), bodies))
        wall = time.perf_counter() - t0
    tokens = sum(r.tokens for r in replies)
    latencies = [r.latency_s for r in replies]
    ttfts = [r.ttft_s for r in replies if r.ttft_s is not None]
    return {
        "concurrency": clients,
        "requests": len(bodies),
        "tokens": tokens,
        "wall_s": wall,
        "tok_s": tokens / wall,
        "latency_p50_s": percentile(latencies, 0.5),
        "latency_p95_s": percentile(latencies, 0.95),
        "ttft_p50_s": percentile(ttfts, 0.5),
        "ttft_p95_s": percentile(ttfts, 0.95),
        "loadavg": loadavg(),
        "texts": [r.text for r in replies],
    }


def server_args(config: ServingConfig, method: str) -> list[str]:
    args = ["--method", method, "-k", config.k, "--dtype", config.dtype,
            "--max-context", str(config.max_context),
            "--max-num-seqs", str(max(config.concurrency)),
            "--max-queue", str(config.requests), "--log-level", "warning"]  # fmt: skip
    for flag, value in (("--target", config.target), ("--draft", config.draft)):
        if value is not None:
            args += [flag, value]
    return args


def run_serving(config: ServingConfig, say: Callable[[str], None]) -> dict[str, Any]:
    """Every method, then every peer, at every concurrency; writes OUT/serving.json after
    each level."""
    config.out.mkdir(parents=True, exist_ok=True)
    prompts = load_prompts(config.prompts, config.per_category)
    chosen = [prompts[i % len(prompts)] for i in range(config.requests)]
    results: dict[str, Any] = {
        "schema": SCHEMA,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(config).items()},
        "prompts": [p.id for p in chosen],
        "levels": [],
    }
    starters = [(m, lambda m=m: ServerUnderTest(server_args(config, m),
                                                config.out / f"server-{m}.log"))
                for m in config.methods]  # fmt: skip
    if config.compare:
        say("finding vLLM and its weights ...")
        setup = vllm_peer.prepare(config.compare, config.target, config.draft)
        starters += [(p, lambda p=p: start_peer(setup, p, config)) for p in config.compare]
    references: dict[str, list[str]] = {}
    for label, launch in starters:
        say(f"starting the server: {label} ...")
        server = launch()
        try:
            results.setdefault("servers", {})[label] = server.health
            measure(server, label, chosen, config, results, references, say)
        except UnderstudyError as error:
            raise UnderstudyError(f"{label}: {error} (its log: {server.log_path})") from None
        finally:
            server.stop()
    return results


def start_peer(setup: vllm_peer.VllmSetup, label: str, config: ServingConfig) -> ServerUnderTest:
    """The vLLM peer's server for `label`, sized as ours (seats for the largest concurrency)."""
    log_path = config.out / f"server-{label}.log"
    return vllm_peer.start(setup, label, log_path, max_num_seqs=max(config.concurrency),
                           max_context=config.max_context, seed=config.seed)  # fmt: skip


def measure(server: ServerUnderTest, label: str, chosen: list[BenchPrompt],
            config: ServingConfig, results: dict[str, Any], references: dict[str, list[str]],
            say: Callable[[str], None]) -> None:  # fmt: skip
    """Every concurrency level of one server. `identical`: the answers equal the first
    server's at its first level (ours, first method); `identical_same_engine`: they equal
    the first server of the same engine's (ours, or vLLM's) at its first level. Greedy only."""
    engine = server.health.get("engine", "understudy")
    bodies = [request_body(p, server.health["model"], config) for p in chosen]
    warm = {**bodies[0][1], "max_tokens": 4}
    with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
        send(client, server.url + bodies[0][0], warm)
    greedy = config.temperature == 0
    for clients in config.concurrency:
        say(f"  {label}: {len(bodies)} requests, {clients} at once ...")
        level = run_level(server, bodies, clients)
        texts = level.pop("texts")
        first = references.setdefault("first", texts)
        same = references.setdefault(engine, texts)
        level["identical"] = texts == first if greedy else None
        level["identical_same_engine"] = texts == same if greedy else None
        level["method"] = label
        results["levels"].append(level)
        write_json(config.out / "serving.json", results)
        say(f"    {level['tok_s']:.2f} tok/s, identical: {level['identical']}")
