"""MariaDB: the change probe waits in the server, so an idle coordinator sleeps.

MariaDB cannot NOTIFY, so an idle coordinator there probed on a timer: 25 to 50 times a
second, each a wake-up of the coordinator, a round trip and a query. Measured on a
2-core VM, that cost 0.7 % of a core in the coordinator and as much again in the server
at 25 probes a second. MariaDB can run a loop in one statement (``BEGIN NOT ATOMIC``),
so the loop moves into the server: one statement compares the probe's answer with the one
the coordinator last saw, pausing ``PROBE_SECONDS`` between looks, and returns when it
differs or after about a second. The coordinator waits on the connection's socket with
its children's pipes, as it waits on PostgreSQL's LISTEN connection, and wakes only when
something changed (or once a second, to ask again). The server's looks cost what the
probes' queries cost it, and the coordinator's wake-ups and round trips are gone.

MySQL runs compound statements only inside stored programs, which this app does not
create: there the coordinator probes on its timer as before.
"""

from __future__ import annotations

import re
import select
import time
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from ..vendors import ANY_WORKER_NOTICE, PAUSE_NOTICE
from .backoff import QUIET_FACTOR, QUIET_SECONDS

if TYPE_CHECKING:
    from ..store.bridge import Bridge

# How long one waiting statement runs at most before the coordinator asks again: a
# coordinator that dies mid-wait leaves the server looping for this long at most.
WAIT_SECONDS = 1.0
# A statement that has not answered this long after WAIT_SECONDS lost its connection
# without a word (a partition, a server that vanished): the wait gives way to the timer's
# probe, as a broken LISTEN connection does, and is made anew at the next lease renewal.
SILENT_SECONDS = 10.0
# The probe's answer: numbers, '-' for NULL, a time (from the server; checked, as it
# goes back into the next statement's text).
_TOKEN = re.compile(r"[0-9 :.,-]*")


class ChangeWait:
    """A Listener (see :class:`.listening.Listener`) for MariaDB: readable when the change
    probe's answer moved; drain() says whether rows (every worker) or pauses did."""

    def __init__(self, bridge: Bridge, probe_seconds: float) -> None:
        self._vendor, self._probe_seconds = bridge.vendor, probe_seconds
        self._raw = bridge.engine.raw_connection()
        self._conn: Any = self._raw.driver_connection
        assert self._conn is not None  # a fresh connection from the pool always has one
        self._seen: str | None = None
        self._changed_at = self._sent_at = time.monotonic()
        self._closed = False
        try:
            self._conn.autocommit(True)
            self._send("")  # answers at once: the first answer is the baseline
        except Exception as exc:
            self.close()
            raise sa.exc.OperationalError("change wait", None, exc) from exc

    def _send(self, seen: str) -> None:
        quiet = time.monotonic() - self._changed_at >= QUIET_SECONDS
        # (at most WAIT_SECONDS: a large PROBE_SECONDS must not look like silence)
        pause = min(self._probe_seconds * (QUIET_FACTOR if quiet else 1), WAIT_SECONDS)
        rounds = max(1, round(WAIT_SECONDS / pause))
        self._conn.send_query(self._vendor.change_wait_sql(seen, pause, rounds))
        self._sent_at = time.monotonic()

    def fileno(self) -> int:
        return int(self._conn.fileno())

    def drain(self) -> set[str]:
        """Read the statement's answer and send the next one; what changed since the
        last answer (the first answer wakes everything: rows committed while there was
        no wait, after an outage, are claimed now). Raises if the statement has gone
        silent (SILENT_SECONDS)."""
        readable = select.poll()  # (not select(): a file number may be above 1023)
        readable.register(self.fileno(), select.POLLIN)
        if not readable.poll(0):
            if time.monotonic() - self._sent_at > WAIT_SECONDS + SILENT_SECONDS:
                raise ConnectionError(f"no answer from the change wait in "
                                      f"{time.monotonic() - self._sent_at:.0f}s")
            return set()  # (asked because it went silent: reading would block)
        self._conn.read_query_result()
        row = self._conn.store_result().fetch_row()
        while self._conn.next_result() == 0:  # (the compound statement's own status)
            self._conn.store_result()
        answer = row[0][0]
        answer = answer.decode() if isinstance(answer, bytes) else str(answer)
        if not _TOKEN.fullmatch(answer):
            raise ValueError(f"unexpected change probe answer {answer!r}")
        changed: set[str] = set()
        if answer != self._seen:
            self._changed_at = time.monotonic()
            old = (self._seen or "").split(",")
            new = answer.split(",")
            if self._seen is None or new[0] != old[0]:
                changed.add(ANY_WORKER_NOTICE)
            if self._seen is None or new[1:] != old[1:]:
                changed.add(PAUSE_NOTICE)
            self._seen = answer
        self._send(answer)
        return changed

    def heard(self) -> bool:
        return False  # (no statement but the wait runs on this connection)

    @property
    def usable(self) -> bool:
        """False once closed, or silent too long (then the loop's next drain() raises)."""
        return not self._closed and time.monotonic() - self._sent_at <= WAIT_SECONDS + SILENT_SECONDS

    def hears(self, bridge: Bridge, timeout: float = 2.0) -> bool:
        return True  # (the server itself answers: no pooler between can lose it)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            # (a statement in flight: its loop ends in the server within WAIT_SECONDS)
            self._raw.invalidate()
        except Exception:  # noqa: BLE001 - closing a connection that may already be broken
            pass
