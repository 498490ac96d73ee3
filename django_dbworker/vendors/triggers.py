"""The triggers that keep a pending Execution for every source row: their names, what
one source table's triggers need to know (TriggerSource), and the DDL that row-level
triggers share (MySQL/MariaDB and SQLite; PostgreSQL's statement-level ones override
create_trigger_sql). A mixin of Vendor: it writes SQL through the vendor's quoting, its
literals and its clock.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .names import EXECUTION_TABLE, RERUN_STATUSES

# Trigger names this app makes, and nothing else: dbworker_<worker>_(ins|del|upd).
TRIGGER_NAME = re.compile(r"dbworker_[a-z][a-z0-9_]*_(ins|del|upd)\Z")


@dataclass(frozen=True)
class TriggerNames:
    insert: str
    delete: str
    update: str

    @classmethod
    def of(cls, base: str) -> TriggerNames:
        return cls(insert=f"dbworker_{base}_ins", delete=f"dbworker_{base}_del",
                   update=f"dbworker_{base}_upd")

    def all(self) -> tuple[str, str, str]:
        return (self.insert, self.delete, self.update)


@dataclass(frozen=True)
class TriggerSource:
    """What the triggers of one source table need to know.

    ``worker``, ``priority`` and ``due`` are SQL expressions of the inserted row, given
    its alias (``NEW``, or a transition table's): a row worker's name is a constant, a
    task's queue comes from the row itself. ``worker`` also gets how a constant string is
    written: ``Vendor.literal`` in trigger DDL, a bound parameter (``Bound``) at run time.
    Column names are written by the vendor's ``quote_name``.
    """

    base: str  # trigger names are dbworker_<base>_ins/_del/_upd
    table: str
    pk_column: str
    pk_field: Any
    worker: Callable[[str, Callable[[str], str]], str]
    priority: Callable[[str], str] = field(default=lambda row: "0")
    due: Callable[[str], str] = field(default=lambda row: "NULL")
    rerun_on: Sequence[str] = ()  # column names
    # The flow-control key's column (None: no key): a new Execution carries the key as
    # text in flow_key, so a fair claim finds each key's rows by index.
    key_column: str | None = None

    @property
    def names(self) -> TriggerNames:
        return TriggerNames.of(self.base)


class TriggerDDL:
    """Trigger DDL, written with the methods of the Vendor it is mixed into."""

    if TYPE_CHECKING:
        qn: Callable[[str], str]

        def literal(self, value: str) -> str: ...
        def now_sql(self) -> str: ...
        def false_sql(self) -> str: ...
        def text_key_sql(self, column_sql: str) -> str: ...
        def insert_ignore(self, table: str, columns: str, select_sql: str) -> str: ...

    # -- triggers: a PENDING Execution row for every source row ---------------------------
    EXECUTION_COLUMNS = ("worker, source_id, status, attempts, priority, next_attempt_at, "
                         "rerun_requested, created_at, updated_at, ready_at, flow_key")

    def pending_row_values(self, source: TriggerSource, row: str,
                           constant: Callable[[str], str] | None = None) -> str:
        """The values of a new pending Execution of ``row``; ``constant`` writes the
        worker's name (a literal by default: in DDL; a Bound at run time)."""
        now = self.now_sql()
        key = self.text_key_sql(f"{row}.{self.qn(source.pk_column)}")
        due = source.due(row)
        worker = source.worker(row, constant or self.literal)
        flow_key = ("NULL" if source.key_column is None
                    else self.text_key_sql(f"{row}.{self.qn(source.key_column)}"))
        return (f"{worker}, {key}, 'pending', 0, {source.priority(row)}, {due}, "
                f"{self.false_sql()}, {now}, {now}, COALESCE({due}, {now}), {flow_key}")

    def create_trigger_sql(self, source: TriggerSource) -> list[str]:
        """Row-level triggers (MySQL/MariaDB and SQLite; PostgreSQL uses statement-level
        ones): insert -> a pending Execution, delete -> its history goes (except a row a
        handler holds), and with rerun_on, a changed column -> pending again."""
        names = source.names
        table, pk = self.qn(source.table), self.qn(source.pk_column)
        ex = self.qn(EXECUTION_TABLE)
        insert = self.insert_ignore(EXECUTION_TABLE, self.EXECUTION_COLUMNS,
                                    f"VALUES ({self.pending_row_values(source, 'NEW')})")
        delete = (f"DELETE FROM {ex} WHERE worker = {source.worker('OLD', self.literal)} "
                  f"AND source_id = {self.text_key_sql(f'OLD.{pk}')} AND status <> 'working'")
        qn = self.qn
        statements = [
            *self.drop_trigger_sql(names.insert, source.table),
            f"CREATE TRIGGER {qn(names.insert)} AFTER INSERT ON {table} "
            f"FOR EACH ROW {self.row_trigger_body(insert)}",
            *self.drop_trigger_sql(names.delete, source.table),
            f"CREATE TRIGGER {qn(names.delete)} AFTER DELETE ON {table} "
            f"FOR EACH ROW {self.row_trigger_body(delete)}",
            *self.drop_trigger_sql(names.update, source.table),
        ]
        if source.rerun_on:
            def changed(column: str) -> str:
                return self.is_distinct_sql(f"OLD.{self.qn(column)}", f"NEW.{self.qn(column)}")

            rerun = (f"UPDATE {ex} SET {self.rerun_set_sql(source, changed)} "
                     f"WHERE worker = {source.worker('NEW', self.literal)} "
                     f"AND source_id = {self.text_key_sql(f'NEW.{pk}')} "
                     f"AND {self.rerun_where_sql()}")
            statements.append(self.rerun_trigger_sql(
                qn(names.update), table, [self.qn(c) for c in source.rerun_on],
                " OR ".join(changed(c) for c in source.rerun_on), rerun))
        return statements

    # Row triggers (MySQL/MariaDB, SQLite): what follows FOR EACH ROW for a trigger that
    # runs one {statement}; how {a} and {b} differ with NULLs compared as values.
    ROW_TRIGGER_BODY = "{statement}"
    DISTINCT_SQL = "{a} IS DISTINCT FROM {b}"

    def row_trigger_body(self, statement: str) -> str:
        return self.ROW_TRIGGER_BODY.format(statement=statement)

    def is_distinct_sql(self, a: str, b: str) -> str:
        return self.DISTINCT_SQL.format(a=a, b=b)

    def rerun_trigger_sql(self, name: str, table: str, columns: list[str], condition: str,
                          statement: str) -> str:
        """An AFTER UPDATE row trigger that runs statement when condition holds (``name``,
        ``table`` and ``columns`` quoted)."""
        raise NotImplementedError

    def trigger_names(self, source: TriggerSource) -> list[str]:
        """The triggers create_trigger_sql() makes for ``source``."""
        names = source.names
        return [names.insert, names.delete, *([names.update] if source.rerun_on else [])]

    def drop_trigger_sql(self, trigger: str, table: str) -> list[str]:
        # Row triggers: nothing else to drop.
        return [f"DROP TRIGGER IF EXISTS {self.qn(trigger)}"]

    # SELECT (trigger name, table name) of the triggers named in {marks}, compared
    # exactly (case and all): a trigger of the user's that differs in case is not ours.
    TRIGGER_CATALOG_SQL = ""

    def existing_triggers_sql(self, names: Sequence[str]) -> tuple[str, list[Any]]:
        marks = ", ".join(["%s"] * len(names))
        return self.TRIGGER_CATALOG_SQL.format(marks=marks), list(names)

    def rerun_set_sql(self, source: TriggerSource, changed: Callable[[str], str],
                      e: str = "") -> str:
        """The SET list of the UPDATE a source change (rerun_on) makes: a finished or
        failed row becomes pending, a working one is flagged to run again after its
        commit. Every assignment reads the old status first (MySQL assigns left to right,
        so ``status`` comes last); ``e`` qualifies the Execution columns read."""
        done = ", ".join(f"'{s}'" for s in RERUN_STATUSES)
        now = self.now_sql()
        reason = self.changed_columns_sql(source.rerun_on, changed)
        return (f"rerun_requested = ({e}status = 'working'), "
                f"next_attempt_at = CASE WHEN {e}status IN ({done}) THEN NULL "
                f"ELSE {e}next_attempt_at END, "
                f"ready_at = CASE WHEN {e}status IN ({done}) THEN {now} ELSE {e}ready_at END, "
                f"rerun_reason = {reason}, updated_at = {now}, "
                f"crashes = CASE WHEN {e}status IN ({done}) THEN 0 ELSE {e}crashes END, "
                f"status = CASE WHEN {e}status IN ({done}) THEN 'pending' ELSE {e}status END")

    def rerun_where_sql(self, e: str = "") -> str:
        statuses = ", ".join(f"'{s}'" for s in (*RERUN_STATUSES, "working"))
        return f"{e}status IN ({statuses})"

    def changed_columns_sql(self, columns: Sequence[str],
                            changed: Callable[[str], str]) -> str:
        """'changed: a, b': the listed columns that changed, as text."""
        parts = " || ".join(f"CASE WHEN {changed(c)} THEN {self.literal(f'{c}, ')} ELSE '' END"
                            for c in columns)
        return f"'changed: ' || RTRIM({parts}, ', ')"
