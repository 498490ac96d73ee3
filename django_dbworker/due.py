"""Rows that wait for a time: retries after their back-off, ``run_after``, ``rerun_every``.

A waiting row is not claimable (the claim index leaves it out) until it is promoted: its
due time is moved to ``ready_at`` and it joins the claimable rows. This object keeps, per
worker, when the next waiting row is due, so that the coordinator asks the database only
then, and tells the loop how long it may sleep.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from .registry import Worker

if TYPE_CHECKING:
    from .bridge import Bridge
    from .outage import DatabaseHealth


class DueRows:
    def __init__(self, bridge: Bridge, health: DatabaseHealth, workers: Iterable[Worker],
                 poll_seconds: float) -> None:
        self.bridge, self.health, self.poll_seconds = bridge, health, poll_seconds
        # Monotonic time each worker's first waiting row is due (None: none waits). Each
        # worker starts by looking.
        self._due: dict[str, float | None] = {w.name: 0.0 for w in workers}

    def promote(self, worker: Worker, now: float) -> bool:
        """Make the worker's rows whose due time came claimable, and learn when the next
        one is due. True if it promoted any."""
        due = self._due.get(worker.name)
        promoted = 0
        if due is None or due <= now:
            promoted = self.health.call(self.bridge.promote_due, worker) or 0
        seconds = self.health.call(self.bridge.seconds_until_due, worker)
        if seconds is None:
            self._due[worker.name] = None  # none waits (or the database failed: next claim)
        else:
            # Not before a poll when nothing was due yet: the clocks may disagree a little.
            self._due[worker.name] = now + max(seconds, 0.0 if promoted else self.poll_seconds)
        return promoted > 0

    def promote_due(self, workers: Iterable[Worker], now: float) -> list[str]:
        """Promote for the workers whose next row is due by now; the names that got rows."""
        return [w.name for w in workers
                if (due := self._due.get(w.name)) is not None and due <= now
                and self.promote(w, now)]

    def deadlines(self) -> list[float]:
        return [d for d in self._due.values() if d is not None]
