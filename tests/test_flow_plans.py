"""EXPLAIN of every statement a limited claim sends (issue 37): over 100,000 pending rows
of 1,000 keys (DBWORKER_EXPLAIN_BACKLOG), a claim with a key limit, fair or not, reads
indexes only: no sequential scan of a table, no sort or temporary table over the backlog;
and (PostgreSQL, MariaDB: their analysed plans count the rows) no read goes through more
than a thousand rows, filtered out or not.

The statements are caught as the claim sends them (SQLAlchemy's before_cursor_execute)
and explained afterwards with their own parameters, so what is checked is what runs.
"""

import json
import os

import pytest
import sqlalchemy as sa
from django.db import connection

from django_dbworker.models import Execution
from django_dbworker.registration.registry import registry
from django_dbworker.store.bridge import Bridge
from tests.helpers import analyze
from tests.testapp.models import FairJob

pytestmark = pytest.mark.django_db(transaction=True)

KEYS = 1_000
# A sort or temporary table is allowed over this many rows at most (the claim's own
# few: the ids it picked, the keys it locks), never over the backlog.
SMALL = 1_000


def sent_by(bridge, run) -> list[tuple[str, object]]:
    """The statements (sql, parameters) ``run()`` sends on the bridge's engine."""
    sent: list[tuple[str, object]] = []

    def record(conn, cursor, statement, parameters, context, executemany):
        sent.append((statement, parameters))

    sa.event.listen(bridge.engine, "before_cursor_execute", record)
    try:
        run()
    finally:
        sa.event.remove(bridge.engine, "before_cursor_execute", record)
    return sent


def explain(bridge, sql: str, parameters) -> str:
    prefix = {"postgresql": "EXPLAIN (FORMAT JSON) ", "mysql": "EXPLAIN ",
              "sqlite": "EXPLAIN QUERY PLAN "}[connection.vendor]
    with bridge.engine.connect() as conn:
        rows = conn.exec_driver_sql(prefix + sql, parameters).all()
    if connection.vendor == "postgresql":
        return json.dumps(rows[0][0])
    return "\n".join(" | ".join(str(c) for c in row) for row in rows)


def problems(plan: str, tables: set[str]) -> list[str]:
    """What in ``plan`` reads a table whole or sorts many rows."""
    found = []
    if connection.vendor == "postgresql":
        def walk(node):
            kind = node["Node Type"]
            if kind == "Seq Scan" and node.get("Relation Name") in tables:
                found.append(f"Seq Scan on {node['Relation Name']}")
            if kind in ("Sort", "Hash", "Materialize") and node["Plan Rows"] > SMALL:
                found.append(f"{kind} of {node['Plan Rows']} rows")
            for child in node.get("Plans", []):
                walk(child)

        walk(json.loads(plan)[0]["Plan"])
    elif connection.vendor == "mysql":
        for line in plan.splitlines():
            cells = [c.strip() for c in line.split("|")]
            # id | select_type | table | type | possible_keys | key | key_len | ref | rows | Extra
            table, access, rows, extra = cells[2], cells[3], cells[8], cells[9]
            if table in tables and access in ("ALL", "index"):
                found.append(f"{access} scan of {table}")
            if ("filesort" in extra or "temporary" in extra) and rows != "None" and int(rows) > SMALL:
                found.append(f"{extra} over {rows} rows of {table}")
    else:
        for line in plan.splitlines():
            detail = line.split(" | ")[-1]
            for table in tables:
                if detail.startswith(f"SCAN {table}") and "INDEX" not in detail:
                    found.append(detail)
            if "TEMP B-TREE" in detail:
                found.append(detail)
    return found


def rows_read(bridge, sql: str, parameters, tables: set[str]) -> list[str]:
    """Run a SELECT as the database analyses it (PostgreSQL's EXPLAIN ANALYZE, MariaDB's
    ANALYZE): each read of one of ``tables`` that went through more than SMALL rows (the
    rows it returned, and those it read and filtered out, times its loops). An index read
    can still walk the backlog: a condition the index cannot seek on is a filter."""
    if connection.vendor == "sqlite":
        return []  # (no actual row counts: the query plan's check above stands)
    prefix = ("EXPLAIN (ANALYZE, FORMAT JSON) " if connection.vendor == "postgresql"
              else "ANALYZE FORMAT=JSON ")
    with bridge.engine.connect() as conn:
        found = conn.exec_driver_sql(prefix + sql, parameters).all()[0][0]
        conn.rollback()
    found = found if isinstance(found, list) else json.loads(found)
    heavy = []

    def walk(node):
        if not isinstance(node, dict):
            if isinstance(node, list):
                for item in node:
                    walk(item)
            return
        table = node.get("Relation Name") or node.get("table_name")
        if table in tables:
            if "Actual Rows" in node:  # PostgreSQL
                read = (node["Actual Rows"] + node.get("Rows Removed by Filter", 0)) * node["Actual Loops"]
            else:  # MariaDB: r_rows is per loop
                read = (node.get("r_rows") or 0) * (node.get("r_loops") or 1)
            if read > SMALL:
                heavy.append(f"{read:.0f} rows of {table}")
        for value in node.values():
            walk(value)

    walk(found)
    if heavy:
        print(json.dumps(found, indent=1)[:6000])
    return heavy


@pytest.fixture
def backlog():
    """100,000 pending rows, keys in runs of 100 rows (a backlog per tenant), some keys
    already at their limit."""
    n = int(os.environ.get("DBWORKER_EXPLAIN_BACKLOG", "100000"))
    per_key = max(n // KEYS, 1)
    FairJob.objects.bulk_create([FairJob(tenant=i // per_key) for i in range(n)],
                                batch_size=5000)
    analyze(Execution, FairJob)
    return n


def test_claims_with_a_key_limit_read_indexes_only(backlog):
    """Both shapes on one backlog: per_key (tenant_keyed) and fair with per_key
    (fair_keyed)."""
    tables = {Execution._meta.db_table, FairJob._meta.db_table, "dbworker_flowlock"}
    bad: dict[str, list[str]] = {}
    for worker in ("tenant_keyed", "fair_keyed"):
        w = registry[worker]
        bridge = Bridge()
        try:
            bridge.claim(w, 8, "test:first")  # keys at their limit: claims pass over them
            claims: list = []
            sent = sent_by(bridge, lambda b=bridge, w=w, c=claims: c.extend(b.claim(w, 16, "test:plan")))
            readers = [(sql, p) for sql, p in sent
                       if sql.lstrip().upper().startswith(("SELECT", "WITH", "UPDATE", "DELETE"))]
            plans = {sql: explain(bridge, sql, p) for sql, p in readers}
            heavy = {sql: rows_read(bridge, sql, p, tables) for sql, p in readers
                     if sql.lstrip().upper().startswith(("SELECT", "WITH"))}
        finally:
            bridge.close()
        assert len(claims) == 16 and len({c.source_id for c in claims}) == 16, worker
        assert len(readers) >= 4, worker  # candidates, locks, counts, the rows' lock, UPDATE
        bad.update({f"{worker}: {sql}": found for sql, plan in plans.items()
                    if (found := problems(plan, tables))})
        bad.update({f"{worker}, rows read: {sql}": found for sql, found in heavy.items() if found})
    assert not bad, "\n\n".join(f"{sql}\n-> {found}" for sql, found in bad.items())
