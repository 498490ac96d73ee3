"""The coordinator's claim: a worker's claimable rows, in its order, taken by exactly one
process. The claimable index drives the statement; the worker's eligible() QuerySet,
compiled by Django, is embedded as a correlated EXISTS (and each sort key as a probe by
primary key), so a claim costs what the backlog costs, never the history. How the rows
are locked and taken is the vendor's operation (vendors/claiming.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from django.db.models import F, OrderBy
from django.db.models.expressions import BaseExpression
from sqlalchemy.engine import Engine

from ..processes.protocol import Claim
from ..registration.registry import Worker
from ..vendors import Vendor
from ..vendors.claiming import FAIR_KEY, FAIR_NULL_ROWS, FAIR_ROWS, ClaimWithinLimits, FairKeys
from . import engine as engines
from . import transitions
from .tables import execution_table

logger = logging.getLogger("django_dbworker.coordinator")

TOKEN, CLAIMER = transitions.TOKEN, transitions.CLAIMER  # a claim's parameters
# Where a worker's claims take its rows in id order: the id its last full claim started
# at, so the next claim starts there. Without it each claim walked every row claimed
# before it in the drain: PostgreSQL, whose statistics still said "all claimable", took
# the primary key for the claim and filtered out 33,000 claimed rows (8 ms a claim) a
# third into a 100,000-row drain, until autovacuum's ANALYZE; and the claimable index
# keeps the claimed rows' dead entries until VACUUM. Rows that become claimable again
# below it (a retry, a row given back) are found by the claim that comes back short and
# looks again from the start, or by the claim that does so once every FLOOR_SECONDS.
FLOOR = "dbw_floor"
FLOOR_SECONDS = 1.0


@dataclass(frozen=True)
class OrderTerm:
    alias: str
    descending: bool
    nulls_first: bool
    nulls_last: bool


@dataclass(frozen=True)
class EligibleSql:
    """A worker's eligible() QuerySet compiled by Django, with its sort terms."""
    sql: str
    params: tuple[Any, ...]
    terms: tuple[OrderTerm, ...]


@dataclass(frozen=True)
class ClaimStatement:
    """A worker's claim statements for one limit and the eligible SQL they embed."""
    eligible: EligibleSql | None
    operation: Any  # the vendor's (vendors/claiming.py)
    plan: Any
    floored: bool  # takes the FLOOR parameter (claims in id order)


def ordering_terms(order_by: Iterable[Any]) -> tuple[dict[str, BaseExpression], list[OrderTerm]]:
    """Turn a QuerySet's explicit order_by() into annotations plus sort directions."""
    annotations: dict[str, BaseExpression] = {}
    terms: list[OrderTerm] = []
    for i, item in enumerate(order_by):
        alias = f"dbw_o{i}"
        descending = nulls_first = nulls_last = False
        if isinstance(item, str):
            if item == "?":
                raise ValueError("eligible() cannot order by '?' (random)")
            descending = item.startswith("-")
            expression: Any = F(item.lstrip("-+"))
        elif isinstance(item, OrderBy):
            expression = item.expression
            descending = item.descending
            nulls_first = bool(item.nulls_first)
            nulls_last = bool(item.nulls_last)
        else:
            expression = item
        annotations[alias] = expression
        terms.append(OrderTerm(alias, descending, nulls_first, nulls_last))
    return annotations, terms


class Claims:
    """One coordinator's claims on one database: the statements, built once per worker
    and limit, and where each worker's next claim starts (its floor)."""

    def __init__(self, alias: str, engine: Engine, vendor: Vendor, lease_seconds: float) -> None:
        self.alias, self.engine, self.vendor = alias, engine, vendor
        self.lease_seconds = lease_seconds
        self.execution = execution_table()
        self._claims: dict[tuple[str, int], ClaimStatement] = {}  # (worker, limit) -> claim
        self._floors: dict[str, tuple[int, float]] = {}  # worker -> (floor, first set at)
        # The LISTEN connection on this very alias, when there is one: claims run on it
        # (see run_raw).
        self.listener: Any = None
        # Rate-limited workers that used up their rate: seconds until the next row may
        # be claimed, as the last claim saw it (ClaimWithinLimits sets, rate_wait reads).
        self.rate_waits: dict[str, float] = {}
        # Limited workers: the candidates the last claim passed over, by limit (/metrics).
        self.throttled: dict[str, dict[str, int]] = {}
        # Fair workers: the key the next claim's turns start after (None: the first).
        self.fair_after: dict[str, str | None] = {}
        # Limited workers: the first candidate the last claim read (its next floor).
        self.first_candidate: dict[str, int] = {}

    def writing(self) -> Any:
        return engines.writing(self.engine, self.vendor)

    def source_key(self, worker: Worker) -> sa.ColumnElement[Any]:
        """Execution.source_id in the source key's own type (the vendor's conversion):
        the cast sits on the Execution side so the source's primary-key index serves
        the join."""
        column = f"{self.vendor.qn(self.execution.name)}.source_id"
        sql = self.vendor.key_from_text_sql(worker.pk_field, column)
        return self.execution.c.source_id if sql == column else sa.literal_column(sql)

    def eligible_sql(self, worker: Worker) -> EligibleSql | None:
        """The worker's eligible() as Django compiles it now (None: every row is)."""
        if worker.eligible is None:
            return None
        qs = worker.eligible_queryset()
        annotations, terms = ordering_terms(qs.query.order_by)
        values = qs.order_by().values(dbw_pk=F("pk"), **annotations)
        sql, params = values.query.get_compiler(using=self.alias).as_sql()
        return EligibleSql(sql, tuple(params), tuple(terms))

    def _candidates(self, worker: Worker, limit: Any, compiled: EligibleSql | None,
                    floored: bool = True,
                    of_key: sa.ColumnElement[bool] | None = None) -> tuple[sa.Select[Any], bool]:
        """The worker's claimable rows in claim order, up to ``limit``; ``of_key``: only
        the rows of one key (a condition on flow_key: a fair claim's turn)."""
        e = self.execution
        # Served by the index on (claimable_worker, id) that holds claimable rows only
        # (rows waiting for a due time are not in it: see promote_due).
        stmt = sa.select(e.c.id, e.c.source_id, e.c.status, e.c.attempts, e.c.ready_at,
                         e.c.crashes).where(
            e.c.claimable_worker == worker.name)
        default_order = [e.c.priority.desc(), e.c.id] if worker.prioritized else [e.c.id]
        terms = list(compiled.terms) if compiled is not None else []
        index = ("dbworker_claimable_priority" if worker.prioritized and not terms
                 else "dbworker_claimable")
        if of_key is not None:
            # (claimable_worker, flow_key, priority DESC, id): one key's rows, in order.
            stmt, index = stmt.where(of_key), "dbworker_claimable_key"
            default_order, floored = [e.c.priority.desc(), e.c.id], False
        hint = self.vendor.index_hint(index)
        if hint:
            stmt = stmt.with_hint(e, hint)
        if floored and not worker.prioritized and not terms:
            stmt = stmt.where(e.c.id >= sa.bindparam(FLOOR))
        if compiled is None:
            return stmt.order_by(*default_order).limit(limit), False
        eligible_text = engines.django_sql_to_text(compiled.sql, compiled.params).columns(
            sa.column("dbw_pk"), *[sa.column(t.alias) for t in terms]
        )
        key = self.source_key(worker)
        # A correlated EXISTS, not IN (...) or a join: the claimable index drives the
        # statement and the source is only probed by primary key for the rows it yields.
        # (SQLite would build a whole IN list, every eligible source row, i.e. the
        # history, before each claim; PostgreSQL, given a join, may hash the whole
        # source when its statistics are stale.)
        sub = eligible_text.subquery("dbw_eligible")
        probe: sa.Select[Any] = sa.select(sa.literal_column("1")).select_from(sub).where(sub.c.dbw_pk == key)
        if self.vendor.fence_exists:
            probe = probe.offset(0)
        stmt = stmt.where(probe.exists())
        if not terms:
            return stmt.order_by(*default_order).limit(limit), False
        # A custom order: each sort key is a correlated subquery probing the source by
        # primary key, so sorting costs grow with the claimable backlog, never with the
        # history or the source table.
        keys = {
            t.alias: self._sort_key(eligible_text, t.alias, key) for t in terms
        }
        return (
            stmt.order_by(*self._order_clauses(keys, terms), e.c.id).limit(limit)
        ), True

    def _sort_key(self, eligible: Any, alias: str, key: sa.ColumnElement[Any]) -> Any:
        probe = eligible.subquery(f"dbw_key_{alias}")
        return (sa.select(probe.c[alias]).where(probe.c.dbw_pk == key)
                .limit(1).scalar_subquery())

    def _order_clauses(self, keys: dict[str, Any], terms: list[OrderTerm]) -> list[Any]:
        clauses: list[Any] = []
        for t in terms:
            col = keys[t.alias]
            clause = col.desc() if t.descending else col.asc()
            if t.nulls_first or t.nulls_last:
                if self.vendor.nulls_order_syntax:
                    clause = clause.nulls_first() if t.nulls_first else clause.nulls_last()
                else:  # MySQL: sort on "is null" first
                    clauses.append(col.is_(None).asc() if t.nulls_last else col.is_(None).desc())
            clauses.append(clause)
        return clauses

    def claim(self, worker: Worker, limit: int, claimer: str) -> list[Claim]:
        """Claim up to ``limit`` rows for ``worker``; no two processes get the same row."""
        if limit <= 0:
            return []
        self.rate_waits.pop(worker.name, None)
        token = engines.new_token()
        built = self._claim_statement(worker, limit)
        params = {TOKEN: token, CLAIMER: claimer}
        if not built.floored:
            rows = built.operation.run(self, built.plan, params)
        elif worker.limited:
            rows = self._claim_within_floor(worker, built, params)
        else:
            rows = self._claim_from_floor(worker, limit, built, params)
        return [Claim(r[0], r[1], token, r[2], r[3], engines.epoch(r[4]), r[5], worker.name)
                for r in rows]

    def _claim_from_floor(self, worker: Worker, limit: int, built: ClaimStatement,
                          params: dict[str, Any]) -> list[tuple[int, str, str, int, Any, int]]:
        now = time.monotonic()
        last = self._floors.get(worker.name)
        # (floor, when it was first set); an old one goes: this claim looks from the start
        floor, since = last if last is not None and now - last[1] < FLOOR_SECONDS else (0, now)
        rows = built.operation.run(self, built.plan, {**params, FLOOR: floor})
        if floor and len(rows) < limit:  # there may be rows below it: from the start
            rest = self._claim_statement(worker, limit - len(rows))
            try:
                rows += rest.operation.run(self, rest.plan, {**params, FLOOR: 0})
            except engines.DATABASE_ERRORS:
                if not rows:
                    raise
                # The first statement committed its claims: hand those out (lost, they
                # would wait a lease); the next claim meets the failure, if it lasts.
                logger.debug("Claim below the floor failed; keeping %d claimed rows", len(rows))
            rows.sort(key=lambda r: r[0])
        if len(rows) < limit:
            # A short claim: the backlog ran out, and the next claim starts at the start,
            # with one statement.
            self._floors.pop(worker.name, None)
        else:
            # The floor moves up with each full claim, but keeps the time it was first
            # set: at least one claim in FLOOR_SECONDS looks from the start, also while
            # every claim comes back full.
            self._floors[worker.name] = (min(r[0] for r in rows), since)
        return rows

    def _claim_within_floor(self, worker: Worker, built: ClaimStatement,
                            params: dict[str, Any]) -> list[tuple[int, str, str, int, Any, int]]:
        """A limited claim from its floor: the first candidate the last claim read (no row
        below it was claimable then), for FLOOR_SECONDS at most. Without it, PostgreSQL
        walked the primary key from the start and filtered, passing over every row claimed
        before in the drain (10,000 a claim, tests/test_flow_plans.py). A row that becomes
        claimable below it (a retry, a row given back) waits for the next claim from the
        start, at most FLOOR_SECONDS; a short claim does not look again at once, as an
        unlimited one does: a limit, not an empty backlog, is what makes it short."""
        now = time.monotonic()
        last = self._floors.get(worker.name)
        floor, since = last if last is not None and now - last[1] < FLOOR_SECONDS else (0, now)
        rows = built.operation.run(self, built.plan, {**params, FLOOR: floor})
        first = self.first_candidate.pop(worker.name, None)
        if first is None:
            self._floors.pop(worker.name, None)  # nothing to claim from here: the start next
        else:
            self._floors[worker.name] = (first, since)
        return rows

    def _claim_statement(self, worker: Worker, limit: int) -> ClaimStatement:
        """The worker's claim, built again only when the limit or the eligible SQL
        changed: SQLAlchemy takes longer to build it than the database to run it."""
        eligible = self.eligible_sql(worker)
        built = self._claims.get((worker.name, limit))
        try:
            if built is not None and built.eligible == eligible:
                return built
        except Exception:  # noqa: BLE001 - a parameter that cannot be compared: build it
            pass
        values = transitions.claimed_values(self.vendor, self.lease_seconds)
        if worker.limited:
            built = self._limited_claim(worker, limit, eligible, values)
        else:
            stmt, custom_order = self._candidates(worker, limit, eligible)
            floored = not worker.prioritized and not custom_order
            operation = self.vendor.claim_operation(ordered=custom_order)
            plan = operation.plan(self.execution, stmt, transitions.locked(self.vendor, stmt),
                                  values, worker.name, self.engine.dialect)
            built = ClaimStatement(eligible, operation, plan, floored)
        self._claims[worker.name, limit] = built
        return built

    def _limited_claim(self, worker: Worker, limit: int, eligible: EligibleSql | None,
                       values: dict[str, Any]) -> ClaimStatement:
        """A claim under limits or fair (vendors/claiming.py's ClaimWithinLimits): its
        candidates are more rows than it may take, each with its key, since rows of keys
        at their limit are passed over; a keyed worker's also take turns across keys, by
        the key index (a fair worker's always, the others' when the first rows' keys
        were full). (From the start of the backlog each time: a floor would pass over
        the rows it skipped.)"""
        operation = ClaimWithinLimits(self.vendor)
        key = self._key_of(worker)
        turns = walk = None
        if worker.key_column is not None:
            turns = self._fair_turns(worker, limit, eligible, key)
            walk = self._fair_keys(worker)
        near = operation.near(limit)
        floored = False
        if worker.fair and turns is not None:
            candidates = turns
        else:
            stmt, custom = self._candidates(worker, near, eligible)
            candidates, floored = stmt.add_columns(key), not worker.prioritized and not custom
        plan = operation.plan(candidates, values, worker.name, limit, per_key=worker.per_key,
                              total=worker.total, rate=worker.rate_limit, turns=turns,
                              walk=walk, scan=near, rate_per_key=worker.rate_per_key,
                              fair=worker.fair)
        return ClaimStatement(eligible, operation, plan, floored)

    def _fair_turns(self, worker: Worker, limit: int, eligible: EligibleSql | None,
                    key: sa.ColumnElement[Any]) -> sa.Select[Any]:
        """A fair claim's candidates: the first rows of each of up to ``limit`` keys
        (ClaimWithinLimits.turns: at most MAX_TURNS; bound as FAIR_KEY % i, None for no
        turn), and of the rows without a key, each turn a
        range of the key index, in turn order (the column dbw_turn). How many rows each
        turn reads is bound too (FAIR_ROWS; FAIR_NULL_ROWS for the rows without a key,
        0 when it is not their turn)."""
        e = self.execution
        turns: list[sa.Select[Any]] = []
        count = ClaimWithinLimits.turns(limit)
        for i in range(count + 1):
            keyless = i == count
            of_key = (e.c.flow_key.is_(None) if keyless
                      else e.c.flow_key == sa.bindparam(FAIR_KEY % i, type_=sa.String()))
            rows = sa.bindparam(FAIR_NULL_ROWS if keyless else FAIR_ROWS, type_=sa.Integer())
            stmt, _ = self._candidates(worker, rows, eligible, of_key=of_key)
            turn = stmt.add_columns(key, sa.literal(i, sa.Integer()).label("dbw_turn")).subquery(
                f"dbw_turn{i}")
            turns.append(sa.select(turn))
        return sa.union_all(*turns)  # type: ignore[return-value]

    def _fair_keys(self, worker: Worker) -> FairKeys:
        """The statements that walk a keyed worker's keys in order: from the first, or
        after the key the last claim ended at; each step one probe of the key index."""
        qn, hint = self.vendor.qn, self.vendor.index_hint("dbworker_claimable_key") or ""
        ex = qn(self.execution.name)

        def step(after: str) -> str:
            return (f"SELECT e.flow_key FROM {ex} e {hint} WHERE e.claimable_worker = "
                    f":dbw_worker AND {after} ORDER BY e.flow_key LIMIT 1")

        def walk(first: str) -> sa.TextClause:
            return sa.text(
                f"WITH RECURSIVE dbw_keys (k, n) AS (SELECT ({step(first)}), 1 UNION ALL "
                f"SELECT ({step('e.flow_key > dbw_keys.k')}), dbw_keys.n + 1 FROM dbw_keys "
                "WHERE dbw_keys.k IS NOT NULL AND dbw_keys.n < :dbw_count) "
                "SELECT k FROM dbw_keys WHERE k IS NOT NULL")

        first, after = "e.flow_key IS NOT NULL", "e.flow_key > :dbw_after"
        if not self.vendor.recursive_index_probes:
            return FairKeys(sa.text(step(first)), sa.text(step(after)), recursive=False)
        return FairKeys(walk(first), walk(after))

    def _key_of(self, worker: Worker) -> sa.ColumnElement[Any]:
        """The row's key (as text) read from its source row now: the key column of the
        source row, probed by primary key (NULL for a worker with no key)."""
        column = worker.key_column
        if column is None:
            return sa.null().label("dbw_key")
        qn = self.vendor.qn
        source = sa.table(worker.table, sa.column(worker.pk_column)).alias("dbw_keysrc")
        value: sa.ColumnElement[Any] = sa.literal_column(self.vendor.text_key_sql(f"{qn('dbw_keysrc')}.{qn(column)}"))
        return (sa.select(value).select_from(source)
                .where(source.c[worker.pk_column] == self.source_key(worker))
                .scalar_subquery().label("dbw_key"))

    def run_raw(self, compiled: Any, params: dict[str, Any]) -> list[Any]:
        """Run a compiled statement in autocommit on the DB-API, on the LISTEN connection
        or a pool connection: the claim is on the path of every pickup, and SQLAlchemy's
        execution (checkout, cache key, result processing) took as long as the database
        to answer it. Errors come out as SQLAlchemy's, like every other statement's (the
        outage handling and the deadlock retry read them)."""
        sql, args = compiled.string, compiled.construct_params(params)
        listener = self.listener
        if listener is not None and listener.usable:
            # The server process that just delivered the NOTIFY this claim answers is
            # still awake: on a machine whose idle CPUs sleep, a round trip to it took
            # half as long as one to a pool connection's (0.6 vs 1.1-1.3 ms).
            try:
                return listener.run(sql, args)
            except self.engine.dialect.loaded_dbapi.Error as exc:
                if listener.usable:  # the statement failed, not the connection
                    raise self._wrapped(sql, args, exc) from exc
                # The LISTEN connection broke (the watcher drops it): the pool's turn. A
                # claim it may have committed waits for its lease, as on any lost answer.
                logger.debug("LISTEN connection lost during a claim (%s); claiming on the pool", exc)
        fairy = self.engine.raw_connection()
        dbapi: Any = fairy.driver_connection
        try:
            dbapi.autocommit = True
            try:
                with dbapi.cursor() as cursor:
                    cursor.execute(sql, args)
                    return cursor.fetchall()
            finally:
                if not dbapi.closed:
                    dbapi.autocommit = False  # (as the pool hands connections out)
        except self.engine.dialect.loaded_dbapi.Error as exc:
            if dbapi.broken or dbapi.closed:
                fairy.invalidate(exc)  # (a new connection next time)
            raise self._wrapped(sql, args, exc) from exc
        finally:
            fairy.close()  # back to the pool (or, invalidated, closed)

    def _wrapped(self, sql: str, args: Any, exc: Exception) -> sa.exc.StatementError:
        """A DB-API error as SQLAlchemy's (OperationalError for psycopg's, and so on)."""
        return sa.exc.DBAPIError.instance(sql, args, exc, self.engine.dialect.loaded_dbapi.Error,
                                          dialect=self.engine.dialect)

