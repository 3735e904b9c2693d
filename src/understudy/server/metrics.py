"""Server metrics for Prometheus, on prometheus_client, in a registry of this app's own.

Names carry the `understudy:` prefix and otherwise follow vLLM's where it has one
(`vllm:spec_decode_num_drafts` -> `understudy:spec_decode_num_drafts`, and so on), so a
dashboard written for vLLM's speculative decoding reads ours by changing the prefix. The
vocabulary: a round (vLLM: a draft) is one draft -> verify cycle; drafted and accepted count
tokens. `spec_decode_num_drafts` counts every decode round, one that drafted nothing included
(plain decoding is all such rounds), and `spec_decode_num_accepted_tokens_per_pos{position=i}`
the rounds whose drafted token at position i (0-based) was accepted: their ratio is the
per-position acceptance of the responses' stats.

Every sample is labelled with `model_name` (the served name) and `method`. The registry is
created per app (never prometheus_client's global one), so two apps in one process keep
separate counts; the text format's escaping of label values is the library's.
"""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["CONTENT_TYPE", "PREFIX", "Metrics"]

PREFIX = "understudy:"
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
BASE_LABELS = ("model_name", "method")


class Metrics:
    """The server's counters, gauges and histograms; thread-safe (prometheus_client's own
    locks, plus one for the totals the derived gauges are computed from)."""

    def __init__(self, model: str, method: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._base = {"model_name": model, "method": method}
        self._lock = threading.Lock()
        self._drafted = 0
        self._accepted = 0
        self._generated = 0
        self._passes = 0

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(PREFIX + name, doc, (*BASE_LABELS, *labels), registry=self.registry)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(PREFIX + name, doc, BASE_LABELS, registry=self.registry).labels(
                **self._base
            )

        def histogram(name: str, doc: str, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> Any:
            family = Histogram(
                PREFIX + name, doc, BASE_LABELS, registry=self.registry, buckets=buckets
            )
            return family.labels(**self._base)

        self._requests = counter(
            "http_requests", "HTTP requests by route and status code.", "route", "code"
        )
        self._success = counter(
            "request_success", "Finished generations by finish reason.", "finished_reason"
        )
        self._per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Rounds whose drafted token at this position (0-based) was accepted.",
            "position",
        )
        base = self._base
        self._prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.").labels(**base)
        self._generation_tokens = counter("generation_tokens", "Tokens generated.").labels(**base)
        self._target_passes = counter(
            "target_passes", "Forward passes of the target model (prefill included)."
        ).labels(**base)
        self._drafts = counter(
            "spec_decode_num_drafts",
            "Decode rounds (draft -> verify cycles; one that drafted nothing counts too).",
        ).labels(**base)
        self._draft_tokens = counter("spec_decode_num_draft_tokens", "Tokens drafted.").labels(
            **base
        )
        self._accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Drafted tokens accepted by the target."
        ).labels(**base)
        self._acceptance_rate = gauge(
            "spec_decode_acceptance_rate", "Accepted / drafted tokens since the server started."
        )
        self._tokens_per_pass = gauge(
            "tokens_per_target_pass",
            "Generated tokens / target passes since the server started (plain decoding: 1).",
        )
        self._running = gauge(
            "num_requests_running", "Sequences generating now (a request's n choices count n)."
        )
        self._waiting = gauge(
            "num_requests_waiting", "Sequences admitted and waiting (queued or for a seat)."
        )
        self._pass_rows = histogram(
            "target_pass_rows",
            "Rows of each batched round's one target pass (every running sequence's together).",
            ROW_BUCKETS,
        )
        self._e2e = histogram("e2e_request_latency_seconds", "Request latency, end to end.")
        self._ttft = histogram("time_to_first_token_seconds", "Time to the first generated token.")
        self._queue = histogram("request_queue_time_seconds", "Time spent waiting in the queue.")

    def request(self, route: str, status: int) -> None:
        self._requests.labels(**self._base, route=route, code=str(status)).inc()

    def generation(
        self, stats: dict[str, Any], e2e_s: float, ttft_s: float | None, queue_s: float
    ) -> None:
        """Account one finished generation (its GenerationStats as a dict)."""
        self._prompt_tokens.inc(stats["prompt_tokens"])
        self._generation_tokens.inc(stats["tokens"])
        self._target_passes.inc(stats["target_passes"])
        self._drafts.inc(stats["rounds"])
        self._draft_tokens.inc(stats["drafted"])
        self._accepted_tokens.inc(stats["accepted"])
        for i, share in enumerate(stats["per_position_acceptance"]):
            accepted = round(share * stats["rounds"])
            self._per_pos.labels(**self._base, position=str(i)).inc(accepted)
        reason = stats["finish_reason"] or "unknown"
        self._success.labels(**self._base, finished_reason=reason).inc()
        self._e2e.observe(e2e_s)
        if ttft_s is not None:
            self._ttft.observe(ttft_s)
        self._queue.observe(queue_s)
        with self._lock:
            self._drafted += stats["drafted"]
            self._accepted += stats["accepted"]
            self._generated += stats["tokens"]
            self._passes += stats["target_passes"]

    def batch_pass(self, rows: int) -> None:
        """One round of the batch ran a target pass of `rows` rows."""
        self._pass_rows.observe(rows)

    def render(self, running: int, waiting: int) -> bytes:
        """The exposition text (prometheus_client's format; media type CONTENT_TYPE)."""
        self._running.set(running)
        self._waiting.set(waiting)
        with self._lock:
            self._acceptance_rate.set(self._accepted / self._drafted if self._drafted else 0.0)
            self._tokens_per_pass.set(self._generated / self._passes if self._passes else 0.0)
        return generate_latest(self.registry)
