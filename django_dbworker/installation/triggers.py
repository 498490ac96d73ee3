"""What ``migrate`` installs for each registered worker, and what it reports.

Triggers on the source table keep one Execution row per source row (PENDING from the
moment the row exists), a backfill covers rows that existed before, and a clean-up
drops history of rows that were removed while no trigger watched (or by TRUNCATE).

Every trigger this app creates is recorded in ``InstalledTrigger``; only those are ever
dropped, so a trigger of yours is never touched, whatever it is called.

Names reach SQL quoted by the vendor (``Vendor.quote_name``), never pasted: a table or
column may hold quotes, and a queue's worker name holds whatever QUEUES says. The
statements run here take worker names as bound parameters.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, TextIO

from django.db import connections

from .. import conf
from ..models import Execution, InstalledTrigger
from ..registration.registry import Worker, registry
from ..vendors import (
    EXECUTION_TABLE,
    Bound,
    TriggerSource,
    UnsupportedDatabase,
    Vendor,
    for_connection,
)

logger = logging.getLogger("django_dbworker.installation")


@dataclass
class Report:
    """What migrate tells you, through its own verbosity (1: changes, 2: everything)."""

    verbosity: int = 1
    out: TextIO = sys.stdout

    def __call__(self, message: str, level: int = 1) -> None:
        if self.verbosity >= level:
            self.out.write(f"  django-dbworker: {message}\n")


def install_after_migrate(sender: Any, using: str, verbosity: int = 1, **kwargs: Any) -> None:
    if using != conf.value("DATABASE"):
        return
    try:
        install(using, report=Report(verbosity))
    except UnsupportedDatabase as exc:
        logger.warning("django-dbworker installs nothing on %s: %s", using, exc)


def wanted_triggers(vendor: Vendor, workers: Iterable[Worker]) -> dict[str, tuple[Worker, TriggerSource]]:
    wanted: dict[str, tuple[Worker, TriggerSource]] = {}
    for w in workers:
        source = w.trigger_source()
        for name in vendor.trigger_names(source):
            wanted[name] = (w, source)
    return wanted


def existing_triggers(vendor: Vendor, names: Iterable[str]) -> dict[str, str]:
    """Trigger name -> table, for the triggers with exactly these names in the database."""
    names = list(names)
    if not names:
        return {}
    sql, params = vendor.existing_triggers_sql(names)
    with vendor.connection.cursor() as cursor:
        cursor.execute(sql, params)
        return {name: table for name, table in cursor.fetchall()}


def installed_triggers(vendor: Vendor) -> dict[str, str]:
    """Trigger name -> table of the triggers this app installed (and that still exist)."""
    recorded = dict(InstalledTrigger.objects.using(vendor.connection.alias)
                    .values_list("name", "table"))
    present = existing_triggers(vendor, recorded)
    return {name: table for name, table in recorded.items() if present.get(name) == table}


def missing_triggers(using: str, workers: Iterable[Worker]) -> list[str]:
    """Names of the workers whose triggers the database lacks (or has on another table)."""
    vendor = for_connection(connections[using])
    wanted = wanted_triggers(vendor, workers)
    have = existing_triggers(vendor, wanted)
    return sorted({w.name for name, (w, source) in wanted.items()
                   if have.get(name) != source.table})


def install(using: str, workers: Iterable[Worker] | None = None,
            report: Report | None = None) -> list[str]:
    """Install triggers, backfill and clean up for ``workers`` (default: all registered).

    Triggers this app installed for workers that no longer exist are dropped, so a
    removed worker stops creating rows. Returns the names of the workers installed.
    """
    report = report or Report(verbosity=0)
    connection = connections[using]
    vendor = for_connection(connection)
    everything = workers is None
    workers = list(registry.values() if workers is None else workers)
    tables = set(connection.introspection.table_names())
    ready = [w for w in workers if w.table in tables]
    for w in workers:
        if w not in ready:
            report(f"worker {w.name}: table {w.table} does not exist yet; run migrate again.")
    wanted = wanted_triggers(vendor, ready)
    recorded = {t.name: t for t in InstalledTrigger.objects.using(using)}
    if everything:
        _drop_unwanted(vendor, recorded, wanted, report)
    before = existing_triggers(vendor, wanted)
    done: set[str] = set()  # trigger sets shared by several workers (the task queues)
    with connection.cursor() as cursor:
        for w in ready:
            source = w.trigger_source()
            if source.base not in done:
                done.add(source.base)
                label = w.name if source.base == w.name else f"{source.base} queues"
                # Triggers first, backfill second: a row inserted in between is caught by
                # the trigger, and the backfill ignores rows that already have an Execution.
                for sql in vendor.create_trigger_sql(source):
                    cursor.execute(sql)
                for name in vendor.trigger_names(source):
                    InstalledTrigger.objects.using(using).update_or_create(
                        name=name, defaults={"table": source.table, "worker": label})
                    new = before.get(name) != source.table
                    report(f"{'installed' if new else 'kept'} trigger {name} on {source.table} "
                           f"(worker {label})", level=1 if new else 2)
                cursor.execute(*backfill_sql(vendor, source))
                if cursor.rowcount and cursor.rowcount > 0:
                    report(f"{cursor.rowcount} existing rows of {w.source._meta.label} are now "
                           f"pending for worker {label}")
            cursor.execute(*cleanup_sql(vendor, w))
            if w.fair:
                # Rows made claimable before the worker had its key (fair_key_sql).
                cursor.execute(*fair_key_sql(vendor, w))
            _reconcile_rerun_every(vendor, w)
    if everything:
        _report_removed_workers(using, {w.name for w in registry.values()}, report)
    return [w.name for w in ready]


def _drop_unwanted(vendor: Vendor, recorded: dict[str, InstalledTrigger],
                   wanted: dict[str, Any], report: Report) -> None:
    with vendor.connection.cursor() as cursor:
        for name, trigger in recorded.items():
            if name in wanted:
                continue
            for sql in vendor.drop_trigger_sql(name, trigger.table):
                cursor.execute(sql)
            trigger.delete()
            report(f"dropped trigger {name} on {trigger.table} (worker {trigger.worker} is "
                   "no longer registered)")


def _reconcile_rerun_every(vendor: Vendor, w: Worker) -> None:
    """Finished rows wait for their next run exactly when the worker has rerun_every."""
    from ..store import transitions
    from ..store.session import OnDjango

    every = w.rerun_every.total_seconds() if w.rerun_every is not None else None
    transitions.reschedule_finished(OnDjango(vendor.connection.alias), w.name, every)


def _report_removed_workers(using: str, registered: set[str], report: Report) -> None:
    from django.db.models import Count

    leftovers = (Execution.objects.using(using).exclude(worker__in=registered)
                 .values_list("worker")
                 .annotate(n=Count("*")).order_by("worker"))
    for name, n in leftovers:
        report(f"{n} executions belong to worker {name}, which is no longer registered; "
               "delete them with `manage.py dbworker_cleanup` (see --dry-run)")


def backfill_sql(vendor: Vendor, source: TriggerSource) -> tuple[str, list[Any]]:
    """A pending Execution for each row of ``source`` that has none (sql, params)."""
    qn, bound = vendor.qn, Bound()
    ex = qn(EXECUTION_TABLE)
    key = vendor.text_key_sql(f"s.{qn(source.pk_column)}")
    select = (
        f"SELECT {vendor.pending_row_values(source, 's', bound)} FROM {qn(source.table)} s "
        f"WHERE NOT EXISTS (SELECT 1 FROM {ex} e WHERE e.worker = {source.worker('s', bound)} "
        f"AND e.source_id = {key})"
    )
    return bound.statement(vendor.insert_ignore(EXECUTION_TABLE, vendor.EXECUTION_COLUMNS,
                                                select))


def cleanup_sql(vendor: Vendor, w: Worker) -> tuple[str, list[Any]]:
    """Delete ``w``'s history of rows that no longer exist, except a held one (sql, params)."""
    qn, bound = vendor.qn, Bound()
    ex = qn(EXECUTION_TABLE)
    key = vendor.key_from_text_sql(w.pk_field, f"{ex}.source_id")
    return bound.statement(
        f"DELETE FROM {ex} WHERE worker = {bound(w.name)} AND status <> 'working' "
        f"AND NOT EXISTS (SELECT 1 FROM {qn(w.table)} s WHERE s.{qn(w.pk_column)} = {key})"
    )


def fair_key_sql(vendor: Vendor, w: Worker) -> tuple[str, list[Any]]:
    """Give ``w``'s claimable rows without a key the key of their source row (sql,
    params). The triggers write it for the rows they make; rows made before the worker
    declared its key would otherwise take their turns in a fair claim as one group, the
    rows without a key."""
    assert w.key_column is not None
    qn, bound = vendor.qn, Bound()
    ex = qn(EXECUTION_TABLE)
    pk = vendor.key_from_text_sql(w.pk_field, f"{ex}.source_id")
    value = vendor.text_key_sql(f"s.{qn(w.key_column)}")
    return bound.statement(
        f"UPDATE {ex} SET flow_key = (SELECT {value} FROM {qn(w.table)} s "
        f"WHERE s.{qn(w.pk_column)} = {pk}) "
        f"WHERE worker = {bound(w.name)} AND claimable_worker IS NOT NULL AND flow_key IS NULL"
    )
