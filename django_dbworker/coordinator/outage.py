"""Database outages, seen from a coordinator: one back-off per outage, not one per call.

Any statement that fails because the database went away starts (or continues) one
outage. While it lasts, the coordinator makes no calls but a cheap probe, at most a second
apart, so work resumes within about a second of the database's return. It logs one line
when the outage starts, a reminder every ``REMIND_SECONDS`` while it lasts, and one line
when it ends.

Not every failure is an outage. A deadlock is contention: the call is retried at once.
SQLite's "database is locked" means a running handler holds its only write lock: the
call waits ``POLL_SECONDS`` quietly. The vendor tells them apart.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from django.db import DatabaseError

from ..store.engine import DATABASE_ERRORS
from ..store.errors import first_line
from ..vendors import Vendor

logger = logging.getLogger("django_dbworker.coordinator")
T = TypeVar("T")
# The coordinator talks through SQLAlchemy (claims) and, for schedules, Django's ORM.
FAILURES = (*DATABASE_ERRORS, DatabaseError)


class DatabaseHealth:
    PROBE_FIRST = 0.05
    PROBE_MOST = 1.0
    REMIND_SECONDS = 30.0
    DEADLOCK_RETRIES = 3

    def __init__(self, vendor: Vendor, probe: Callable[[], Any], poll_seconds: float,
                 on_back: Callable[[], Any] | None = None) -> None:
        self.vendor = vendor
        self._probe = probe
        self._on_back = on_back  # when an outage ends (drop connections opened before it)
        self.poll_seconds = poll_seconds
        self.down_since: float | None = None
        self._next_probe = 0.0
        self._probe_delay = self.PROBE_FIRST
        self._next_reminder = 0.0
        self._busy_until = 0.0  # SQLite's lock: come back after a poll

    def available(self, now: float) -> bool:
        """Whether calls may go to the database now (probing it when an outage is due a
        probe)."""
        if now < self._busy_until:
            return False
        if self.down_since is None:
            return True
        if now < self._next_probe:
            return False
        try:
            self._probe()
        except DATABASE_ERRORS as exc:
            self._still_down(now, exc)
            return False
        logger.warning("Database available again after %.1fs of outage; resuming",
                       now - self.down_since)
        if self._on_back is not None:
            # Pooled connections from before a server restart are dead, and each would
            # fail its next statement and begin a second "outage".
            self._on_back()
        self.down_since = None
        self._probe_delay = self.PROBE_FIRST
        return True

    def deadline(self) -> float | None:
        """When to look again, while calls are held back."""
        if self.down_since is not None:
            return self._next_probe
        return self._busy_until if self._busy_until > time.monotonic() else None

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
        """``fn(*args)``; on a database failure, None (and the outage or wait begins)."""
        for _ in range(self.DEADLOCK_RETRIES):
            try:
                return fn(*args, **kwargs)
            except FAILURES as exc:
                if self.vendor.is_deadlock(exc):
                    logger.debug("Deadlock in %s, retrying at once: %s",
                                 getattr(fn, "__name__", fn), first_line(exc))
                    continue
                self.failed(exc)
                return None
        self._busy_until = time.monotonic() + self.poll_seconds
        return None

    def failed(self, exc: BaseException) -> None:
        now = time.monotonic()
        if self.vendor.is_lock_contention(exc):
            logger.debug("The database is busy (a running handler holds its write lock); "
                         "retrying in %.2fs", self.poll_seconds)
            self._busy_until = now + self.poll_seconds
            return
        if self.down_since is None:
            self.down_since = now
            self._next_reminder = now + self.REMIND_SECONDS
            logger.warning("Database unavailable (%s): claims paused; checking again every "
                           "%.0fs at most", first_line(exc), self.PROBE_MOST)
        self._schedule_probe(now)

    def _still_down(self, now: float, exc: BaseException) -> None:
        assert self.down_since is not None
        if now >= self._next_reminder:
            self._next_reminder = now + self.REMIND_SECONDS
            logger.warning("Database still unavailable after %.0fs (%s)",
                           now - self.down_since, first_line(exc))
        self._schedule_probe(now)

    def _schedule_probe(self, now: float) -> None:
        self._next_probe = now + self._probe_delay
        self._probe_delay = min(self._probe_delay * 2, self.PROBE_MOST)


def wait_for_database(alias: str, seconds: float) -> None:
    """At start: wait up to ``seconds`` for a database that does not answer yet, logging
    one line per attempt, then give up with one line naming the fix. A connection that
    can never succeed as configured (a wrong password) fails at once."""
    from django.core.exceptions import ImproperlyConfigured
    from django.db import DatabaseError, connections

    from ..vendors import for_connection

    connection = connections[alias]
    deadline = time.monotonic() + seconds
    delay, attempt = 0.5, 0
    while True:
        try:
            connection.ensure_connection()
            return
        except DatabaseError as exc:
            if for_connection(connection).is_permanent_connect_error(exc):
                raise ImproperlyConfigured(
                    f"Cannot connect to database {alias!r}: {first_line(exc)}. Check NAME, "
                    f"USER and PASSWORD in DATABASES[{alias!r}].") from None
            attempt += 1
            left = deadline - time.monotonic()
            if left <= 0:
                raise ImproperlyConfigured(
                    f"Database {alias!r} did not answer within {seconds:.0f}s "
                    f"({first_line(exc)}). Check that it runs and HOST/PORT in "
                    f"DATABASES[{alias!r}], or wait longer with --wait-for-database "
                    "SECONDS.") from None
            logger.warning("Database %r not reachable yet (%s); attempt %d, next in %.1fs, "
                           "giving up in %.0fs", alias, first_line(exc), attempt,
                           min(delay, left), left)
            time.sleep(min(delay, left))
            delay = min(delay * 2, 5.0)
