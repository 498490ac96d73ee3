"""How an idle coordinator learns that there may be work: wake-ups and back-off.

Each worker has a :class:`~.backoff.Backoff` (claim again at once after work, doubling
waits while idle). Three things wake it early: a ``NOTIFY`` from the triggers (PostgreSQL,
on the one LISTEN connection), a change probe where there is no NOTIFY (one cheap query
every ``PROBE_SECONDS``, half as often once nothing changed for a second: SQLite's
``PRAGMA data_version``, else the largest Execution id, and the pauses' count and latest
time; on SQLite under Linux, when the kernel says the database's files were written,
see :mod:`.doorbell`), and the coordinator's own events (a handler finished, a row was
given back, a pause lifted). The coordinator asks this object when to claim and what to
wait on.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ..store.bridge import Bridge
from ..vendors import ANY_WORKER_NOTICE, PAUSE_NOTICE
from .backoff import QUIET_FACTOR, QUIET_SECONDS, Backoff
from .changewait import ChangeWait
from .listening import Listener, listener_for

if TYPE_CHECKING:
    from ..registration.options import Options
    from .outage import DatabaseHealth

logger = logging.getLogger("django_dbworker.coordinator")


_UNSEEN: Any = object()  # no probe answered yet
# Where a doorbell says when the database's files are written (SQLite on Linux), the
# probe runs when it rings, at most every PROBE_SECONDS, and on this timer only to catch
# a write the bell cannot see (a file shared over the network or with a virtual machine).
DOORBELL_BACKSTOP_SECONDS = 1.0
# In WAL mode the bell rings when a commit writes its pages to the file, a moment before
# the commit is published (in SQLite's shared memory, which rings nothing): a probe at
# once often still sees the old state. So after a ring it probes again until it sees a
# change, first after RING_FIRST_GAP, then twice as long each time up to PROBE_SECONDS,
# and for RING_SECONDS at most (a write that commits nothing, e.g. a checkpoint; with
# synchronous=FULL a commit waits for its fsync before it publishes).
RING_SECONDS = 1.0
RING_FIRST_GAP = 0.002


class Probed(enum.Enum):
    """What the change probe saw."""
    NOTHING = "nothing"
    ROWS = "rows"  # new rows (and the workers are woken)
    PAUSES = "pauses"  # a pause or a resume (perhaps new rows too): read the pauses
    FAILED = "failed"  # the probe's query failed


class Wakeups:
    def __init__(self, workers: Iterable[str], settings: Options, health: DatabaseHealth) -> None:
        self.settings, self.health = settings, health
        self.backoff = {name: Backoff(settings.poll_seconds, settings.max_poll_seconds)
                        for name in workers}
        self.listener: Listener | ChangeWait | None = None
        self._no_notifications = False  # NOTIFY does not reach us (PgBouncer): probe instead
        self._checked = False
        self.next_probe = 0.0
        self._token: Any = _UNSEEN
        self._changed_at = 0.0  # when the probe last saw a change (monotonic)
        self._probed_at = 0.0
        self._rang_at = float("-inf")  # when the doorbell rang and no probe saw a change since
        self._ring_gap = RING_FIRST_GAP
        self.doorbell: Any = None

    def wake(self, worker: str) -> None:
        self.backoff[worker].wake()

    def wake_all(self) -> None:
        for backoff in self.backoff.values():
            backoff.wake()

    def open_doorbell(self, bridge: Bridge) -> None:
        """Where the database cannot NOTIFY, wait on its doorbell if the vendor has one
        (once, at set-up: a bell that breaks later gives way to the timer for good)."""
        if not bridge.vendor.notifies:
            self.doorbell = bridge.vendor.change_doorbell()

    # -- NOTIFY ----------------------------------------------------------------------------
    def listen(self, bridge: Bridge) -> None:
        """LISTEN for wake-ups, if the database can, and check once that they arrive."""
        if (self._no_notifications or self.listener is not None
                or not bridge.vendor.pushes_changes):
            return
        self.listener = self.health.call(listener_for, bridge, self.settings.probe_seconds)
        if self.listener is None or self._checked:
            return
        hears = self.health.call(self.listener.hears, bridge)
        if hears is None:
            return  # the database failed meanwhile: checked at the next LISTEN
        self._checked = True
        if not hears:
            logger.warning(
                "NOTIFY does not reach this coordinator's LISTEN connection (PgBouncer in "
                "transaction mode?): new rows are noticed by polling instead. Set "
                "DBWORKER['LISTEN_DATABASE'] to a DATABASES alias that connects directly.")
            self.close_listener()
            self._no_notifications = True

    def on_notify(self) -> bool:
        """The LISTEN socket is readable: wake the workers named. True if a pause or a
        resume was announced."""
        assert self.listener is not None
        try:
            names = self.listener.drain()
        except Exception as exc:  # noqa: BLE001 - the listener's connection broke
            logger.warning("LISTEN connection lost (%s); polling until it is back", exc)
            self.close_listener()
            self.wake_all()  # (a notification it had read may be lost with it)
            return False  # the next renewal listens again
        if ANY_WORKER_NOTICE in names:
            self.wake_all()
        for name in names:
            if name in self.backoff:
                self.backoff[name].wake()
        return PAUSE_NOTICE in names

    def close_listener(self) -> None:
        if self.listener is not None:
            self.listener.close()
            self.listener = None

    def close(self) -> None:
        self.close_listener()
        if self.doorbell is not None:
            self.doorbell.close()
            self.doorbell = None

    def on_ring(self, now: float) -> None:
        """The doorbell's file descriptor is readable: if a write to the database's files
        rang it, probe now, or PROBE_SECONDS after the last probe while writes keep
        coming (a busy database rings on every commit); then again soon until a probe
        sees the change (see RING_SECONDS)."""
        assert self.doorbell is not None
        if self._rang(now):
            self.next_probe = min(self.next_probe, self._probed_at + self.settings.probe_seconds)

    def _rang(self, now: float) -> bool:
        """Read the doorbell; a bell that cannot watch the files any more is dropped for
        the timer."""
        assert self.doorbell is not None
        rang = self.doorbell.rang()
        if self.doorbell.broken:
            self.doorbell.close()
            self.doorbell = None
        elif rang:
            self._rang_at, self._ring_gap = now, RING_FIRST_GAP
        return rang

    # -- no NOTIFY: the change probe ---------------------------------------------------------
    def probe(self, bridge: Bridge, now: float) -> Probed:
        """Has anything changed since the last look? One cheap query, so that the first
        row after a long idle is picked up as fast as the next one, and a pause is seen
        before the next claim. It wakes the workers on new rows."""
        if self.listener is not None or now < self.next_probe:
            return Probed.NOTHING
        if self.doorbell is not None:
            # A ring waiting for this probe is answered by it (else, seen after it, it
            # would send follow-up probes for a change this one saw).
            self._rang(now)
        token = self.health.call(bridge.change_token)
        last = self._token
        changed = token is not None and last is not _UNSEEN and token != last
        if changed:
            self._changed_at = now
        self._probed_at, self.next_probe = now, self._next_probe(now, changed)
        if token is None:
            return Probed.FAILED  # the loop must see the outage
        self._token = token
        if not changed:
            return Probed.NOTHING
        if token[0] != last[0]:
            self.wake_all()
        return Probed.ROWS if token[1:] == last[1:] else Probed.PAUSES

    def _next_probe(self, now: float, changed: bool) -> float:
        if self.doorbell is None:
            quiet = now - self._changed_at >= QUIET_SECONDS
            return now + self.settings.probe_seconds * (QUIET_FACTOR if quiet else 1)
        if changed:
            self._rang_at = float("-inf")  # that ring's commit is seen
        if now - self._rang_at < RING_SECONDS:  # rang, and nothing seen yet
            gap, self._ring_gap = self._ring_gap, min(self._ring_gap * 2, self.settings.probe_seconds)
            return now + gap
        return now + DOORBELL_BACKSTOP_SECONDS

    def pauses_unseen(self) -> None:
        """The pauses could not be read after the probe saw them change: make the next
        probe report them again."""
        if self._token is not _UNSEEN:
            self._token = (*self._token[:1], _UNSEEN)

    def deadline(self) -> float | None:
        """When the loop must look again for the probe's sake (None: NOTIFY wakes it)."""
        return self.next_probe if self.listener is None else None
