"""Everything that differs between PostgreSQL, MySQL/MariaDB and SQLite, chosen once.

``for_connection(connection)`` picks the class; the rest of the package asks it for SQL
fragments (trigger DDL, the database clock, lease arithmetic) instead of testing vendor
names. Plain SQL strings only: the SQLAlchemy bridge wraps them, Django runs the DDL.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django.core.exceptions import ImproperlyConfigured

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper

    from .registry import Worker

TRIGGER_PREFIX = "dbworker_"
EXECUTION_TABLE = "django_dbworker_execution"
_COLLATIONS: dict[tuple[str, str], tuple[str, str]] = {}
TEXT_KEY_TYPES = {"CharField", "TextField", "SlugField", "EmailField", "URLField"}
NOTIFY_CHANNEL = "dbworker"


class UnsupportedDatabase(ImproperlyConfigured):
    pass


@dataclass(frozen=True)
class TriggerNames:
    insert: str
    delete: str
    update: str

    @classmethod
    def of(cls, worker_name: str) -> TriggerNames:
        base = f"{TRIGGER_PREFIX}{worker_name}"
        return cls(insert=f"{base}_ins", delete=f"{base}_del", update=f"{base}_upd")


class Vendor:
    name = ""
    claim_mode = "FOR UPDATE SKIP LOCKED"
    # Whether SELECT ... FOR UPDATE OF <table> exists (lock only the Execution rows).
    lock_of_table = True
    # Whether pickup can be woken by the database (LISTEN/NOTIFY).
    notifies = False
    # Whether the eligibility EXISTS needs OFFSET 0 to stay a per-row probe. PostgreSQL
    # otherwise turns it into a semi-join, and for a custom order (no early stop at the
    # LIMIT) hashes the whole source table: claim cost would grow with history.
    fence_exists = False

    def is_lock_contention(self, exc: BaseException) -> bool:
        """Whether a failed statement only met another writer's lock (wait and retry),
        rather than a database that went away."""
        return False

    def __init__(self, connection: BaseDatabaseWrapper) -> None:
        self.connection = connection
        self.qn = connection.ops.quote_name

    # -- the database clock (leases compare against it, never a machine's clock) --
    def now_sql(self) -> str:
        raise NotImplementedError

    def now_plus_sql(self, seconds: float) -> str:
        raise NotImplementedError

    # -- triggers: a PENDING Execution row for every source row --
    def text_key_sql(self, column_sql: str) -> str:
        """The source key as text, the same text api.source_key() computes in Python."""
        return f"CAST({column_sql} AS CHAR)"

    def insert_ignore(self, table: str, columns: str, select_sql: str) -> str:
        raise NotImplementedError

    def create_trigger_sql(self, worker: Worker, execution_table: str) -> list[str]:
        raise NotImplementedError

    def drop_trigger_sql(self, trigger: str, table: str) -> list[str]:
        raise NotImplementedError

    def installed_triggers_sql(self) -> str:
        """SELECT (trigger name, table name) of every trigger this app installed."""
        raise NotImplementedError

    @staticmethod
    def claimable_index_sql(name: str, table: str) -> str:
        """The index claims read: claimable rows only, in creation order per worker."""
        return (f"CREATE INDEX {name} ON {table} (claimable_worker, id) "
                "WHERE claimable_worker IS NOT NULL")

    def check_supported(self) -> None:
        """Raise UnsupportedDatabase naming the fix when this server cannot run workers."""

    def describe(self) -> str:
        return self.name

    def key_needs_cast(self, pk_field: Any) -> bool:
        """Whether Execution.source_id (text) must be cast to compare with the source key."""
        return pk_field.get_internal_type() not in TEXT_KEY_TYPES

    # Whether ORDER BY accepts NULLS FIRST/LAST (else the bridge emulates it).
    nulls_order_syntax = True

    # Shared pieces ---------------------------------------------------------------------
    def pending_row_values(self, worker: Worker, key_sql: str) -> str:
        now = self.now_sql()
        return f"'{worker.name}', {key_sql}, 'pending', 0, {now}, {now}"

    EXECUTION_COLUMNS = "worker, source_id, status, attempts, created_at, updated_at"


class PostgreSQL(Vendor):
    name = "postgresql"
    notifies = True
    fence_exists = True

    def now_sql(self) -> str:
        return "now()"

    def now_plus_sql(self, seconds: float) -> str:
        return f"(now() + interval '{float(seconds):.6f} seconds')"

    def text_key_sql(self, column_sql: str) -> str:
        return f"CAST({column_sql} AS text)"

    def insert_ignore(self, table: str, columns: str, select_sql: str) -> str:
        return (
            f"INSERT INTO {self.qn(table)} ({columns}) {select_sql} "
            "ON CONFLICT (worker, source_id) DO NOTHING"
        )

    def create_trigger_sql(self, worker: Worker, execution_table: str) -> list[str]:
        names = TriggerNames.of(worker.name)
        table, pk = self.qn(worker.table), self.qn(worker.pk_column)
        ex = self.qn(execution_table)
        key = self.text_key_sql(f"n.{pk}")
        # Statement-level triggers with transition tables: one INSERT ... SELECT per
        # statement, so bulk_create of 10,000 rows costs one trigger call, not 10,000.
        insert = self.insert_ignore(
            execution_table,
            self.EXECUTION_COLUMNS,
            f"SELECT {self.pending_row_values(worker, key)} FROM new_rows n",
        )
        return [
            f"""CREATE OR REPLACE FUNCTION {names.insert}() RETURNS trigger LANGUAGE plpgsql AS $f$
BEGIN
  {insert};
  PERFORM pg_notify('{NOTIFY_CHANNEL}', '{worker.name}');
  RETURN NULL;
END $f$""",
            f"DROP TRIGGER IF EXISTS {names.insert} ON {table}",
            f"CREATE TRIGGER {names.insert} AFTER INSERT ON {table} "
            f"REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION {names.insert}()",
            # Removed source rows take their history along, except a row a handler holds:
            # that one ends FAILED (source deleted) when the child cannot load it.
            f"""CREATE OR REPLACE FUNCTION {names.delete}() RETURNS trigger LANGUAGE plpgsql AS $f$
BEGIN
  DELETE FROM {ex} e USING old_rows o
   WHERE e.worker = '{worker.name}' AND e.source_id = {self.text_key_sql(f"o.{pk}")}
     AND e.status <> 'working';
  RETURN NULL;
END $f$""",
            f"DROP TRIGGER IF EXISTS {names.delete} ON {table}",
            f"CREATE TRIGGER {names.delete} AFTER DELETE ON {table} "
            f"REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION {names.delete}()",
            # An UPDATE can make a row eligible (uploaded = true): wake idle coordinators.
            f"""CREATE OR REPLACE FUNCTION {names.update}() RETURNS trigger LANGUAGE plpgsql AS $f$
BEGIN
  PERFORM pg_notify('{NOTIFY_CHANNEL}', '{worker.name}');
  RETURN NULL;
END $f$""",
            f"DROP TRIGGER IF EXISTS {names.update} ON {table}",
            f"CREATE TRIGGER {names.update} AFTER UPDATE ON {table} "
            f"FOR EACH STATEMENT EXECUTE FUNCTION {names.update}()",
        ]

    def drop_trigger_sql(self, trigger: str, table: str) -> list[str]:
        return [
            f"DROP TRIGGER IF EXISTS {trigger} ON {self.qn(table)}",
            f"DROP FUNCTION IF EXISTS {trigger}()",
        ]

    def installed_triggers_sql(self) -> str:
        return (
            "SELECT t.tgname, c.relname FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid "
            "JOIN pg_namespace n ON n.oid = c.relnamespace "
            f"WHERE NOT t.tgisinternal AND t.tgname LIKE '{TRIGGER_PREFIX}%' "
            "AND n.nspname = ANY(current_schemas(false))"
        )

    def check_supported(self) -> None:
        version = self.connection.pg_version  # type: ignore[attr-defined]
        if version < 130000:
            raise UnsupportedDatabase(
                f"PostgreSQL {version // 10000} is too old: django-dbworker needs PostgreSQL 13+."
            )

    def describe(self) -> str:
        v = self.connection.pg_version  # type: ignore[attr-defined]
        return f"PostgreSQL {v // 10000}.{v % 10000}"


class MySQL(Vendor):
    name = "mysql"
    nulls_order_syntax = False

    @staticmethod
    def claimable_index_sql(name: str, table: str) -> str:
        # No partial indexes: a plain one. Non-claimable rows have a NULL key and sit
        # apart at the start of the index, so a claim still reads only claimable rows.
        return f"CREATE INDEX {name} ON {table} (claimable_worker, id)"

    def key_needs_cast(self, pk_field: Any) -> bool:
        # UUIDs are char(32) here: already the text form.
        return super().key_needs_cast(pk_field) and pk_field.get_internal_type() != "UUIDField"

    @property
    def is_mariadb(self) -> bool:
        return bool(self.connection.mysql_is_mariadb)  # type: ignore[attr-defined]

    @property
    def lock_of_table(self) -> bool:  # type: ignore[override]
        return not self.is_mariadb  # MariaDB has no FOR UPDATE OF

    def now_sql(self) -> str:
        # Django stores UTC in DATETIME(6) columns; NOW() would be the session's zone.
        return "UTC_TIMESTAMP(6)"

    def now_plus_sql(self, seconds: float) -> str:
        return f"(UTC_TIMESTAMP(6) + INTERVAL {round(seconds * 1_000_000)} MICROSECOND)"

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

    def insert_ignore(self, table: str, columns: str, select_sql: str) -> str:
        # ON DUPLICATE KEY rather than INSERT IGNORE: IGNORE would also hide real errors.
        return (
            f"INSERT INTO {self.qn(table)} ({columns}) {select_sql} "
            "ON DUPLICATE KEY UPDATE worker = worker"
        )

    def create_trigger_sql(self, worker: Worker, execution_table: str) -> list[str]:
        names = TriggerNames.of(worker.name)
        table, pk = self.qn(worker.table), self.qn(worker.pk_column)
        ex = self.qn(execution_table)
        insert = self.insert_ignore(
            execution_table,
            self.EXECUTION_COLUMNS,
            f"VALUES ({self.pending_row_values(worker, self.text_key_sql(f'NEW.{pk}'))})",
        )
        return [
            f"DROP TRIGGER IF EXISTS {names.insert}",
            f"CREATE TRIGGER {names.insert} AFTER INSERT ON {table} FOR EACH ROW {insert}",
            f"DROP TRIGGER IF EXISTS {names.delete}",
            f"CREATE TRIGGER {names.delete} AFTER DELETE ON {table} FOR EACH ROW "
            f"DELETE FROM {ex} WHERE worker = '{worker.name}' "
            f"AND source_id = {self.text_key_sql(f'OLD.{pk}')} AND status <> 'working'",
        ]

    def drop_trigger_sql(self, trigger: str, table: str) -> list[str]:
        return [f"DROP TRIGGER IF EXISTS {trigger}"]

    def installed_triggers_sql(self) -> str:
        return (
            "SELECT TRIGGER_NAME, EVENT_OBJECT_TABLE FROM information_schema.TRIGGERS "
            f"WHERE TRIGGER_SCHEMA = DATABASE() AND TRIGGER_NAME LIKE '{TRIGGER_PREFIX}%'"
        )

    def check_supported(self) -> None:
        version = tuple(self.connection.mysql_version)  # type: ignore[attr-defined]
        if self.is_mariadb and version < (10, 6):
            raise UnsupportedDatabase(
                f"MariaDB {'.'.join(map(str, version))} has no SKIP LOCKED: "
                "django-dbworker needs MariaDB 10.6+."
            )
        if not self.is_mariadb and version < (8, 0, 1):
            raise UnsupportedDatabase(
                f"MySQL {'.'.join(map(str, version))} has no SKIP LOCKED: "
                "django-dbworker needs MySQL 8.0.1+."
            )

    def describe(self) -> str:
        version = ".".join(map(str, self.connection.mysql_version))  # type: ignore[attr-defined]
        return f"{'MariaDB' if self.is_mariadb else 'MySQL'} {version}"


class SQLite(Vendor):
    name = "sqlite"
    # SQLite has one writer at a time: a claim is a single UPDATE ... WHERE <still
    # claimable> RETURNING, which no other process can interleave with.
    claim_mode = "conditional UPDATE"
    lock_of_table = False

    def is_lock_contention(self, exc: BaseException) -> bool:
        # One writer at a time: a handler's open transaction holds the lock.
        return "database is locked" in str(exc)

    def key_needs_cast(self, pk_field: Any) -> bool:
        return super().key_needs_cast(pk_field) and pk_field.get_internal_type() != "UUIDField"

    # Django writes SQLite datetimes as UTC text 'YYYY-MM-DD HH:MM:SS.ffffff'; this sorts
    # and compares with it as text.
    def now_sql(self) -> str:
        return "strftime('%Y-%m-%d %H:%M:%f', 'now')"

    def now_plus_sql(self, seconds: float) -> str:
        return f"strftime('%Y-%m-%d %H:%M:%f', 'now', '+{float(seconds):.3f} seconds')"

    def text_key_sql(self, column_sql: str) -> str:
        return f"CAST({column_sql} AS TEXT)"

    def insert_ignore(self, table: str, columns: str, select_sql: str) -> str:
        return f"INSERT OR IGNORE INTO {self.qn(table)} ({columns}) {select_sql}"

    def create_trigger_sql(self, worker: Worker, execution_table: str) -> list[str]:
        names = TriggerNames.of(worker.name)
        table, pk = self.qn(worker.table), self.qn(worker.pk_column)
        ex = self.qn(execution_table)
        insert = self.insert_ignore(
            execution_table,
            self.EXECUTION_COLUMNS,
            f"VALUES ({self.pending_row_values(worker, self.text_key_sql(f'NEW.{pk}'))})",
        )
        return [
            f"DROP TRIGGER IF EXISTS {names.insert}",
            f"CREATE TRIGGER {names.insert} AFTER INSERT ON {table} BEGIN {insert}; END",
            f"DROP TRIGGER IF EXISTS {names.delete}",
            f"CREATE TRIGGER {names.delete} AFTER DELETE ON {table} BEGIN "
            f"DELETE FROM {ex} WHERE worker = '{worker.name}' "
            f"AND source_id = {self.text_key_sql(f'OLD.{pk}')} AND status <> 'working'; END",
        ]

    def drop_trigger_sql(self, trigger: str, table: str) -> list[str]:
        return [f"DROP TRIGGER IF EXISTS {trigger}"]

    def installed_triggers_sql(self) -> str:
        return (
            "SELECT name, tbl_name FROM sqlite_master WHERE type = 'trigger' "
            f"AND name LIKE '{TRIGGER_PREFIX}%'"
        )

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

    def describe(self) -> str:
        return f"SQLite {sqlite3.sqlite_version} ({self.connection.settings_dict['NAME']})"


VENDORS: dict[str, type[Vendor]] = {
    "postgresql": PostgreSQL,
    "mysql": MySQL,
    "sqlite": SQLite,
}


def for_connection(connection: BaseDatabaseWrapper) -> Vendor:
    try:
        cls = VENDORS[connection.vendor]
    except KeyError:
        raise UnsupportedDatabase(
            f"The {connection.vendor!r} database backend is not supported: use PostgreSQL "
            "13+, MySQL 8.0.1+, MariaDB 10.6+ or a file-backed SQLite."
        ) from None
    return cls(connection)




def prepare_child_settings(settings_dict: dict[str, Any]) -> None:
    """Adjust a child's DATABASES entry before its first connection.

    SQLite: a handler reads, then writes; under BEGIN DEFERRED the upgrade to a write
    lock fails at once ("database is locked") when another process wrote in between.
    BEGIN IMMEDIATE takes the lock up front and waits for it instead.
    """
    if settings_dict.get("ENGINE", "").endswith("sqlite3"):
        options = settings_dict.setdefault("OPTIONS", {})
        options.setdefault("transaction_mode", "IMMEDIATE")
        options.setdefault("timeout", 20)
