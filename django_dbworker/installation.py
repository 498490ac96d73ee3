"""What ``migrate`` installs for each registered worker.

Triggers on the source table keep one Execution row per source row (PENDING from the
moment the row exists), a backfill covers rows that existed before, and a clean-up
drops history of rows that were removed while no trigger watched (or by TRUNCATE).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from django.db import connections

from . import conf
from .models import Execution
from .registry import Worker, registry
from .vendors import TriggerNames, UnsupportedDatabase, Vendor, for_connection

logger = logging.getLogger("django_dbworker.installation")


def install_after_migrate(sender: Any, using: str, **kwargs: Any) -> None:
    if using != conf.value("DATABASE"):
        return
    try:
        install(using)
    except UnsupportedDatabase as exc:
        logger.warning("django-dbworker installs nothing on %s: %s", using, exc)


def wanted_triggers(vendor: Vendor, workers: Iterable[Worker]) -> dict[str, str]:
    wanted: dict[str, str] = {}
    for w in workers:
        names = TriggerNames.of(w.name)
        wanted[names.insert] = w.table
        wanted[names.delete] = w.table
        if vendor.notifies:
            wanted[names.update] = w.table
    return wanted


def installed_triggers(vendor: Vendor) -> dict[str, str]:
    with vendor.connection.cursor() as cursor:
        cursor.execute(vendor.installed_triggers_sql())
        return {name: table for name, table in cursor.fetchall()}


def missing_triggers(using: str, workers: Iterable[Worker]) -> list[str]:
    """Names of the triggers these workers need that the database does not have."""
    vendor = for_connection(connections[using])
    have = installed_triggers(vendor)
    return sorted(
        name for name, table in wanted_triggers(vendor, workers).items() if have.get(name) != table
    )


def install(using: str, workers: Iterable[Worker] | None = None) -> list[str]:
    """Install triggers, backfill and clean up for ``workers`` (default: all registered).

    Triggers this app installed for workers that no longer exist are dropped, so a
    removed worker stops creating rows. Returns the names of the workers installed.
    """
    connection = connections[using]
    vendor = for_connection(connection)
    everything = workers is None
    workers = list(registry.values() if workers is None else workers)
    tables = set(connection.introspection.table_names())
    ready = [w for w in workers if w.table in tables]
    for w in workers:
        if w not in ready:
            logger.warning("Worker %s: table %s does not exist yet; run migrate again.",
                           w.name, w.table)

    wanted = wanted_triggers(vendor, ready)
    with connection.cursor() as cursor:
        if everything:
            for name, table in installed_triggers(vendor).items():
                if name not in wanted:
                    logger.info("Dropping trigger %s of a worker that no longer exists", name)
                    for sql in vendor.drop_trigger_sql(name, table):
                        cursor.execute(sql)
        for w in ready:
            # Triggers first, backfill second: a row inserted in between is caught by the
            # trigger, and the backfill ignores rows that already have an Execution.
            for sql in vendor.create_trigger_sql(w, Execution._meta.db_table):
                cursor.execute(sql)
            cursor.execute(backfill_sql(vendor, w))
            if cursor.rowcount and cursor.rowcount > 0:
                logger.info("Worker %s: %d existing rows are now pending", w.name, cursor.rowcount)
            cursor.execute(cleanup_sql(vendor, w))
    return [w.name for w in ready]


def backfill_sql(vendor: Vendor, w: Worker) -> str:
    qn = vendor.qn
    ex = qn(Execution._meta.db_table)
    key = vendor.text_key_sql(f"s.{qn(w.pk_column)}")
    select = (
        f"SELECT {vendor.pending_row_values(w, key)} FROM {qn(w.table)} s "
        f"WHERE NOT EXISTS (SELECT 1 FROM {ex} e WHERE e.worker = '{w.name}' "
        f"AND e.source_id = {key})"
    )
    return vendor.insert_ignore(Execution._meta.db_table, vendor.EXECUTION_COLUMNS, select)


def cleanup_sql(vendor: Vendor, w: Worker) -> str:
    qn = vendor.qn
    ex = qn(Execution._meta.db_table)
    return (
        f"DELETE FROM {ex} WHERE worker = '{w.name}' AND status <> 'working' "
        f"AND NOT EXISTS (SELECT 1 FROM {qn(w.table)} s WHERE s.{qn(w.pk_column)} = "
        f"{key_from_text_sql(vendor, w, f'{ex}.source_id')})"
    )


def key_from_text_sql(vendor: Vendor, w: Worker, text_sql: str) -> str:
    """The stored text key turned back into the source key's type, so that the source's
    primary-key index serves the comparison (the cast sits on the Execution side)."""
    if not vendor.key_needs_cast(w.pk_field):
        return text_sql
    return f"CAST({text_sql} AS {w.pk_field.cast_db_type(vendor.connection)})"
