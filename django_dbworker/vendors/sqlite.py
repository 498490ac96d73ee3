"""SQLite 3.35+ in a file: one writer at a time, claims under BEGIN IMMEDIATE."""

from __future__ import annotations

import sqlite3
from typing import Any

from ..coordinator.doorbell import file_doorbell
from .base import UnsupportedDatabase, Vendor


class SQLite(Vendor):
    name = "sqlite"
    # SQLite has one writer at a time: BEGIN IMMEDIATE takes the write lock before the
    # claim reads, and its UPDATE re-checks claimability anyway (the guard).
    claim_mode = "conditional UPDATE"
    row_locks = ""
    autocommit_engine = True
    sqlalchemy_driver = "sqlite"

    def is_lock_contention(self, exc: BaseException) -> bool:
        # One writer at a time: a handler's open transaction holds the lock.
        return "database is locked" in str(exc)

    def is_permanent_connect_error(self, exc: BaseException) -> bool:
        return True  # a file: no server that might come up later

    def check_supported(self) -> None:
        if self.connection.is_in_memory_db():  # type: ignore[attr-defined]
            raise UnsupportedDatabase(
                "SQLite in memory cannot be shared with child processes: set "
                "DATABASES[...]['NAME'] to a file path (e.g. BASE_DIR / 'db.sqlite3')."
            )
        if sqlite3.sqlite_version_info < (3, 35):
            raise UnsupportedDatabase(
                f"SQLite {sqlite3.sqlite_version} has no RETURNING: django-dbworker needs 3.35+."
            )

    def change_doorbell(self) -> Any | None:
        # Every commit of another process writes the database's files: the kernel says so.
        return file_doorbell(self.connection.settings_dict["NAME"])

    def describe(self) -> str:
        return f"SQLite {sqlite3.sqlite_version} ({self.connection.settings_dict['NAME']})"

    @classmethod
    def settings_problem(cls, alias: str, settings_dict: dict[str, Any]) -> tuple[str, str] | None:
        name = str(settings_dict.get("NAME") or "")
        if name in ("", ":memory:") or "mode=memory" in name:
            return (f"DATABASES[{alias!r}] is an in-memory SQLite database, which child "
                    "processes cannot share.",
                    "Set NAME to a file path, e.g. BASE_DIR / 'db.sqlite3'.")
        return None

    @classmethod
    def prepare_child_settings(cls, settings_dict: dict[str, Any]) -> None:
        # A handler reads, then writes; under BEGIN DEFERRED the upgrade to a write lock
        # fails at once ("database is locked") when another process wrote in between.
        # BEGIN IMMEDIATE takes the lock up front and waits for it instead.
        options = settings_dict.setdefault("OPTIONS", {})
        options.setdefault("transaction_mode", "IMMEDIATE")
        options.setdefault("timeout", 20)

    def url_parts(self, settings_dict: dict[str, Any]) -> dict[str, Any]:
        return {"database": str(settings_dict["NAME"])}

    def connect_args(self, given: dict[str, Any]) -> dict[str, Any]:
        # Short: while a handler runs it holds SQLite's only write lock, and a coordinator
        # stuck waiting for it would not react to signals; a failed write is retried.
        # (Set, not defaulted: the DATABASES timeout is for the children.)
        return {**given, "timeout": 1.0, "check_same_thread": False}

    def engine_options(self, settings_dict: dict[str, Any]) -> dict[str, Any]:
        # One statement, one transaction; multi-statement claims say BEGIN IMMEDIATE.
        return {"isolation_level": "AUTOCOMMIT"}

    tells_transaction_state = True

    def claim_operation(self, ordered: bool) -> Any:
        from .claiming import OneWriterThenUpdate

        return OneWriterThenUpdate()

    def transaction_state(self, dbapi_connection: Any) -> str | None:
        return "open" if dbapi_connection.in_transaction else "ended"

    def set_autocommit(self, dbapi_connection: Any) -> None:
        dbapi_connection.isolation_level = None  # sqlite3's autocommit

    def on_connect(self, dbapi_connection: Any, lease_seconds: float) -> None:
        # WAL lets children read while the coordinator writes (and the reverse); it is a
        # property of the database file, so setting it once is enough.
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.close()

    # Django writes SQLite datetimes as UTC text 'YYYY-MM-DD HH:MM:SS.ffffff'; this sorts
    # and compares with it as text.
    def now_sql(self) -> str:
        return "strftime('%Y-%m-%d %H:%M:%f', 'now')"

    def now_plus_sql(self, seconds: float) -> str:
        return f"strftime('%Y-%m-%d %H:%M:%f', 'now', '{float(seconds):+.3f} seconds')"

    def now_plus_bound(self, seconds: Any) -> Any:
        import sqlalchemy as sa

        return sa.func.strftime(sa.literal_column("'%Y-%m-%d %H:%M:%f'"), sa.literal_column("'now'"),
                                seconds)

    def seconds_value(self, seconds: float) -> Any:
        return f"{float(seconds):+.3f} seconds"

    def plus_seconds_sql(self, column_sql: str, seconds: float) -> str:
        return f"strftime('%Y-%m-%d %H:%M:%f', {column_sql}, '{float(seconds):+.3f} seconds')"

    def false_sql(self) -> str:
        return "0"

    def new_rows_sql(self) -> str:
        # Changes whenever another connection commits to the file: no table is read.
        return "SELECT data_version FROM pragma_data_version()"

    def unchanged_probe_sql(self) -> str | None:
        # No table and no read transaction: a quarter less CPU per idle probe.
        return "PRAGMA data_version"

    def key_needs_cast(self, pk_field: Any) -> bool:
        return super().key_needs_cast(pk_field) and pk_field.get_internal_type() != "UUIDField"

    def text_key_sql(self, column_sql: str) -> str:
        return f"CAST({column_sql} AS TEXT)"

    def insert_missing(self, table: Any, rows: list[dict[str, Any]]) -> Any:
        from sqlalchemy.dialects.sqlite import insert

        return insert(table).values(rows).on_conflict_do_nothing()

    def insert_ignore(self, table: str, columns: str, select_sql: str) -> str:
        return f"INSERT OR IGNORE INTO {self.qn(table)} ({columns}) {select_sql}"

    ROW_TRIGGER_BODY = "BEGIN {statement}; END"
    DISTINCT_SQL = "{a} IS NOT {b}"
    # sqlite_master compares names byte for byte (BINARY collation): exact.
    TRIGGER_CATALOG_SQL = ("SELECT name, tbl_name FROM sqlite_master WHERE type = 'trigger' "
                           "AND name IN ({marks})")

    def rerun_trigger_sql(self, name: str, table: str, columns: list[str], condition: str,
                          statement: str) -> str:
        return (f"CREATE TRIGGER {name} AFTER UPDATE OF {', '.join(columns)} ON {table} "
                f"FOR EACH ROW WHEN {condition} BEGIN {statement}; END")
