"""The soak run: one real server under many clients for a long time, and what must hold.

    understudy bench --soak [--clients 32] [--duration 10m] [--methods M] [--seed S]

One `understudy serve` child process on a free loopback port (the engine's
`--max-num-seqs auto` seats, the method given or the server's default). The run:

1. solo: each greedy scenario (soak_mix.py) is sent once, alone, with nothing else in
   flight; its answer is the reference every later answer to it must equal;
2. soak: `clients` threads send requests drawn from the seeded mix (soak_mix.py) until
   `duration` has passed, each waiting for its answer before it sends the next; a request in
   flight at the deadline finishes. The server's resident memory is read at the start, after
   the warm-up (the first WARMUP_SHARE of the duration) and at the end, and sampled with
   /health every MONITOR_S;
3. drain: once the clients stopped, /health must show nothing running or waiting; then one
   streamed request per seat is sent at once, and every one must start before any ends (a
   leaked seat would leave one waiting); they are closed, and nothing may stay running.

Then the server is stopped with SIGTERM. OUT/soak.json holds the record and the verdicts
(soak_checks.py); the command exits 1 when an invariant fails.
"""

from __future__ import annotations

import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil

from understudy.bench.config import loadavg, write_json
from understudy.bench.prompts import DEFAULT_PER_CATEGORY, BenchPrompt, load_prompts
from understudy.bench.server_process import ServerUnderTest
from understudy.bench.serving import percentile
from understudy.bench.soak_checks import Tally, judge
from understudy.bench.soak_client import send_bad, send_call
from understudy.bench.soak_mix import MAX_N, BadCall, Call, Plan, bad_calls, draw, scenarios
from understudy.config import DType, UnderstudyError

SCHEMA = "understudy-soak/1"
WARMUP_SHARE = 0.2  # of the duration: memory is compared from its end on
MONITOR_S = 2.0
PROGRESS_S = 30.0
REQUEST_TIMEOUT_S = 1800.0
IDLE_TIMEOUT_S = 60.0  # for running and waiting to reach 0 once the clients stop
SEATS_TIMEOUT_S = 300.0  # for one sequence per seat to start
MAX_BODY_BYTES = 1 << 20  # the server's limit, given to it (a bad call sends one byte more)
# The server keeps an idle connection longer than the clients' pools do (httpx: 5 s), so a
# client never sends on a connection the server is closing at that moment.
SERVER_KEEP_ALIVE_S = 30


@dataclass
class SoakConfig:
    clients: int = 32
    duration_s: float = 600.0
    method: str | None = None  # None: the server's default
    k: str = "auto"
    max_tokens: int = 96
    seed: int = 0
    prompts: list[str] | None = None
    per_category: int = DEFAULT_PER_CATEGORY
    target: str | None = None
    draft: str | None = None
    dtype: DType = "auto"
    max_context: int = 4096
    out: Path = Path("bench-results")

    def __post_init__(self) -> None:
        if self.clients < 1:
            raise UnderstudyError(f"--clients must be >= 1, got {self.clients}")
        if self.duration_s <= 0:
            raise UnderstudyError(f"--duration must be > 0, got {self.duration_s:g} s")
        if self.max_tokens < 1:
            raise UnderstudyError(f"--max-tokens must be >= 1, got {self.max_tokens}")
        from understudy.engine.builder import METHODS

        if self.method is not None and self.method not in METHODS:
            raise UnderstudyError(
                f"the soak run takes one method ({', '.join(METHODS)}), got {self.method!r}"
            )


def parse_duration(text: str) -> float:
    """ "600", "90s", "10m", "1h" -> seconds, or UnderstudyError naming what is wrong."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text)
    if match is None:
        raise UnderstudyError(f"--duration takes seconds or a time like 90s, 10m, 1h, got {text!r}")
    return float(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[match.group(2)]


def server_args(config: SoakConfig) -> list[str]:
    args = ["--max-num-seqs", "auto", "--max-queue", str(config.clients * MAX_N),
            "-k", config.k, "--dtype", config.dtype, "--max-context", str(config.max_context),
            "--max-body-bytes", str(MAX_BODY_BYTES),
            "--keep-alive-timeout", str(SERVER_KEEP_ALIVE_S), "--log-level", "warning"]  # fmt: skip
    for flag, value in (("--method", config.method), ("--target", config.target),
                        ("--draft", config.draft)):  # fmt: skip
        if value is not None:
            args += [flag, value]
    return args


def run_soak(config: SoakConfig, say: Callable[[str], None]) -> dict[str, Any]:
    """The whole run; writes OUT/soak.json and returns it, verdicts included."""
    config.out.mkdir(parents=True, exist_ok=True)
    prompts = load_prompts(config.prompts, config.per_category)
    say("starting the server ...")
    log_path = config.out / "soak-server.log"
    server = ServerUnderTest(server_args(config), log_path)
    try:
        results = soak(server, config, prompts, say)
    finally:
        server.stop()
    log = log_path.read_text(errors="replace")
    results["server"] = {
        **server.health,
        "exit_status": server.proc.returncode,
        "tracebacks": log.count("Traceback (most recent call last)"),
    }
    judge(results)
    write_json(config.out / "soak.json", results)
    return results


def soak(server: ServerUnderTest, config: SoakConfig, prompts: list[BenchPrompt],
         say: Callable[[str], None]) -> dict[str, Any]:  # fmt: skip
    """Solo answers, the clients, the drain: the run's record (soak_checks.Tally's, plus
    memory, timing and the drain)."""
    model, seats = server.health["model"], server.health["max_num_seqs"]
    plan = Plan(model, prompts, config.max_tokens,
                scenarios(prompts, model, config.max_tokens, config.seed),
                bad_calls(model, MAX_BODY_BYTES, config.max_context))  # fmt: skip
    tally = Tally(plan)
    process = psutil.Process(server.proc.pid)
    start_rss = process.memory_info().rss
    limits = httpx.Limits(max_connections=config.clients + seats, max_keepalive_connections=None)
    with (
        openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0,
                      timeout=REQUEST_TIMEOUT_S) as client,
        httpx.Client(timeout=REQUEST_TIMEOUT_S, limits=limits) as http,
    ):  # fmt: skip
        say(f"solo answers of {len(plan.scenarios)} greedy requests ...")
        for s in plan.scenarios:
            tally.solo(s, send_call(client, Call(s.route, s.kwargs, "whole", 0, s.key,
                                                 s.constraint, ("greedy",))))  # fmt: skip
        say(f"{config.clients} clients for {config.duration_s:g} s ...")
        monitor = Monitor(process, http, server.url, tally,
                          WARMUP_SHARE * config.duration_s, say)  # fmt: skip
        t0 = time.perf_counter()
        run_clients(config, plan, tally, client, http, server.url)
        wall = time.perf_counter() - t0
        warm_rss = monitor.warm_rss()
        drain = check_seats(http, server.url, model, seats, config.max_context)
        end_rss = process.memory_info().rss
        samples = monitor.stop()
    rss = [start_rss, warm_rss, end_rss, *(s[1] for s in samples)]
    record = tally.snapshot()
    return {
        "schema": SCHEMA,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(config).items()},
        **record,
        "wall_s": wall,
        "throughput": throughput(record, tally, wall),
        "memory": {"start": start_rss, "warm": warm_rss, "end": end_rss, "peak": max(rss)},
        "samples": samples,
        "drain": drain,
        "loadavg": loadavg(),
    }


def run_clients(config: SoakConfig, plan: Plan, tally: Tally, client: openai.OpenAI,
                http: httpx.Client, url: str) -> None:  # fmt: skip
    """`config.clients` threads, each drawing from its own seeded generator and sending,
    one request at a time, until the duration has passed; returns when all have finished."""
    deadline = time.monotonic() + config.duration_s

    def loop(index: int) -> None:
        rng = random.Random(f"{config.seed}:client{index}")
        while time.monotonic() < deadline:
            request = draw(rng, plan)
            if isinstance(request, BadCall):
                tally.record(request, send_bad(http, url, request))
            else:
                tally.record(request, send_call(client, request))

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(config.clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def throughput(record: dict[str, Any], tally: Tally, wall: float) -> dict[str, Any]:
    done = sum(sum(s.values()) for s in record["requests"].values())
    return {
        "requests": done,
        "requests_per_s": done / wall,
        "tokens": record["tokens"],
        "tokens_per_s": record["tokens"] / wall,
        **{f"latency_p{q}_s": percentile(tally.latencies, q / 100) for q in (50, 95, 99)},
        **{f"ttft_p{q}_s": percentile(tally.ttfts, q / 100) for q in (50, 95)},
        **{f"refusal_p{q}_s": percentile(tally.bad_latencies, q / 100) for q in (50, 95)},
    }


class Monitor:
    """A thread that, every MONITOR_S until `stop()`, samples the server's resident memory
    and /health's running and waiting ([[t, rss, running, waiting], ...]); keeps the first
    memory reading from `warm_after_s` on (the level after the warm-up); and says how the run
    goes every PROGRESS_S."""

    def __init__(self, process: psutil.Process, http: httpx.Client, url: str, tally: Tally,
                 warm_after_s: float, say: Callable[[str], None]) -> None:  # fmt: skip
        self._process, self._http, self._url, self._tally = process, http, url, tally
        self._warm_after_s, self._say = warm_after_s, say
        self._warm: int | None = None
        self._stop = threading.Event()
        self._samples: list[list[float]] = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        t0 = time.monotonic()
        next_say = PROGRESS_S
        while not self._stop.wait(MONITOR_S):
            t, rss = time.monotonic() - t0, self._process.memory_info().rss
            if self._warm is None and t >= self._warm_after_s:
                self._warm = rss
            try:
                health = self._http.get(self._url + "/health", timeout=30).json()
            except httpx.HTTPError:  # the run's checks see a server that stopped answering
                continue
            self._samples.append([round(t, 1), rss, health["running"], health["waiting"]])
            if t >= next_say:
                next_say += PROGRESS_S
                record = self._tally.snapshot()
                done = sum(sum(s.values()) for s in record["requests"].values())
                self._say(f"  {t:.0f} s: {done} requests, {record['tokens']} tokens, "
                          f"RSS {rss / 2**20:.0f} MiB, running {health['running']}, "
                          f"waiting {health['waiting']}")  # fmt: skip

    def warm_rss(self) -> int:
        """The memory after the warm-up (now, if the clients finished before it ended)."""
        return self._warm if self._warm is not None else self._process.memory_info().rss

    def stop(self) -> list[list[float]]:
        self._stop.set()
        self._thread.join(60)
        return self._samples


def wait_idle(http: httpx.Client, url: str) -> dict[str, Any]:
    """Poll /health until nothing runs or waits (or IDLE_TIMEOUT_S): the last counts."""
    t0 = time.monotonic()
    while True:
        health = http.get(url + "/health", timeout=30).json()
        idle = health["running"] == 0 and health["waiting"] == 0
        if idle or time.monotonic() - t0 > IDLE_TIMEOUT_S:
            return {"running": health["running"], "waiting": health["waiting"],
                    "seconds": round(time.monotonic() - t0, 2)}  # fmt: skip
        time.sleep(0.2)


def check_seats(http: httpx.Client, url: str, model: str, seats: int,
                max_context: int) -> dict[str, Any]:  # fmt: skip
    """Idle after the clients; one long stream per seat all started before any ended (every
    seat takes a sequence); idle again once they are closed."""
    after_clients = wait_idle(http, url)
    started = [threading.Event() for _ in range(seats)]
    ended = [threading.Event() for _ in range(seats)]
    release = threading.Event()
    body = {"model": model, "prompt": "def", "max_tokens": max_context // 2, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip

    def hold(i: int) -> None:
        try:
            with http.stream("POST", url + "/v1/completions", json=body) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        started[i].set()
                    if release.is_set():
                        return
        except httpx.HTTPError:  # counted below: this seat never started, or ended early
            pass
        finally:
            ended[i].set()

    holders = [threading.Thread(target=hold, args=(i,), daemon=True) for i in range(seats)]
    for thread in holders:
        thread.start()
    deadline = time.monotonic() + SEATS_TIMEOUT_S
    while not all(e.is_set() for e in started) and time.monotonic() < deadline:
        if any(e.is_set() for e in ended):
            break
        time.sleep(0.05)
    burst = {"seats": seats, "started": sum(e.is_set() for e in started),
             "finished_early": any(e.is_set() for e in ended)}  # fmt: skip
    burst["health"] = http.get(url + "/health", timeout=30).json()
    release.set()
    for thread in holders:
        thread.join(120)
    return {"after_clients": after_clients, "burst": burst, "after_burst": wait_idle(http, url)}
