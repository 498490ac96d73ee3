"""MySQL 8.0.1+ and MariaDB 10.6+: row triggers, lock-then-claim, no partial indexes.

``MySQL`` holds what the two share (the protocol, mysqlclient, most SQL); ``MariaDB``
says where MariaDB differs: no ``FOR UPDATE OF``, a loop in one statement (the change
wait), and a server that ends a transaction left idle."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .base import (
    EXECUTION_TABLE,
    UnsupportedDatabase,
    Vendor,
    error_code,
    schedule_lock_key,
)

# (alias, database name) -> (charset, collation) of Execution.source_id
_COLLATIONS: dict[tuple[str, str], tuple[str, str]] = {}


class MySQL(Vendor):
    name = "mysql"
    IDENTIFIER_QUOTE = "`"  # (ANSI_QUOTES or not: backticks always quote a name)
    nulls_order_syntax = False
    partial_indexes = False  # NULL keys of non-claimable rows sit apart at the start
    # MariaDB 10.11 reads a recursive step's "key > the last key" as a filter over the
    # worker's whole range of the index, not a probe (measured: 400 ms a claim at 100,000
    # claimable rows); MySQL is not measured, so it walks as MariaDB does.
    recursive_index_probes = False
    sqlalchemy_driver = "mysql+mysqldb"
    DEADLOCK_CODES = {1213, 1205}  # ER_LOCK_DEADLOCK, ER_LOCK_WAIT_TIMEOUT
    # Access denied (to the database, for the user, by auth plugin), unknown database.
    PERMANENT_CONNECT_CODES = {1044, 1045, 1049, 1698}

    def literal(self, value: str) -> str:
        # A backslash escapes the next character in a string constant, unless the
        # session's sql_mode has NO_BACKSLASH_ESCAPES (a trigger keeps the sql_mode it
        # was created with, so the constant means the same when it runs).
        if "\\" in value and "NO_BACKSLASH_ESCAPES" not in self.connection.sql_mode:  # type: ignore[attr-defined]
            value = value.replace("\\", "\\\\")
        return super().literal(value)

    def probe_row(self, connection: Any, sql: str) -> tuple[Any, ...]:
        # mysqlclient's C calls, without its Python cursor: a fifth less CPU per idle
        # probe (measured: 255 against 320 us a probe, wake-up included).
        connection.driver_connection.query(sql)
        return tuple(connection.driver_connection.store_result().fetch_row()[0])

    # MySQL runs compound statements only in stored programs: no change wait in the
    # server (MariaDB's), the change probe polls.
    pushes_changes = False
    PRODUCT = "MySQL"  # as it names itself
    MINIMUM: tuple[int, ...] = (8, 0, 1)  # the oldest version it supports

    def set_idle_timeout(self, cursor: Any, seconds: float) -> Any:
        """Have the server end this session's transaction once it sits idle for
        ``seconds``; returns the setting it replaced (None: the server cannot)."""
        return None

    def index_hint(self, index: str) -> str | None:
        # Measured on MariaDB 10.11 with one worker on a table and 100,000 finished rows:
        # the claimable index has two key values (the worker, NULL), so the optimizer
        # guesses that a fifth of all rows are claimable and walks the primary key in id
        # order for ORDER BY id LIMIT n -- every finished row, 69 ms a claim -- instead of
        # the claimable index, which yields the same order (tests/test_claims.py).
        return f"FORCE INDEX ({index})"

    def is_deadlock(self, exc: BaseException) -> bool:
        return error_code(exc) in self.DEADLOCK_CODES

    def is_permanent_connect_error(self, exc: BaseException) -> bool:
        return error_code(exc) in self.PERMANENT_CONNECT_CODES

    def check_supported(self) -> None:
        version = tuple(self.connection.mysql_version)  # type: ignore[attr-defined]
        if version < self.MINIMUM:
            needed = ".".join(map(str, self.MINIMUM))
            raise UnsupportedDatabase(
                f"{self.PRODUCT} {'.'.join(map(str, version))} has no SKIP LOCKED: "
                f"django-dbworker needs {self.PRODUCT} {needed}+."
            )

    def describe(self) -> str:
        version = ".".join(map(str, self.connection.mysql_version))  # type: ignore[attr-defined]
        return f"{self.PRODUCT} {version}"

    def connect_args(self, given: dict[str, Any]) -> dict[str, Any]:
        # Timeouts: a partition fails the coordinator's statements in seconds (see
        # PostgreSQL's); its own statements are short.
        return {"charset": "utf8mb4", "connect_timeout": 10, "read_timeout": 30,
                "write_timeout": 30, **given}

    def set_autocommit(self, dbapi_connection: Any) -> None:
        dbapi_connection.autocommit(True)  # (mysqlclient's is a method)

    def on_connect(self, dbapi_connection: Any, lease_seconds: float) -> None:
        # As on PostgreSQL: a coordinator frozen inside a claim loses its transaction (and
        # the row locks it holds) after a lease, where the server can (MariaDB). On MySQL
        # such rows wait until the frozen process resumes or dies.
        cursor = dbapi_connection.cursor()
        self.set_idle_timeout(cursor, lease_seconds)
        cursor.close()

    def try_schedule_lock(self, cursor: Any, schedule: str, frozen_after: float) -> bool:
        # A named lock, taken without waiting. It belongs to the session, not to the
        # transaction: end_schedule_lock lets it go after the commit. MariaDB also ends
        # a session left idle in a transaction, as PostgreSQL does; the session's own
        # setting is put back afterwards.
        from django.apps import apps

        ScheduleSlot = apps.get_model("django_dbworker", "ScheduleSlot")  # (the vendors import no models)

        self._session = self.connection.connection
        # A read of an InnoDB table begins the transaction: from here on, MariaDB counts
        # the session as in one (and its idle timeout applies) before the lock is taken.
        cursor.execute(f"SELECT 1 FROM {self.qn(ScheduleSlot._meta.db_table)} LIMIT 1")
        cursor.fetchall()
        self._idle_before = self.set_idle_timeout(cursor, frozen_after)
        # (Named locks are the server's, not a database's: the name says which database.)
        database = self.connection.settings_dict["NAME"]
        name = f"dbworker.schedule.{schedule_lock_key(f'{database}/{schedule}')}"
        cursor.execute("SELECT GET_LOCK(%s, 0)", [name])
        self._held = name if cursor.fetchone()[0] == 1 else None
        return self._held is not None

    def end_schedule_lock(self) -> None:
        session, self._session = getattr(self, "_session", None), None
        if session is None or self.connection.connection is not session:
            return  # nothing taken, or that session is gone, and what it held with it
        held, self._held = getattr(self, "_held", None), None
        idle, self._idle_before = getattr(self, "_idle_before", None), None
        with self.connection.cursor() as cursor:
            if held is not None:
                cursor.execute("SELECT RELEASE_LOCK(%s)", [held])
            if idle is not None:
                cursor.execute("SET SESSION idle_transaction_timeout = %s", [idle])

    def engine_options(self, settings_dict: dict[str, Any]) -> dict[str, Any]:
        # Locking reads under READ COMMITTED lock only the rows they return.
        return {"isolation_level": "READ COMMITTED"}

    def now_sql(self) -> str:
        # Django stores UTC in DATETIME(6) columns; NOW() would be the session's zone.
        return "UTC_TIMESTAMP(6)"

    def plus_seconds_sql(self, column_sql: str, seconds: float) -> str:
        return f"({column_sql} + INTERVAL {round(seconds * 1_000_000)} MICROSECOND)"

    def now_plus_bound(self, seconds: Any) -> Any:
        import sqlalchemy as sa

        return sa.func.timestampadd(sa.literal_column("MICROSECOND"), seconds,
                                    sa.literal_column(self.now_sql()))

    def seconds_value(self, seconds: float) -> Any:
        return round(seconds * 1_000_000)  # microseconds

    def key_needs_cast(self, pk_field: Any) -> bool:
        # UUIDs are char(32) here: already the text form.
        return super().key_needs_cast(pk_field) and pk_field.get_internal_type() != "UUIDField"

    def text_key_sql(self, column_sql: str) -> str:
        # The text must carry source_id's own charset and collation: CAST alone gives the
        # connection's, and comparing two collations is an error ("Illegal mix").
        charset, collation = self._source_id_collation()
        if charset is None:
            return f"CAST({column_sql} AS CHAR)"
        return f"CAST({column_sql} AS CHAR CHARACTER SET {charset}) COLLATE {collation}"

    def _source_id_collation(self) -> tuple[str | None, str | None]:
        key = (self.connection.alias, self.connection.settings_dict["NAME"])
        if key not in _COLLATIONS:
            with self.connection.cursor() as cursor:
                cursor.execute(
                    "SELECT CHARACTER_SET_NAME, COLLATION_NAME FROM information_schema.COLUMNS "
                    "WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = %s "
                    "AND COLUMN_NAME = 'source_id'",
                    [EXECUTION_TABLE],
                )
                row = cursor.fetchone()
            if row is None:
                return None, None  # not migrated yet: do not remember
            _COLLATIONS[key] = (row[0], row[1])
        return _COLLATIONS[key]

    def insert_missing(self, table: Any, rows: list[dict[str, Any]]) -> Any:
        from sqlalchemy.dialects.mysql import insert

        # (As insert_ignore: a no-op update on a duplicate, never IGNORE.)
        statement = insert(table).values(rows)
        first = next(iter(rows[0]))
        return statement.on_duplicate_key_update({first: statement.inserted[first]})

    def insert_ignore(self, table: str, columns: str, select_sql: str) -> str:
        # ON DUPLICATE KEY rather than INSERT IGNORE: IGNORE would also hide real errors.
        return (f"INSERT INTO {self.qn(table)} ({columns}) {select_sql} "
                "ON DUPLICATE KEY UPDATE worker = worker")

    def concat_sql(self, *parts: str) -> str:
        return f"CONCAT({', '.join(parts)})"  # || is OR here

    def changed_columns_sql(self, columns: Sequence[str], changed: Any) -> str:
        # || is OR here; CONCAT it is.
        parts = ", ".join(f"IF({changed(c)}, {self.literal(f'{c}, ')}, '')" for c in columns)
        return f"CONCAT('changed: ', TRIM(TRAILING ', ' FROM CONCAT({parts})))"

    DISTINCT_SQL = "NOT ({a} <=> {b})"
    # information_schema compares names without regard to case: BINARY makes it exact.
    TRIGGER_CATALOG_SQL = ("SELECT TRIGGER_NAME, EVENT_OBJECT_TABLE FROM information_schema."
                           "TRIGGERS WHERE TRIGGER_SCHEMA = DATABASE() "
                           "AND BINARY TRIGGER_NAME IN ({marks})")

    def rerun_trigger_sql(self, name: str, table: str, columns: list[str], condition: str,
                          statement: str) -> str:
        return (f"CREATE TRIGGER {name} AFTER UPDATE ON {table} FOR EACH ROW "
                f"IF {condition} THEN {statement}; END IF")

    def drop_index_sql(self, name: str, table: str) -> str:
        return f"DROP INDEX {self.qn(name)} ON {table}"


def _idle_seconds(lease_seconds: float) -> int:
    # MariaDB's idle_transaction_timeout counts whole seconds; 0 would mean "never".
    return max(round(lease_seconds), 1)


class MariaDB(MySQL):
    name = "mariadb"
    PRODUCT, MINIMUM = "MariaDB", (10, 6)
    row_locks = "rows"  # MariaDB has no FOR UPDATE OF
    # It runs a loop in one statement: the change probe waits in the server (.changewait).
    pushes_changes = True

    def bounded_lock_wait(self, conn: Any, select: Any, seconds: int) -> Any:
        # FOR UPDATE WAIT n (MariaDB 10.3+): error 1205 past it. (MySQL has no such
        # clause: its locking reads wait innodb_lock_wait_timeout, 50 s by default.)
        return select.suffix_with(f"WAIT {int(seconds)}")

    def set_idle_timeout(self, cursor: Any, seconds: float) -> Any:
        cursor.execute("SELECT @@SESSION.idle_transaction_timeout")
        before = cursor.fetchone()[0]
        cursor.execute("SET SESSION idle_transaction_timeout = %s", [_idle_seconds(seconds)])
        return before

    def change_wait_sql(self, seen: str, pause: float, rounds: int) -> str:
        # The change probe's columns as one string ('-' for NULL: CONCAT_WS skips NULLs).
        answer = "SELECT CONCAT_WS(',', " + ", ".join(
            f"IFNULL(({column}), '-')" for column in self.change_probe_columns()) + ")"
        # Read by SELECT ... INTO, a consistent read: a subquery in the WHILE condition
        # is a locking read in a stored program (measured: it waited for an uncommitted
        # insert, and its lock made claims skip the newest row). ``seen``: an earlier
        # answer, digits and punctuation, checked by .changewait.
        return (f"BEGIN NOT ATOMIC DECLARE i INT DEFAULT 0; DECLARE a VARCHAR(255); "
                f"{answer} INTO a; "
                f"WHILE i < {int(rounds)} AND a = {self.literal(seen)} DO "
                f"DO SLEEP({float(pause)!r}); {answer} INTO a; SET i = i + 1; END WHILE; "
                f"SELECT a; END")
