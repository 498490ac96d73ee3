"""Rows that wait for a time: retries after their back-off, ``run_after``, ``rerun_every``.

A waiting row is not claimable (the claim index leaves it out) until it is promoted: its
due time is moved to ``ready_at`` and it joins the claimable rows. This object keeps, per
worker, when the next waiting row is due, so that the coordinator asks the database only
then, and tells the loop how long it may sleep.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from ..registration.registry import Worker

if TYPE_CHECKING:
    from ..store.bridge import Bridge
    from .outage import DatabaseHealth


# While a worker's claims keep finding rows, no claim comes back empty to look for rows
# that became due meanwhile (a retry after its back-off, a task's run_after): look for
# them this often then, so a due row never waits for the backlog to drain.
LOOK_SECONDS = 1.0


class DueRows:
    def __init__(self, bridge: Bridge, health: DatabaseHealth, workers: Iterable[Worker],
                 poll_seconds: float) -> None:
        self.bridge, self.health, self.poll_seconds = bridge, health, poll_seconds
        # Monotonic time each worker's first waiting row is due (None: none waits). Each
        # worker starts by looking.
        self._due: dict[str, float | None] = {w.name: 0.0 for w in workers}
        self._looked: dict[str, float] = {}  # when each worker last looked
        self._busy: set[str] = set()  # workers whose last claim found rows

    def claimed(self, worker: Worker, found: bool) -> None:
        """A claim of ``worker`` found rows (or none: then it looks at once, see
        promote)."""
        if found:
            self._busy.add(worker.name)
        else:
            self._busy.discard(worker.name)

    def promote(self, worker: Worker, now: float) -> bool:
        """Make the worker's rows whose due time came claimable, and learn when the next
        one is due. True if it promoted any."""
        due = self._due.get(worker.name)
        promoted = 0
        if due is None or due <= now:
            promoted = self.health.call(self.bridge.promote_due, worker) or 0
        seconds = self.health.call(self.bridge.seconds_until_due, worker)
        self._looked[worker.name] = now
        if seconds is None:
            self._due[worker.name] = None  # none waits (or the database failed: next claim)
        else:
            # Not before a poll when nothing was due yet: the clocks may disagree a little.
            self._due[worker.name] = now + max(seconds, 0.0 if promoted else self.poll_seconds)
        return promoted > 0

    def promote_due(self, workers: Iterable[Worker], now: float) -> list[str]:
        """Promote for the workers whose next row is due by now, and look again for busy
        workers that knew of none; the names that got rows."""
        return [w.name for w in workers if self._should_look(w.name, now) and self.promote(w, now)]

    def _should_look(self, worker: str, now: float) -> bool:
        # A busy worker looks even when it knows a later due time: a retry written since
        # (by a child, due in a second) may come before it.
        due = self._due.get(worker)
        return ((due is not None and due <= now)
                or (worker in self._busy and now - self._looked.get(worker, 0.0) >= LOOK_SECONDS))

    def deadlines(self) -> list[float]:
        deadlines = [d for d in self._due.values() if d is not None]
        deadlines += [self._looked.get(w, 0.0) + LOOK_SECONDS for w in self._busy]
        return deadlines
