"""Server metrics in the Prometheus text exposition format (version 0.0.4), written by hand.

Names follow vLLM's where it has one (`spec_decode_num_draft_tokens`,
`..._num_accepted_tokens`, `..._num_accepted_tokens_per_pos`); the vocabulary is DESIGN.md
section 2: a round is one draft -> verify cycle, drafted and accepted count tokens.
"""

from __future__ import annotations

import math
import threading
from collections import defaultdict
from typing import Any

PREFIX = "understudy_"
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.total = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.total += 1
        self.sum += value
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1


def _label_text(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    escaped = (
        f'{k}="{v.replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
        for k, v in labels.items()
    )
    return "{" + ",".join(escaped) + "}"


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if isinstance(value, float) else str(value)


class Metrics:
    """Thread-safe counters, updated by the request handlers, read by GET /metrics."""

    def __init__(self, model: str, method: str) -> None:
        self._lock = threading.Lock()
        self.model = model
        self.method = method
        self.requests: dict[tuple[str, str], int] = defaultdict(int)  # (route, status) -> n
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.target_passes = 0
        self.rounds = 0  # draft -> verify cycles (DESIGN.md section 2)
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.accepted_per_pos: list[int] = []
        self.finished: dict[str, int] = defaultdict(int)  # finish_reason -> n
        self.e2e = Histogram()
        self.ttft = Histogram()
        self.queue_wait = Histogram()

    def request(self, route: str, status: int) -> None:
        with self._lock:
            self.requests[(route, str(status))] += 1

    def generation(
        self, stats: dict[str, Any], e2e_s: float, ttft_s: float | None, queue_s: float
    ) -> None:
        """Account one finished generation (its GenerationStats as a dict)."""
        with self._lock:
            self.prompt_tokens += stats["prompt_tokens"]
            self.generation_tokens += stats["tokens"]
            self.target_passes += stats["target_passes"]
            self.rounds += stats["rounds"]
            self.draft_tokens += stats["drafted"]
            self.accepted_tokens += stats["accepted"]
            per_pos = [round(share * stats["rounds"]) for share in stats["per_position_acceptance"]]
            if len(self.accepted_per_pos) < len(per_pos):
                self.accepted_per_pos.extend([0] * (len(per_pos) - len(self.accepted_per_pos)))
            for i, n in enumerate(per_pos):
                self.accepted_per_pos[i] += n
            self.finished[stats["finish_reason"] or "unknown"] += 1
            self.e2e.observe(e2e_s)
            if ttft_s is not None:
                self.ttft.observe(ttft_s)
            self.queue_wait.observe(queue_s)

    def render(self, running: int, waiting: int) -> str:
        lines: list[str] = []
        base = {"model": self.model, "method": self.method}

        def metric(name: str, kind: str, help_text: str, samples: list[tuple[dict, float]]) -> None:
            lines.append(f"# HELP {PREFIX}{name} {help_text}")
            lines.append(f"# TYPE {PREFIX}{name} {kind}")
            for labels, value in samples:
                sample_name = name + ("_total" if kind == "counter" else "")
                lines.append(f"{PREFIX}{sample_name}{_label_text({**base, **labels})} {value}")

        def histogram(name: str, help_text: str, h: Histogram) -> None:
            lines.append(f"# HELP {PREFIX}{name} {help_text}")
            lines.append(f"# TYPE {PREFIX}{name} histogram")
            for bound, n in zip(h.buckets, h.counts, strict=True):  # n is cumulative already
                labels = _label_text({**base, "le": _number(bound)})
                lines.append(f"{PREFIX}{name}_bucket{labels} {n}")
            lines.append(f"{PREFIX}{name}_bucket{_label_text({**base, 'le': '+Inf'})} {h.total}")
            lines.append(f"{PREFIX}{name}_sum{_label_text(base)} {_number(h.sum)}")
            lines.append(f"{PREFIX}{name}_count{_label_text(base)} {h.total}")

        with self._lock:
            metric(
                "requests",
                "counter",
                "HTTP requests by route and status code.",
                [({"route": r, "code": c}, n) for (r, c), n in sorted(self.requests.items())],
            )
            metric(
                "request_success",
                "counter",
                "Finished generations by finish reason.",
                [({"finish_reason": k}, n) for k, n in sorted(self.finished.items())],
            )
            metric(
                "prompt_tokens", "counter", "Prompt tokens processed.", [({}, self.prompt_tokens)]
            )
            metric(
                "generation_tokens", "counter", "Tokens generated.", [({}, self.generation_tokens)]
            )
            metric(
                "target_passes",
                "counter",
                "Forward passes of the target model (prefill included).",
                [({}, self.target_passes)],
            )
            metric(
                "spec_decode_num_rounds",
                "counter",
                "Decode rounds (draft -> verify cycles); accepted_per_pos / rounds is the "
                "per-position acceptance.",
                [({}, self.rounds)],
            )
            metric(
                "spec_decode_num_draft_tokens",
                "counter",
                "Tokens drafted.",
                [({}, self.draft_tokens)],
            )
            metric(
                "spec_decode_num_accepted_tokens",
                "counter",
                "Drafted tokens accepted by the target.",
                [({}, self.accepted_tokens)],
            )
            metric(
                "spec_decode_num_accepted_tokens_per_pos",
                "counter",
                "Rounds whose drafted token at this position (0-based) was accepted.",
                [({"position": str(i)}, n) for i, n in enumerate(self.accepted_per_pos)],
            )
            rate = self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0
            metric(
                "spec_decode_acceptance_rate",
                "gauge",
                "Accepted / drafted tokens since the server started.",
                [({}, _number(rate))],
            )
            passes = self.target_passes
            metric(
                "tokens_per_target_pass",
                "gauge",
                "Generated tokens / target passes since the server started (plain decoding: 1).",
                [({}, _number(self.generation_tokens / passes if passes else 0.0))],
            )
            metric("num_requests_running", "gauge", "Requests generating now.", [({}, running)])
            metric("num_requests_waiting", "gauge", "Requests queued.", [({}, waiting)])
            histogram("e2e_request_latency_seconds", "Request latency, end to end.", self.e2e)
            histogram(
                "time_to_first_token_seconds", "Time to the first generated token.", self.ttft
            )
            histogram(
                "request_queue_time_seconds", "Time spent waiting in the queue.", self.queue_wait
            )
        return "\n".join(lines) + "\n"
