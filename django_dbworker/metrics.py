"""Prometheus metrics of one coordinator, through ``prometheus_client``.

Counters and histograms are updated by the coordinator as its pools report; the gauges
that come from the database (pending rows, the oldest pending row's age) are read when
Prometheus scrapes, through the claimable index (the backlog, never the history). Every
metric has the labels ``worker`` and ``queue`` (the task queue, "" for row workers).
See docs/operations.md for the names and a Grafana panel.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

EVENTS = {
    "claimed": "Rows claimed.",
    "finished": "Handlers that returned Finished() (tasks: SUCCESSFUL).",
    "unfinished": "Handlers that returned Unfinished().",
    "failed": "Attempts that failed for good (no retry left).",
    "retried": "Failed attempts that wait for a retry.",
    "lost": "Runs whose claim was taken over; their writes were discarded.",
    "crashed": "Children that died.",
    "released": "Rows given back to the database (not run, or interrupted).",
}
# Seconds: a quick ORM handler takes about a millisecond; a report can take minutes.
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10,
                    30, 60, 300, float("inf"))
PICKUP_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30,
                  60, float("inf"))
LABELS = ("worker", "queue")


class Metrics:
    def __init__(self, workers: Iterable[Any], backlog: Callable[[], dict[str, tuple[int, float | None]]],
                 busy: Callable[[], dict[str, int]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.labels = {w.name: (w.name, getattr(w, "queue", "")) for w in workers}
        self.counters = {event: Counter(f"dbworker_{event}", text, LABELS, registry=self.registry)
                         for event, text in EVENTS.items()}
        self.duration = Histogram("dbworker_handler_duration_seconds",
                                  "How long handlers ran, by row.", LABELS,
                                  buckets=DURATION_BUCKETS, registry=self.registry)
        self.pickup = Histogram("dbworker_pickup_latency_seconds",
                                "From a row becoming claimable (inserted, due, continued) to "
                                "its handler's start.", LABELS, buckets=PICKUP_BUCKETS,
                                registry=self.registry)
        for name in self.labels:  # every series exists from the start, at 0
            for counter in self.counters.values():
                counter.labels(*self.labels[name])
        self.registry.register(_DatabaseGauges(self.labels, backlog, busy))

    def count(self, worker: str, event: str, n: int = 1) -> None:
        if event in self.counters and worker in self.labels and n:
            self.counters[event].labels(*self.labels[worker]).inc(n)

    def observe(self, worker: str, duration: float | None, pickup: float | None) -> None:
        labels = self.labels.get(worker)
        if labels is None:
            return
        if duration is not None:
            self.duration.labels(*labels).observe(max(duration, 0.0))
        if pickup is not None:
            self.pickup.labels(*labels).observe(max(pickup, 0.0))


class _DatabaseGauges:
    """Collected at each scrape: busy children (the pools), pending rows and the oldest
    pending row's age (one query for all workers, on the claimable index)."""

    def __init__(self, labels: dict[str, tuple[str, str]],
                 backlog: Callable[[], dict[str, tuple[int, float | None]]],
                 busy: Callable[[], dict[str, int]]) -> None:
        self.labels, self.backlog, self.busy = labels, backlog, busy

    def describe(self) -> list[Any]:
        return []  # (collected only when scraped: no query at registration)

    def collect(self) -> Iterable[Any]:
        busy = GaugeMetricFamily("dbworker_busy_children", "Children holding rows.",
                                 labels=LABELS)
        for name, n in self.busy().items():
            busy.add_metric(self.labels[name], n)
        yield busy
        pending = GaugeMetricFamily("dbworker_pending_rows",
                                    "Rows claimable now (pending or unfinished, not waiting "
                                    "for a due time; eligible or not).", labels=LABELS)
        age = GaugeMetricFamily("dbworker_oldest_pending_age_seconds",
                                "Age of the longest-waiting claimable row.", labels=LABELS)
        try:
            backlog = self.backlog()
        except Exception:  # noqa: BLE001 - the database is down: /readyz says so
            backlog = {}
        for name, labels in self.labels.items():
            count, oldest = backlog.get(name, (0, None))
            pending.add_metric(labels, count)
            age.add_metric(labels, oldest or 0.0)
        yield pending
        yield age
