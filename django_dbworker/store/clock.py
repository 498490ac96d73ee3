"""The database's clock: the one clock for every time the app writes or compares.

Leases, due times and retries are compared in SQL with the database's own ``now``, so a
time the app writes must come from that clock too, or a host whose clock is off would run
a retry early or late by its skew. Statements write ``Vendor.now_sql()`` themselves; Python
code that needs the time as a value (a task's result times, written for a whole group in
one statement; a cron slot; the admin's "due in") asks here. The offset between this
process's clock and the database's is measured with one query, at most once a minute per
database, so asking costs nothing in a hot path.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta

from django.utils import timezone

MEASURE_EVERY_SECONDS = 60.0

# alias -> (time.monotonic() when measured, the database's clock minus this process's)
_offsets: dict[str, tuple[float, timedelta]] = {}


def now(alias: str) -> datetime:
    """Now on the database's clock, as an aware UTC datetime (a query once a minute)."""
    measured = _offsets.get(alias)
    if measured is None or time.monotonic() - measured[0] >= MEASURE_EVERY_SECONDS:
        measured = _measure(alias)
    return timezone.now() + measured[1]


def estimate(alias: str) -> datetime:
    """Now on the database's clock as last measured, never a query: for code that must
    not touch the database (a coordinator's wait, during an outage too)."""
    measured = _offsets.get(alias)
    return timezone.now() + (measured[1] if measured is not None else timedelta(0))


def _measure(alias: str) -> tuple[float, timedelta]:
    from django.db import connections

    from ..vendors import for_connection

    before = timezone.now()
    database = for_connection(connections[alias]).current_time()
    after = timezone.now()
    measured = (time.monotonic(), database - (before + (after - before) / 2))
    _offsets[alias] = measured
    return measured

