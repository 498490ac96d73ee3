"""Prometheus metrics of one coordinator, through ``prometheus_client``.

Counters and histograms are updated by the coordinator as its pools report, one counter
per event of ``events.EVENTS``. The gauges that come from the database (pending rows, the
oldest pending row's age) are read through the claimable index (the backlog, never the
history) by ``Backlog``: at most every ``BACKLOG_MAX_AGE`` seconds, on the probe server's
thread and a connection of its own, so that a scrape, or forty at once, never takes the
loop's thread or its connections. Every metric has the labels ``worker`` and ``queue``
(the task queue, "" for row workers). See docs/operations.md for the names and a Grafana
panel.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from .events import EVENTS, check

if TYPE_CHECKING:
    from ..registration.registry import Worker
    from ..store.bridge import Bridge

logger = logging.getLogger("django_dbworker.probes")
# Seconds: a quick ORM handler takes about a millisecond; a report can take minutes.
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10,
                    30, 60, 300, float("inf"))
PICKUP_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30,
                  60, float("inf"))
LABELS = ("worker", "queue")
# The backlog gauges are read again when a scrape finds them older than this: Prometheus
# scrapes every 15 s or more, so each of its scrapes reads them afresh, while a crowd of
# scrapers costs one read per 5 s.
BACKLOG_MAX_AGE = 5.0

Figures = dict[str, tuple[int, float | None]]  # worker -> (pending rows, oldest's age)


class Backlog:
    """The backlog gauges' figures, cached. ``refresh()`` reads them (the probe server's
    thread calls it); the gauges show the last figures read, the oldest row's age grown
    by the time since."""

    def __init__(self, read: Callable[[], Figures], close: Callable[[], None] | None = None,
                 max_age: float = BACKLOG_MAX_AGE) -> None:
        self._read, self._close, self.max_age = read, close, max_age
        self._last: tuple[Figures, float] | None = None  # (figures, monotonic time read)

    @classmethod
    def on_own_connection(cls, database: str, lease_seconds: float,
                          workers: Iterable[Worker]) -> Backlog:
        """Read through a Bridge of its own (made at the first read, on the reading
        thread), never the coordinator's: a scrape takes none of the loop's connections."""
        workers = list(workers)
        own: list[Bridge] = []
        lock = threading.Lock()

        def read() -> Figures:
            from ..store.bridge import Bridge

            with lock:
                if not own:
                    own.append(Bridge(database, lease_seconds))
            return own[0].backlog(workers)

        def close() -> None:
            with lock:
                while own:
                    own.pop().close()

        return cls(read, close)

    def stale(self, now: float | None = None) -> bool:
        last = self._last
        return last is None or (time.monotonic() if now is None else now) - last[1] >= self.max_age

    def refresh(self) -> None:
        try:
            figures = self._read()
        except Exception as exc:  # noqa: BLE001 - the database is down: /readyz says so
            logger.debug("Backlog gauges not read: %s", exc)
            figures = {}
        self._last = (figures, time.monotonic())  # (one assignment: read from other threads)

    def figures(self) -> Figures:
        if self._last is None:
            return {}
        figures, read_at = self._last
        grown = time.monotonic() - read_at
        return {name: (count, None if oldest is None else oldest + grown)
                for name, (count, oldest) in figures.items()}

    def close(self) -> None:
        if self._close is not None:
            self._close()


class Metrics:
    def __init__(self, workers: Iterable[Any], backlog: Backlog,
                 busy: Callable[[], dict[str, int]],
                 throttled: Callable[[], dict[str, dict[str, int]]] = dict) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.backlog = backlog
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
        self.registry.register(_DatabaseGauges(self.labels, backlog, busy, throttled))

    def count(self, worker: str, event: str, n: int = 1) -> None:
        """Count ``n`` ``event``s (a name of ``events.EVENTS``; any other is an error)."""
        counter = self.counters[check(event)]
        if worker in self.labels and n:
            counter.labels(*self.labels[worker]).inc(n)

    def observe(self, worker: str, duration: float | None, pickup: float | None) -> None:
        labels = self.labels.get(worker)
        if labels is None:
            return
        if duration is not None:
            self.duration.labels(*labels).observe(max(duration, 0.0))
        if pickup is not None:
            self.pickup.labels(*labels).observe(max(pickup, 0.0))


class _DatabaseGauges:
    """Collected at each scrape: busy children (the pools, read now), pending rows and the
    oldest pending row's age (the Backlog's figures, never a query)."""

    def __init__(self, labels: dict[str, tuple[str, str]], backlog: Backlog,
                 busy: Callable[[], dict[str, int]],
                 throttled: Callable[[], dict[str, dict[str, int]]]) -> None:
        self.labels, self.backlog, self.busy = labels, backlog, busy
        self.throttled = throttled

    def describe(self) -> list[Any]:
        return []  # (collected only when scraped)

    def collect(self) -> Iterable[Any]:
        busy = GaugeMetricFamily("dbworker_busy_children", "Children holding rows.",
                                 labels=LABELS)
        for name, n in self.busy().items():
            busy.add_metric(self.labels[name], n)
        yield busy
        pending = GaugeMetricFamily("dbworker_pending_rows",
                                    "Rows claimable now (pending or unfinished, not waiting "
                                    "for a due time; eligible or not); read at most every "
                                    f"{BACKLOG_MAX_AGE:g} s.", labels=LABELS)
        age = GaugeMetricFamily("dbworker_oldest_pending_age_seconds",
                                "Age of the longest-waiting claimable row.", labels=LABELS)
        backlog = self.backlog.figures()
        for name, labels in self.labels.items():
            count, oldest = backlog.get(name, (0, None))
            pending.add_metric(labels, count)
            age.add_metric(labels, oldest or 0.0)
        yield pending
        yield age
        throttled = GaugeMetricFamily(
            "dbworker_throttled_rows",
            "Claimable rows this coordinator's last claim passed over because a flow-control "
            "limit held them (per_key, total, rate); at most the claim's candidates.",
            labels=[*LABELS, "limit"])
        for name, held in self.throttled().items():
            if name in self.labels:
                for limit, n in sorted(held.items()):
                    throttled.add_metric([*self.labels[name], limit], n)
        yield throttled
