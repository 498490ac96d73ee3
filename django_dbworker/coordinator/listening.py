"""How an idle coordinator hears of new rows at once: PostgreSQL's LISTEN, or MariaDB's
change wait in the server (changewait.py); elsewhere it looks every PROBE_SECONDS.
"""

from __future__ import annotations

import secrets
import select
import time
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from .. import conf
from ..store.engine import engine_for
from ..vendors import NOTIFY_CHANNEL
from .changewait import ChangeWait

if TYPE_CHECKING:
    from ..store.bridge import Bridge


class Listener:
    """PostgreSQL LISTEN on the channel the pending-row triggers NOTIFY: wakes an idle
    coordinator the moment a row is inserted, instead of at its next poll. It listens on
    a connection of its own, from DBWORKER["LISTEN_DATABASE"] when that names another
    alias (a direct connection, when the claims go through PgBouncer); on the claims'
    own alias, claims run on that connection too (Bridge._run_raw)."""

    def __init__(self, engine: Engine, channel: str) -> None:
        # Raw DBAPI connections raise psycopg's errors, not SQLAlchemy's: wrap them so
        # the coordinator's outage handling (DATABASE_ERRORS) sees them as outages.
        self.channel = channel
        try:
            self._raw = engine.raw_connection()
            conn = self._raw.driver_connection
            assert conn is not None  # a fresh connection from the pool always has one
            self._conn: Any = conn
            self._conn.autocommit = True
            # Notifications that arrive while a statement runs on this connection (a
            # claim: see run()) are read by psycopg with its result, not left on the
            # socket: they are kept here, and the watcher sees them (heard()).
            self._heard: set[str] = set()
            self._conn.add_notify_handler(lambda notify: self._heard.add(notify.payload))
            self._conn.execute(f"LISTEN {channel}")
        except engine.dialect.loaded_dbapi.Error as exc:
            raise sa.exc.OperationalError(f"LISTEN {channel}", None, exc) from exc

    def fileno(self) -> int:
        return int(self._conn.pgconn.socket)

    def drain(self) -> set[str]:
        """Worker names notified since the last call (never blocks)."""
        pgconn = self._conn.pgconn
        pgconn.consume_input()
        names, self._heard = self._heard, set()
        while (notify := pgconn.notifies()) is not None:
            names.add(notify.extra.decode())
        return names

    def heard(self) -> bool:
        """Whether notifications wait in drain() that the socket no longer shows."""
        return bool(self._heard)

    @property
    def usable(self) -> bool:
        return not self._conn.closed and not self._conn.broken  # (closed: by close())

    def run(self, sql: str, params: dict[str, Any]) -> list[Any]:
        """One statement in autocommit on this connection, its rows; the driver's errors."""
        with self._conn.cursor() as cursor:
            cursor.execute(sql, params)
            return cursor.fetchall()

    def hears(self, bridge: Bridge, timeout: float = 2.0) -> bool:
        """Whether a NOTIFY sent the way claims go reaches this connection. Through
        PgBouncer in transaction mode it does not: LISTEN ran on a server connection the
        pool has since given to someone else."""

        probe = f".probe-{secrets.token_hex(4)}"
        with bridge.engine.begin() as conn:
            conn.execute(sa.text("SELECT pg_notify(:channel, :payload)"),
                         {"channel": self.channel, "payload": probe})
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            select.select([self], [], [], left)
            if probe in self.drain():
                return True
        return False

    def close(self) -> None:
        if self._conn.closed:
            return  # (closed already: invalidating again only warns)
        try:
            self._raw.invalidate()
        except Exception:  # noqa: BLE001 - closing a connection that may already be broken
            pass


def listener_for(bridge: Bridge, probe_seconds: float) -> Listener | ChangeWait | None:
    """A Listener, on DBWORKER["LISTEN_DATABASE"] (default: the coordination database);
    on MariaDB a ChangeWait (looking every probe_seconds in the server)."""
    if not bridge.vendor.notifies:
        return ChangeWait(bridge, probe_seconds) if bridge.vendor.pushes_changes else None
    alias = conf.value("LISTEN_DATABASE") or bridge.alias
    if alias == bridge.alias:
        # Claims run on it too: a claim answers the NOTIFY it just received. (Not on a
        # LISTEN_DATABASE of its own: that alias connects past the pooler claims go through.)
        bridge.claim_listener = Listener(bridge.engine, NOTIFY_CHANNEL)
        return bridge.claim_listener
    if bridge.listen_engine is None:
        bridge.listen_engine = engine_for(alias, bridge.lease_seconds, pool_size=1, max_overflow=0)
    return Listener(bridge.listen_engine, NOTIFY_CHANNEL)
