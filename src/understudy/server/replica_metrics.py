"""GET /metrics for a replicated server: every running replica's samples, each labelled
with `replica="<its id>"`, plus the front's own two series.

Each replica publishes its exposition text (its own `Metrics` registry, rendered) to one
`MetricsBoard` actor; the front reads the board and merges the texts family by family with
prometheus_client's parser, so the output is one valid exposition: each family's HELP and
TYPE once, the samples of all replicas under it. Sum over `replica` for service totals
(`sum without (replica) (...)`). A replica that died leaves the board at the next read (its
Ray actor is gone), so no stale gauge outlives it; a restarted replica appears under its new
id with fresh counters, as a restarted Prometheus target does.

Front series: `understudy:replicas` (replicas Ray Serve reports running) and
`understudy:requests_unavailable` (requests answered 503, or a stream ended with a retryable
error, because the replica serving them was lost).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

REPLICA_LABEL = "replica"


class MetricsBoard:
    """A Ray actor (created with `ray.remote(MetricsBoard)`) holding each replica's latest
    exposition text, keyed by replica id."""

    def __init__(self) -> None:
        # replica id -> (its actor's name and namespace, its latest text)
        self._texts: dict[str, tuple[str, str, bytes]] = {}

    def put(self, replica: str, actor_name: str, namespace: str, text: bytes) -> None:
        self._texts[replica] = (actor_name, namespace, text)

    def texts(self) -> dict[str, bytes]:
        """The texts of replicas whose actor is alive; the dead ones are forgotten."""
        import ray

        alive: dict[str, bytes] = {}
        for replica, (actor_name, namespace, text) in list(self._texts.items()):
            try:
                ray.get_actor(actor_name, namespace=namespace)
            except ValueError:  # no live actor has that name any more
                del self._texts[replica]
                continue
            alive[replica] = text
        return alive


class _Merged:
    """A prometheus_client collector yielding the replicas' families, relabelled."""

    def __init__(self, texts: dict[str, bytes], own: list[Metric]) -> None:
        self.texts = texts
        self.own = own

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for replica, text in sorted(self.texts.items()):
            for family in text_string_to_metric_families(text.decode()):
                merged = families.get(family.name)
                if merged is None:
                    merged = Metric(family.name, family.documentation, family.type, family.unit)
                    families[family.name] = merged
                for sample in family.samples:
                    labels = {REPLICA_LABEL: replica, **sample.labels}
                    merged.add_sample(sample.name, labels, sample.value, sample.timestamp)
        yield from self.own
        yield from families.values()


def merged_exposition(texts: dict[str, bytes], replicas: int, unavailable: int) -> bytes:
    """One exposition text: the front's series, then every replica's samples labelled."""
    own: list[Metric] = [
        GaugeMetricFamily(
            "understudy:replicas", "Replicas Ray Serve reports running.", value=replicas
        ),
        CounterMetricFamily(
            "understudy:requests_unavailable",
            "Requests ended with a retryable error (503) because their replica was lost.",
            value=unavailable,
        ),
    ]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(texts, own))
    return generate_latest(registry)


def board_actor() -> Any:
    """The board as a Ray actor class (no CPU reserved: it only stores text)."""
    import ray

    return ray.remote(num_cpus=0)(MetricsBoard)
