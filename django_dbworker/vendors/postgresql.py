"""PostgreSQL 13+: statement-level triggers, claims in one statement, LISTEN/NOTIFY."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .base import (
    EXECUTION_TABLE,
    NOTIFY_CHANNEL,
    TriggerSource,
    UnsupportedDatabase,
    Vendor,
    driver_error,
    schedule_lock_key,
)

# The first key of the two-key advisory locks this app takes ("dbws"), the second being
# the schedule's: the application's own advisory locks use one key, or other classes.
SCHEDULE_LOCK_CLASS = 0x64627773


# IDLE, ACTIVE (a command still under way), INTRANS, INERROR.
_PG_STATES = {0: "ended", 1: "busy", 2: "open", 3: "aborted"}


class PostgreSQL(Vendor):
    name = "postgresql"
    notifies = True
    fence_exists = True
    sqlalchemy_driver = "postgresql+psycopg"
    # deadlock_detected, serialization_failure, lock_not_available
    DEADLOCK_STATES = {"40P01", "40001", "55P03"}
    # What the server says, before any SQLSTATE reaches the client, when connecting can
    # never succeed as configured.
    PERMANENT_CONNECT_ERRORS = ("password authentication failed", "authentication failed",
                                "does not exist", "no pg_hba.conf entry",
                                "permission denied for database")

    def is_deadlock(self, exc: BaseException) -> bool:
        return getattr(driver_error(exc), "sqlstate", None) in self.DEADLOCK_STATES

    def is_permanent_connect_error(self, exc: BaseException) -> bool:
        text = str(driver_error(exc))
        return any(marker in text for marker in self.PERMANENT_CONNECT_ERRORS)

    def check_supported(self) -> None:
        version = self.connection.pg_version  # type: ignore[attr-defined]
        if version < 130000:
            raise UnsupportedDatabase(
                f"PostgreSQL {version // 10000} is too old: django-dbworker needs PostgreSQL 13+."
            )

    def describe(self) -> str:
        v = self.connection.pg_version  # type: ignore[attr-defined]
        return f"PostgreSQL {v // 10000}.{v % 10000}"

    def url_parts(self, settings_dict: dict[str, Any]) -> dict[str, Any]:
        parts = super().url_parts({**settings_dict, "PORT": None})
        host, port = str(settings_dict.get("HOST") or ""), str(settings_dict.get("PORT") or "")
        if "," in host or "," in port:
            # Several hosts (a primary and its replicas, with target_session_attrs in
            # OPTIONS): libpq tries them in turn; SQLAlchemy passes them through as is.
            parts["host"] = None
            parts["query"] = {"host": host, **({"port": port} if port else {})}
        elif port:
            parts["port"] = int(port)
        return parts

    def connect_args(self, given: dict[str, Any]) -> dict[str, Any]:
        # A network that drops packets (a partition) must fail the coordinator's
        # statements within seconds, not after TCP's quarter of an hour: then its outage
        # handling takes over and it claims nothing until the database is back.
        args: dict[str, Any] = {
            "connect_timeout": 10, "keepalives": 1, "keepalives_idle": 10,
            "keepalives_interval": 5, "keepalives_count": 3, "tcp_user_timeout": 15000}
        if self.behind_transaction_pooler():
            # psycopg prepares statements it runs often; behind PgBouncer in transaction
            # pooling the next transaction may meet another server connection, where that
            # statement does not exist.
            args["prepare_threshold"] = None
        return {**args, **given}

    def behind_transaction_pooler(self) -> bool:
        """Django's own sign of PgBouncer in transaction pooling (its docs ask for it)."""
        return bool(self.connection.settings_dict.get("DISABLE_SERVER_SIDE_CURSORS"))

    tells_transaction_state = True

    def claim_operation(self, ordered: bool) -> Any:
        # Lock the candidates (skipping rows others hold) and claim them in one
        # statement. RETURNING has no order, which is fine in creation order (ids say
        # it) but not for a custom order_by: those lock, then claim.
        from .claiming import LockAndClaimInOne, LockThenUpdate

        return LockThenUpdate() if ordered else LockAndClaimInOne()

    def transaction_state(self, dbapi_connection: Any) -> str | None:
        # libpq's PQtransactionStatus (psycopg 3's pq.TransactionStatus, psycopg2's
        # constants). UNKNOWN (a broken connection) says nothing about the handler: the
        # next statement finds out.
        info = getattr(dbapi_connection, "info", None)  # psycopg 3, else psycopg2
        status = int(info.transaction_status if info is not None
                     else dbapi_connection.get_transaction_status())
        return _PG_STATES.get(status)

    def on_connect(self, dbapi_connection: Any, lease_seconds: float) -> None:
        if self.behind_transaction_pooler():
            # Session settings would stay on whichever server connection ran them, for
            # other clients of the pooler (your web processes) too: each transaction
            # makes them for itself instead (transaction_settings).
            return
        autocommit = dbapi_connection.autocommit
        dbapi_connection.autocommit = True
        # The coordinator's own writes (claims, renewals, releases, heartbeats) need not
        # wait for the WAL flush: if the server crashes before it, the row is simply as it
        # was (claimable, or recovered when its lease runs out). A child's commit, which is
        # synchronous, flushes everything written before it, so no outcome can outlive the
        # claim it was guarded by. This takes an fsync off every claim.
        dbapi_connection.execute("SET synchronous_commit = off")
        # A coordinator frozen inside a claim (SIGSTOP, a debugger, a suspended VM) holds
        # row locks that SKIP LOCKED hides from everyone: the server ends its transaction
        # after a lease, so those rows wait no longer than a lease would.
        dbapi_connection.execute(
            f"SET idle_in_transaction_session_timeout = {_idle_milliseconds(lease_seconds)}")
        dbapi_connection.autocommit = autocommit

    def transaction_settings(self, lease_seconds: float) -> tuple[str, tuple[Any, ...]] | None:
        if not self.behind_transaction_pooler():
            return None  # on_connect made them for the session
        # on_connect's two settings, for each transaction only (SET LOCAL): they end with
        # it, so nothing stays on the pooler's server connection. One more round trip per
        # transaction, behind a pooler only.
        return ("SELECT set_config('synchronous_commit', 'off', true), "
                "set_config('idle_in_transaction_session_timeout', %s, true)",
                (str(_idle_milliseconds(lease_seconds)),))

    def try_schedule_lock(self, cursor: Any, schedule: str, frozen_after: float) -> bool:
        # A transaction-scoped advisory lock in a class of its own (so as not to meet
        # the application's advisory locks), and SET LOCAL of the idle timeout, at once.
        cursor.execute(
            "SELECT set_config('idle_in_transaction_session_timeout', %s, true), "
            "pg_try_advisory_xact_lock(%s, %s)",
            [str(_idle_milliseconds(frozen_after)), SCHEDULE_LOCK_CLASS,
             schedule_lock_key(schedule)])
        return bool(cursor.fetchone()[1])

    def notify_sql(self, payload: str) -> tuple[str, list[Any]] | None:
        return "SELECT pg_notify(%s, %s)", [NOTIFY_CHANNEL, payload]

    def literal(self, value: str) -> str:
        # With a backslash: an escape string, whose backslashes mean the same whatever
        # standard_conforming_strings says.
        if "\\" not in value:
            return super().literal(value)
        return "E" + super().literal(value.replace("\\", "\\\\"))

    def now_sql(self) -> str:
        # The statement's time, not the transaction's (now()): a child's group writes
        # finish times many seconds into its transaction.
        return "statement_timestamp()"

    def plus_seconds_sql(self, column_sql: str, seconds: float) -> str:
        return f"({column_sql} + interval '{float(seconds):.6f} seconds')"

    def now_plus_bound(self, seconds: Any) -> Any:
        import sqlalchemy as sa

        zero: Any = sa.literal_column("0")
        return sa.literal_column(self.now_sql()).op("+")(
            sa.func.make_interval(zero, zero, zero, zero, zero, zero, sa.cast(seconds, sa.Float())))

    def text_key_sql(self, column_sql: str) -> str:
        return f"CAST({column_sql} AS text)"

    def bounded_lock_wait(self, conn: Any, select: Any, seconds: int) -> Any:
        # For the rest of the claim's transaction (SQLSTATE 55P03 past it).
        conn.exec_driver_sql(f"SET LOCAL lock_timeout = '{int(seconds)}s'")
        return select

    def insert_missing(self, table: Any, rows: list[dict[str, Any]]) -> Any:
        from sqlalchemy.dialects.postgresql import insert

        return insert(table).values(rows).on_conflict_do_nothing()

    def insert_ignore(self, table: str, columns: str, select_sql: str) -> str:
        return (f"INSERT INTO {self.qn(table)} ({columns}) {select_sql} "
                "ON CONFLICT (worker, source_id) DO NOTHING")

    def update_rows(self, cursor: Any, table: str, columns: Sequence[tuple[str, str]],
                    key: tuple[str, str], rows: Sequence[Sequence[Any]]) -> None:
        # One statement, not one per row: each column's values as one typed array, the
        # rows rebuilt by unnest(). An executemany() is one round trip too, but each of
        # its statements is planned, executed and fires the table's statement triggers
        # (measured: a drain of tasks ran 4-5 % faster this way).
        if len(rows) == 1:
            super().update_rows(cursor, table, columns, key, rows)
            return
        qn = self.qn
        names = ", ".join(qn(c) for c, _ in [*columns, key])
        arrays = ", ".join(f"%s::{db_type}[]" for _, db_type in [*columns, key])
        sets = ", ".join(f"{qn(c)} = v.{qn(c)}" for c, _ in columns)
        cursor.execute(f"UPDATE {qn(table)} AS t SET {sets} FROM unnest({arrays}) AS v({names}) "
                       f"WHERE t.{qn(key[0])} = v.{qn(key[0])}",
                       [list(values) for values in zip(*rows, strict=True)])

    def create_trigger_sql(self, source: TriggerSource) -> list[str]:
        # Statement-level triggers with transition tables: one INSERT ... SELECT per
        # statement, so bulk_create of 10,000 rows costs one trigger call, not 10,000.
        names = source.names
        qn = self.qn
        table, pk = qn(source.table), qn(source.pk_column)
        ex = qn(EXECUTION_TABLE)
        constant = self.literal  # (DDL: no parameters)
        insert = self.insert_ignore(
            EXECUTION_TABLE, self.EXECUTION_COLUMNS,
            f"SELECT {self.pending_row_values(source, 'n')} FROM new_rows n")

        def notify(rows: str) -> str:
            return (f"PERFORM pg_notify({self.literal(NOTIFY_CHANNEL)}, w) FROM "
                    f"(SELECT DISTINCT {source.worker('n', constant)} AS w FROM {rows} n) notified;")

        update_body = notify("new_rows")
        if source.rerun_on:
            def changed(column: str) -> str:
                return f"o.{qn(column)} IS DISTINCT FROM n.{qn(column)}"

            any_changed = " OR ".join(changed(c) for c in source.rerun_on)
            update_body = (
                f"UPDATE {ex} e SET {self.rerun_set_sql(source, changed, 'e.')} "
                f"FROM new_rows n JOIN old_rows o ON o.{pk} = n.{pk} "
                f"WHERE e.worker = {source.worker('n', constant)} "
                f"AND e.source_id = {self.text_key_sql(f'n.{pk}')} "
                f"AND {self.rerun_where_sql('e.')} AND ({any_changed});\n  " + update_body)
        delete_body = (f"DELETE FROM {ex} e USING old_rows o\n"
                       f"   WHERE e.worker = {source.worker('o', constant)} "
                       f"AND e.source_id = {self.text_key_sql(f'o.{pk}')}\n"
                       "     AND e.status <> 'working';")

        def function(name: str, body: str) -> str:
            code = f"BEGIN\n  {body}\n  RETURN NULL;\nEND"
            return (f"CREATE OR REPLACE FUNCTION {qn(name)}() RETURNS trigger "
                    f"LANGUAGE plpgsql AS {_dollar_quoted(code)}")

        return [
            function(names.insert, f'{insert};\n  {notify("new_rows")}'),
            f"DROP TRIGGER IF EXISTS {qn(names.insert)} ON {table}",
            f"CREATE TRIGGER {qn(names.insert)} AFTER INSERT ON {table} REFERENCING NEW TABLE "
            f"AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION {qn(names.insert)}()",
            # Removed source rows take their history along, except a row a handler holds:
            # that one ends FAILED (source deleted) when the child cannot load it.
            function(names.delete, delete_body),
            f"DROP TRIGGER IF EXISTS {qn(names.delete)} ON {table}",
            f"CREATE TRIGGER {qn(names.delete)} AFTER DELETE ON {table} REFERENCING OLD TABLE "
            f"AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION {qn(names.delete)}()",
            # An UPDATE can make a row eligible (uploaded = true): wake idle coordinators;
            # with rerun_on, a changed column makes a finished or failed row pending again.
            function(names.update, update_body),
            f"DROP TRIGGER IF EXISTS {qn(names.update)} ON {table}",
            f"CREATE TRIGGER {qn(names.update)} AFTER UPDATE ON {table} "
            f"REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows "
            f"FOR EACH STATEMENT EXECUTE FUNCTION {qn(names.update)}()",
        ]

    def trigger_names(self, source: TriggerSource) -> list[str]:
        return list(source.names.all())

    def drop_trigger_sql(self, trigger: str, table: str) -> list[str]:
        return [f"DROP TRIGGER IF EXISTS {self.qn(trigger)} ON {self.qn(table)}",
                f"DROP FUNCTION IF EXISTS {self.qn(trigger)}()"]

    def existing_triggers_sql(self, names: Sequence[str]) -> tuple[str, list[Any]]:
        return ("SELECT t.tgname, c.relname FROM pg_trigger t "
                "JOIN pg_class c ON c.oid = t.tgrelid "
                "JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE NOT t.tgisinternal AND t.tgname = ANY(%s) "
                "AND n.nspname = ANY(current_schemas(false))", [list(names)])


def _dollar_quoted(body: str) -> str:
    """A function body between dollar quotes whose tag the body does not contain (a
    column name holding "$f$" would otherwise end the body early)."""
    n = 0
    while (tag := f"$f{n or ''}$") in body:
        n += 1
    return f"{tag}\n{body} {tag}"


def _idle_milliseconds(lease_seconds: float) -> int:
    # idle_in_transaction_session_timeout is in milliseconds; 0 would mean "never".
    return max(int(lease_seconds * 1000), 1000)
