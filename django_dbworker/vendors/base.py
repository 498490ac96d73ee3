"""What every database provides, and the pieces that are the same everywhere.

A vendor is chosen once per connection (``vendors.for_connection``); the rest of the
package asks it for SQL (trigger DDL, from triggers.py; the database clock; key
conversion), for how its claims are made (its claim operation, claiming.py) and how its
connections are set up, instead of testing database names. Plain SQL strings and DBAPI
calls only: the store's SQLAlchemy engine wraps them, Django runs the DDL.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from django.core.exceptions import ImproperlyConfigured

from .names import (  # re-exported: the vendors' modules and the package read them here
    ANY_WORKER_NOTICE,
    EXECUTION_TABLE,
    NOTIFY_CHANNEL,
    PAUSE_NOTICE,
    PAUSE_TABLE,
    TEXT_KEY_TYPES,
)
from .triggers import TRIGGER_NAME, TriggerDDL, TriggerNames, TriggerSource

__all__ = ["ANY_WORKER_NOTICE", "EXECUTION_TABLE", "NOTIFY_CHANNEL", "PAUSE_NOTICE", "PAUSE_TABLE",
           "TEXT_KEY_TYPES", "TRIGGER_NAME", "Bound", "TriggerNames", "TriggerSource",
           "UnsupportedDatabase", "Vendor", "driver_error", "error_code", "orm_sql",
           "schedule_lock_key"]

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper


class UnsupportedDatabase(ImproperlyConfigured):
    pass


# Where a bound parameter goes in a runtime statement while it is built (see Bound): NUL
# is in no name and no value that reaches SQL (quote_name and literal refuse it).
_PLACE = re.compile("\x00(\\d+)\x00")


class Bound:
    """The parameters of one runtime statement, collected while its SQL is built.

    ``bound(value)`` stands where ``value`` goes; ``bound.statement(sql)`` is the
    (sql, params) pair for ``cursor.execute()``, in the order the values appear. Every
    other ``%`` of the SQL is doubled: the drivers read ``%`` as the start of a
    placeholder whenever parameters are given, and a name may contain one.
    """

    def __init__(self) -> None:
        self.values: list[Any] = []

    def __call__(self, value: Any) -> str:
        self.values.append(value)
        return f"\x00{len(self.values) - 1}\x00"

    def statement(self, sql: str) -> tuple[str, list[Any]]:
        params: list[Any] = []

        def place(match: re.Match[str]) -> str:
            params.append(self.values[int(match.group(1))])
            return "%s"

        return _PLACE.sub(place, sql.replace("%", "%%")), params


def driver_error(exc: BaseException) -> BaseException:
    """The database driver's own exception behind SQLAlchemy's or Django's wrapper."""
    inner = getattr(exc, "orig", None) or exc.__cause__
    return inner if isinstance(inner, BaseException) else exc


def error_code(exc: BaseException) -> Any:
    """The server's error number (MySQL) of a failure, if it has one."""
    args = driver_error(exc).args
    return args[0] if args and isinstance(args[0], int) else None


def schedule_lock_key(schedule: str) -> int:
    """A stable signed 32-bit number for a schedule's name (an advisory lock key)."""
    return int.from_bytes(hashlib.blake2b(schedule.encode(), digest_size=4).digest(), "big",
                          signed=True)


class Vendor(TriggerDDL):
    name = ""
    claim_mode = "FOR UPDATE SKIP LOCKED"
    # Row locks on a SELECT: "of_table" (FOR UPDATE OF the Execution table only),
    # "rows" (FOR UPDATE: every table read), or "" (no row locks at all).
    row_locks = "of_table"
    # Whether a recursive CTE's step can probe an index with the value the step before
    # gave it (a fair claim's walk of keys in one statement; else one statement a key).
    recursive_index_probes = True
    # The engine commits each statement (SQLite): writes that must commit together say
    # BEGIN IMMEDIATE ... COMMIT themselves (Bridge.writing).
    autocommit_engine = False
    # Whether pickup can be woken by the database (LISTEN/NOTIFY).
    notifies = False
    # Whether the eligibility EXISTS needs OFFSET 0 to stay a per-row probe. PostgreSQL
    # otherwise turns it into a semi-join, and for a custom order (no early stop at the
    # LIMIT) hashes the whole source table: claim cost would grow with history.
    fence_exists = False
    # Whether ORDER BY accepts NULLS FIRST/LAST (else the bridge emulates it).
    nulls_order_syntax = True
    # Which SQLAlchemy dialect+driver talks to it.
    sqlalchemy_driver = ""
    partial_indexes = True

    # How this database quotes an identifier (MySQL: backticks).
    IDENTIFIER_QUOTE = '"'

    def __init__(self, connection: BaseDatabaseWrapper) -> None:
        self.connection = connection
        self.qn = self.quote_name

    # -- names and values in SQL --------------------------------------------------------
    # Every name this app writes into SQL goes through quote_name, every constant string
    # into DDL (trigger bodies, which take no parameters) through literal; statements run
    # at run time take values as bound parameters (Bound). tests/test_hostile_names.py.
    def quote_name(self, name: str) -> str:
        """``name`` as one quoted identifier, whatever it contains.

        Not Django's ``ops.quote_name``: that one neither doubles the quote character
        inside a name nor quotes a name that already starts and ends with it, so a
        ``db_table`` or ``db_column`` holding one would end the identifier early.
        """
        q = self.IDENTIFIER_QUOTE
        return q + _no_nul(name, "a name").replace(q, q + q) + q

    def literal(self, value: str) -> str:
        """``value`` as an SQL string constant, for DDL only: quotes doubled."""
        return "'" + _no_nul(value, "a value").replace("'", "''") + "'"

    def bounded_lock_wait(self, conn: Any, select: Any, seconds: int) -> Any:
        """``select`` (a locking read that waits) made to give up after ``seconds`` with
        the database's lock-timeout error, which the coordinator retries as contention:
        a frozen holder of the lock must not hang every claimer. Here: unbounded (the
        server's own lock wait timeout)."""
        return select

    def index_hint(self, index: str) -> str | None:
        """A table hint that makes a claim read ``index`` (None: the planner's choice)."""
        return None

    # -- errors --------------------------------------------------------------------------
    def is_lock_contention(self, exc: BaseException) -> bool:
        """Whether a failed statement only met another writer's lock (wait and retry),
        rather than a database that went away."""
        return False

    def is_deadlock(self, exc: BaseException) -> bool:
        """Whether a failed statement lost a deadlock (or a lock wait) to another
        transaction: contention, retried at once, never an outage."""
        return False

    def is_permanent_connect_error(self, exc: BaseException) -> bool:
        """Whether a failed connection will fail again however long one waits (a wrong
        password, a database that does not exist), unlike a server that is not up yet."""
        return False

    # -- schedules ------------------------------------------------------------------------
    def try_schedule_lock(self, cursor: Any, schedule: str, frozen_after: float) -> bool:
        """In a schedule slot's transaction, before its INSERT: take the schedule's lock
        without waiting. False means another coordinator is enqueueing that schedule right
        now; the caller looks again shortly instead of waiting on its uncommitted row
        (which, were that coordinator frozen or cut off, would hold up every loop that
        waits). Where the server can, the transaction is also ended by the server once it
        sits idle for ``frozen_after`` seconds, so a frozen holder lets go after a lease."""
        return True  # SQLite: one writer at a time; the slot INSERT takes the write lock

    def end_schedule_lock(self) -> None:
        """After the slot's transaction ended, whatever became of it: undo what
        try_schedule_lock did that outlives a transaction (on the same session only)."""

    # -- the server ------------------------------------------------------------------------
    def check_supported(self) -> None:
        """Raise UnsupportedDatabase naming the fix when this server cannot run workers."""

    def describe(self) -> str:
        return self.name

    @classmethod
    def settings_problem(cls, alias: str, settings_dict: dict[str, Any]) -> tuple[str, str] | None:
        """(message, hint) when a DATABASES entry cannot work, found without connecting."""
        return None

    @classmethod
    def prepare_child_settings(cls, settings_dict: dict[str, Any]) -> None:
        """Adjust a child's DATABASES entry before its first connection."""

    # -- the coordinator's connections (see the bridge) -----------------------------------
    def url_parts(self, settings_dict: dict[str, Any]) -> dict[str, Any]:
        """Keyword arguments of SQLAlchemy's URL.create() for a DATABASES entry."""
        sd = settings_dict
        return {"username": sd.get("USER") or None, "password": sd.get("PASSWORD") or None,
                "host": sd.get("HOST") or None,
                "port": int(sd["PORT"]) if sd.get("PORT") else None,
                "database": sd.get("NAME")}

    def connect_args(self, given: dict[str, Any]) -> dict[str, Any]:
        """The coordinator's driver options, from those of the DATABASES entry."""
        return given

    def engine_options(self, settings_dict: dict[str, Any]) -> dict[str, Any]:
        """Extra create_engine() options for the coordinator."""
        return {}

    def on_connect(self, dbapi_connection: Any, lease_seconds: float) -> None:
        """Run on every new coordinator connection."""

    def claim_operation(self, ordered: bool) -> Any:
        """How this database claims (vendors/claiming.py); ``ordered``: in an eligible()
        order of the user's, not creation order."""
        from .claiming import LockThenUpdate

        return LockThenUpdate()

    def set_autocommit(self, dbapi_connection: Any) -> None:
        """Put a raw driver connection in autocommit (psycopg's attribute; the others
        say theirs)."""
        dbapi_connection.autocommit = True

    # -- a child's transaction, as the driver knows it (savepoints.py) ---------------------
    # Whether transaction_state() can tell, with no round trip, if a handler left the
    # transaction open, ended or aborted.
    tells_transaction_state = False

    def transaction_state(self, dbapi_connection: Any) -> str | None:
        """"open", "ended", "aborted" or "busy"; None where the driver cannot tell."""
        return None

    def transaction_settings(self, lease_seconds: float) -> tuple[str, tuple[Any, ...]] | None:
        """A statement (and its parameters) that each coordinator transaction runs first,
        for settings on_connect cannot make for the session; None (the usual case): none."""
        return None

    # -- the database clock (leases compare against it, never a machine's clock) --------
    def now_sql(self) -> str:
        raise NotImplementedError

    def now_plus_sql(self, seconds: float) -> str:
        return self.plus_seconds_sql(self.now_sql(), seconds)

    def now_expression(self, seconds: float | None = None) -> Any:
        """The database's now (plus ``seconds``), as an ORM expression."""
        from django.db.models import DateTimeField
        from django.db.models.expressions import RawSQL

        sql = self.now_sql() if seconds is None else self.now_plus_sql(seconds)
        return RawSQL(orm_sql(sql), [], output_field=DateTimeField())

    def plus_seconds_sql(self, column_sql: str, seconds: float) -> str:
        """A timestamp column plus a number of seconds."""
        raise NotImplementedError

    def now_plus_bound(self, seconds: Any) -> Any:
        """The database's now plus a number of seconds that is the bound parameter
        ``seconds`` (SQLAlchemy), its value given by seconds_value(): one statement text
        whatever the seconds (store/transitions.py's prepared statements)."""
        raise NotImplementedError

    def seconds_value(self, seconds: float) -> Any:
        """The value of a now_plus_bound() parameter for ``seconds``."""
        return float(seconds)

    # -- source keys: the one place they are converted -------------------------------------
    def text_key_sql(self, column_sql: str) -> str:
        """The source key as text: what Execution.source_id holds, the same text
        api.source_key() computes in Python."""
        return f"CAST({column_sql} AS CHAR)"

    def key_needs_cast(self, pk_field: Any) -> bool:
        """Whether Execution.source_id (text) must be cast to compare with the source key."""
        return pk_field.get_internal_type() not in TEXT_KEY_TYPES

    def key_from_text_sql(self, pk_field: Any, text_sql: str) -> str:
        """The stored text key turned back into the source key's type, so that the
        source's primary-key index serves the comparison (the cast sits on the Execution
        side)."""
        if not self.key_needs_cast(pk_field):
            return text_sql
        return f"CAST({text_sql} AS {pk_field.cast_db_type(self.connection)})"

    def change_probe_sql(self) -> str:
        """A statement cheap enough to run every PROBE_SECONDS where the database cannot
        notify: its first column changes when rows are inserted (new work), the others
        when a worker is paused or resumed (a pause's time is that of its new row)."""
        return "SELECT " + ", ".join(f"({column})" for column in self.change_probe_columns())

    def change_probe_columns(self) -> list[str]:
        """The change probe's columns, one subquery each (see change_probe_sql)."""
        pauses = self.qn(PAUSE_TABLE)
        return [self.new_rows_sql(), f"SELECT COUNT(*) FROM {pauses}",
                f"SELECT MAX(paused_at) FROM {pauses}"]

    def new_rows_sql(self) -> str:
        """The change probe's first column: one read of the primary key's end."""
        return f"SELECT MAX(id) FROM {self.qn(EXECUTION_TABLE)}"

    def probe_row(self, connection: Any, sql: str) -> tuple[Any, ...]:
        """Run one probe statement on the probe's raw DB-API connection; its one row."""
        cursor = connection.cursor()
        try:
            cursor.execute(sql)
            return tuple(cursor.fetchone())
        finally:
            cursor.close()

    def unchanged_probe_sql(self) -> str | None:
        """Where one cheaper statement answers the probe's first column by itself, and
        that column changes with every commit (so with the pauses too): the probe runs
        it first, and the whole probe only when its answer moved."""
        return None

    @property
    def pushes_changes(self) -> bool:
        """Whether a connection can wait for new rows and pauses to be announced: NOTIFY,
        or a statement that returns when the change probe's answer moves."""
        return self.notifies

    def change_wait_sql(self, seen: str, pause: float, rounds: int) -> str:
        """One statement that returns the change probe's answer as one string once it
        differs from ``seen``, or after ``rounds`` looks ``pause`` seconds apart."""
        raise NotImplementedError(f"{self.name} cannot wait for changes in the server")

    def change_doorbell(self) -> Any | None:
        """Where there is no NOTIFY: something the coordinator can wait on (a ``fileno()``
        and ``rang()``, see :mod:`..doorbell`) that is readable when the database may have
        changed, so the change probe runs then and not on a fast timer. None: no such
        thing (a server over the network), probe on the timer."""
        return None

    def notify_sql(self, payload: str) -> tuple[str, list[Any]] | None:
        """A statement (and its parameters) waking every coordinator with ``payload``,
        if the database can."""
        return None

    def false_sql(self) -> str:
        return "FALSE"

    def concat_sql(self, *parts: str) -> str:
        return " || ".join(parts)

    def insert_ignore(self, table: str, columns: str, select_sql: str) -> str:
        raise NotImplementedError

    def insert_missing(self, table: Any, rows: list[dict[str, Any]]) -> Any:
        """An INSERT (SQLAlchemy Core) of ``rows`` into ``table`` that skips a row whose
        unique key is there already, and fails on any other error."""
        raise NotImplementedError

    def update_rows(self, cursor: Any, table: str, columns: Sequence[tuple[str, str]],
                    key: tuple[str, str], rows: Sequence[Sequence[Any]]) -> None:
        """Set ``columns`` of several rows, each row to values of its own. ``columns`` and
        ``key`` are (column, database type) pairs; each of ``rows`` holds its values in
        column order, then its key. Here one UPDATE per row, sent by executemany()
        (mysqlclient sends them one by one; SQLite has no round trips to spare)."""
        sets = ", ".join(f"{self.qn(c)} = %s" for c, _ in columns)
        sql = f"UPDATE {self.qn(table)} SET {sets} WHERE {self.qn(key[0])} = %s"
        if len(rows) == 1:
            cursor.execute(sql, rows[0])
        else:
            cursor.executemany(sql, rows)

    # -- indexes ---------------------------------------------------------------------------
    def partial_index_sql(self, name: str, table: str, columns: str, where_column: str) -> str:
        """An index of the rows whose ``where_column`` is not NULL (a plain one where the
        database has no partial indexes: NULL keys then sit apart, unread by lookups of
        a value). ``table`` comes quoted, ``columns`` and ``where_column`` are SQL (the
        migrations' own constants); the index name is quoted here."""
        if not self.partial_indexes:
            return f"CREATE INDEX {self.qn(name)} ON {table} ({columns})"
        return (f"CREATE INDEX {self.qn(name)} ON {table} ({columns}) "
                f"WHERE {where_column} IS NOT NULL")

    def drop_index_sql(self, name: str, table: str) -> str:
        return f"DROP INDEX IF EXISTS {self.qn(name)}"

    # -- the clock, read --------------------------------------------------------------------
    def current_time(self) -> datetime:
        """Now on the database's clock, as an aware UTC datetime (one round trip): what
        the app compares with times it wrote there, never a machine's own clock."""
        with self.connection.cursor() as cursor:
            cursor.execute(f"SELECT {self.now_sql()}")
            value = cursor.fetchone()[0]
        if isinstance(value, str):  # (SQLite's clock is text)
            value = datetime.fromisoformat(value)
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def orm_sql(sql: str) -> str:
    """Vendor SQL made fit for the ORM's raw expressions: Django formats the SQL of a
    query with its parameters (``%s``), so a literal ``%`` (SQLite's strftime) is
    doubled; unescaped, it broke the query under DEBUG (which formats it to log it)."""
    return sql.replace("%", "%%")


def _no_nul(text: str, what: str) -> str:
    # No database stores NUL in a name, and a driver may cut a statement at one.
    if "\x00" in text:
        raise ValueError(f"{what} for SQL contains a NUL character: {text!r}")
    return text
