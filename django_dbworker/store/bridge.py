"""The SQLAlchemy bridge: how the coordinator claims, renews and releases rows.

The only module that imports SQLAlchemy. Tables are reflected from the database; the
eligibility QuerySet is compiled by Django and embedded in the claim statement as text,
so users never write SQLAlchemy. Times come from the database clock, so leases mean the
same on every machine. What differs per database (SQL fragments, how a claim is made,
connection set-up) is asked of the vendor; this module implements each claim strategy
once.
"""

from __future__ import annotations

import logging
import re
import secrets
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from django.db import connections
from django.db.models import F, OrderBy
from django.db.models.expressions import BaseExpression
from sqlalchemy.engine import URL, Connection, Engine

from .. import conf
from ..coordinator.changewait import ChangeWait
from ..models import CoordinatorHeartbeat, WorkerPause
from ..processes import failpoints
from ..processes.protocol import Claim
from ..registration.registry import Worker, registry
from ..status import ExecutionStatus
from ..vendors import NOTIFY_CHANNEL, Vendor, for_connection
from . import transitions
from .errors import exception_path
from .retry import RetryDecision
from .session import OnEngine
from .tables import execution_table

logger = logging.getLogger("django_dbworker.coordinator")

WORKING = ExecutionStatus.WORKING.value
FAILED_FOR_GOOD = RetryDecision(ExecutionStatus.FAILED, None)
# Django-only keys of DATABASES[...]["OPTIONS"] that database drivers do not accept.
DJANGO_ONLY_OPTIONS = {
    "isolation_level", "server_side_binding", "pool", "assume_role", "transaction_mode",
    "init_command", "timeout",
}


def _as_datetime(value: Any) -> datetime:
    """A database timestamp as a naive UTC datetime (SQLite's clock comes back as text)."""
    if not isinstance(value, datetime):
        value = datetime.fromisoformat(str(value))
    return value.replace(tzinfo=None) if value.tzinfo is None else (
        value.astimezone(UTC).replace(tzinfo=None))


def _epoch(value: Any) -> float | None:
    return None if value is None else _as_datetime(value).replace(tzinfo=UTC).timestamp()


def new_token() -> str:
    return secrets.token_hex(16)


# The coordinator's threads share this pool (system check E014 keeps it large enough).
POOL_DEFAULTS = {"pool_size": 2, "max_overflow": 4}


def engine_for(alias: str, lease_seconds: float | None = None, **options: Any) -> Engine:
    """A SQLAlchemy engine on the same server and credentials as DATABASES[alias]."""
    connection = connections[alias]
    vendor = for_connection(connection)
    sd = connection.settings_dict
    given = {k: v for k, v in (sd.get("OPTIONS") or {}).items() if k not in DJANGO_ONLY_OPTIONS}
    kwargs: dict[str, Any] = {
        **POOL_DEFAULTS,
        # No pre-ping: it would add a round trip to every claim. A connection that broke
        # fails its statement instead; it is discarded (SQLAlchemy discards the pool's
        # connections; a claim's, see _run_raw, its own) and the coordinator's outage
        # handling takes over.
        # No rollback when a connection goes back to the pool: every use ends its own
        # transaction (engine.begin() commits or rolls back), and after a database
        # restart that rollback only fails noisily on a dead socket.
        "pool_reset_on_return": None,
        "connect_args": vendor.connect_args(given),
        **vendor.engine_options(sd),
    }
    kwargs.update(conf.value("ENGINE_OPTIONS") or {})
    kwargs.update(options)
    engine = sa.create_engine(URL.create(vendor.sqlalchemy_driver, **vendor.url_parts(sd)),
                              **kwargs)
    lease = float(conf.value("LEASE_SECONDS") if lease_seconds is None else lease_seconds)
    sa.event.listen(engine, "connect", lambda dbapi, record: vendor.on_connect(dbapi, lease))
    settings = vendor.transaction_settings(lease)
    if settings is not None:  # (a listener only where needed: it runs on every claim)
        sa.event.listen(engine, "begin", lambda conn: _set_locally(conn, *settings))
    return engine


def _set_locally(conn: Connection, sql: str, params: tuple[Any, ...]) -> None:
    # SET LOCAL lives in a transaction block: a connection in autocommit (a claim that
    # is one statement) has none, and holds no lock between statements anyway.
    if not conn.connection.dbapi_connection.autocommit:  # type: ignore[union-attr]
        conn.exec_driver_sql(sql, params)


_BIND_COLON = re.compile(r"(?<![:\w\\]):(?=\w)")
_DJANGO_PARAM = re.compile(r"%%|%s")


def django_sql_to_text(sql: str, params: Sequence[Any], prefix: str = "dbw_p") -> sa.TextClause:
    """Django's compiled SQL (``%s`` placeholders) as a SQLAlchemy ``text()``."""
    sql = _BIND_COLON.sub(r"\\:", sql)  # a literal ':x' must not become a bind parameter
    binds: dict[str, Any] = {}

    def replace(match: re.Match[str]) -> str:
        if match.group() == "%%":
            return "%"
        name = f"{prefix}{len(binds)}"
        binds[name] = params[len(binds)]
        return f":{name}"

    converted = _DJANGO_PARAM.sub(replace, sql)
    clause = sa.text(converted)
    return clause.bindparams(*[sa.bindparam(k, v) for k, v in binds.items()]) if binds else clause


TOKEN, CLAIMER, IDS = "dbw_token", "dbw_claimer", "dbw_ids"  # a claim's parameters
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
    strategy: str
    select: sa.Select[Any] | None  # the locking read (the strategies that UPDATE after it)
    update: Any
    floored: bool  # takes the FLOOR parameter (claims in id order)
    compiled: Any = None  # "returning": the UPDATE compiled once, run on the DB-API


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


class Bridge:
    """Claims and lease bookkeeping for one coordinator, on one database alias."""

    def __init__(self, alias: str | None = None, lease_seconds: float | None = None) -> None:
        self.alias = alias or conf.value("DATABASE")
        self.lease_seconds = float(conf.value("LEASE_SECONDS") if lease_seconds is None
                                   else lease_seconds)
        self.vendor: Vendor = for_connection(connections[self.alias])
        self.engine = engine_for(self.alias, self.lease_seconds)
        self.metadata = sa.MetaData()
        self.execution = execution_table()
        self.heartbeats = sa.Table(
            CoordinatorHeartbeat._meta.db_table, self.metadata, autoload_with=self.engine
        )
        self.pauses = sa.Table(WorkerPause._meta.db_table, self.metadata, autoload_with=self.engine)
        self._sources: dict[str, sa.Table] = {}
        self.listen_engine: Engine | None = None  # (DBWORKER["LISTEN_DATABASE"])
        self._probe: Any = None  # raw connection of change_token()
        self._probe_token: tuple[Any, ...] | None = None  # its last whole answer
        self._claims: dict[tuple[str, int], ClaimStatement] = {}  # (worker, limit) -> claim
        self._floors: dict[str, tuple[int, float]] = {}  # worker -> (floor, first set at)
        # The LISTEN connection on this very alias, when there is one: claims run on it
        # (see _run_raw).
        self.claim_listener: Listener | None = None

    def close(self) -> None:
        self._drop_probe()
        self.engine.dispose()
        if self.listen_engine is not None:
            self.listen_engine.dispose()

    # -- SQL pieces -------------------------------------------------------------------
    def now(self) -> sa.ColumnElement[Any]:
        return sa.literal_column(self.vendor.now_sql())

    def source_table(self, worker: Worker) -> sa.Table:
        if worker.table not in self._sources:
            self._sources[worker.table] = sa.Table(
                worker.table, self.metadata, autoload_with=self.engine
            )
        return self._sources[worker.table]

    def source_key(self, worker: Worker) -> sa.ColumnElement[Any]:
        """Execution.source_id in the source key's own type (the vendor's conversion):
        the cast sits on the Execution side so the source's primary-key index serves
        the join."""
        column = f"{self.vendor.qn(self.execution.name)}.source_id"
        sql = self.vendor.key_from_text_sql(worker.pk_field, column)
        return self.execution.c.source_id if sql == column else sa.literal_column(sql)

    def _locked(self, select: sa.Select[Any]) -> sa.Select[Any]:
        return transitions.locked(self.vendor, select)

    def eligible_sql(self, worker: Worker) -> EligibleSql | None:
        """The worker's eligible() as Django compiles it now (None: every row is)."""
        if worker.eligible is None:
            return None
        qs = worker.eligible_queryset()
        annotations, terms = ordering_terms(qs.query.order_by)
        values = qs.order_by().values(dbw_pk=F("pk"), **annotations)
        sql, params = values.query.get_compiler(using=self.alias).as_sql()
        return EligibleSql(sql, tuple(params), tuple(terms))

    def candidates(self, worker: Worker, limit: int) -> tuple[sa.Select[Any], bool]:
        """Claimable, eligible rows of ``worker``, in claim order, at most ``limit``;
        and whether that order is a custom one (else creation order, by id)."""
        stmt, custom = self._candidates(worker, limit, self.eligible_sql(worker))
        return stmt.params({FLOOR: 0}), custom  # (a claim's first floor: the start)

    def _candidates(self, worker: Worker, limit: int,
                    compiled: EligibleSql | None) -> tuple[sa.Select[Any], bool]:
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
        hint = self.vendor.index_hint(index)
        if hint:
            stmt = stmt.with_hint(e, hint)
        if not worker.prioritized and not terms:
            stmt = stmt.where(e.c.id >= sa.bindparam(FLOOR))
        if compiled is None:
            return stmt.order_by(*default_order).limit(limit), False
        eligible_text = django_sql_to_text(compiled.sql, compiled.params).columns(
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

    # -- claiming -----------------------------------------------------------------------
    def claim(self, worker: Worker, limit: int, claimer: str) -> list[Claim]:
        """Claim up to ``limit`` rows for ``worker``; no two processes get the same row."""
        if limit <= 0:
            return []
        token = new_token()
        built = self._claim_statement(worker, limit)
        params = {TOKEN: token, CLAIMER: claimer}
        if not built.floored:
            rows = CLAIM_STRATEGIES[built.strategy](self, built, params)
        else:
            rows = self._claim_from_floor(worker, limit, built, params)
        return [Claim(r[0], r[1], token, r[2], r[3], _epoch(r[4]), r[5], worker.name)
                for r in rows]

    def _claim_from_floor(self, worker: Worker, limit: int, built: ClaimStatement,
                          params: dict[str, Any]) -> list[tuple[int, str, str, int, Any, int]]:
        now = time.monotonic()
        last = self._floors.get(worker.name)
        # (floor, when it was first set); an old one goes: this claim looks from the start
        floor, since = last if last is not None and now - last[1] < FLOOR_SECONDS else (0, now)
        rows = CLAIM_STRATEGIES[built.strategy](self, built, {**params, FLOOR: floor})
        if floor and len(rows) < limit:  # there may be rows below it: from the start
            rest = self._claim_statement(worker, limit - len(rows))
            try:
                rows += CLAIM_STRATEGIES[rest.strategy](self, rest, {**params, FLOOR: 0})
            except DATABASE_ERRORS:
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
        e = self.execution
        stmt, custom_order = self._candidates(worker, limit, eligible)
        floored = not worker.prioritized and not custom_order
        strategy = self.vendor.ordered_claim_strategy if custom_order else self.vendor.claim_strategy
        values = transitions.claimed_values(self.vendor, self.lease_seconds)
        ids = e.c.id.in_(sa.bindparam(IDS, expanding=True))
        update: Any
        if strategy == "returning":
            picked = self._locked(stmt).cte("dbw_claim")
            select, update = None, (
                sa.update(e).where(e.c.id == picked.c.id).values(**values)
                .returning(e.c.id, e.c.source_id, picked.c.status, e.c.attempts,
                           picked.c.ready_at, e.c.crashes, e.c.priority))
        elif strategy == "lock_then_update":
            select, update = self._locked(stmt), sa.update(e).where(ids).values(**values)
        else:  # the UPDATE re-checks claimability (the guard)
            select, update = stmt, (sa.update(e).where(ids, e.c.claimable_worker == worker.name)
                                    .values(**values))
        compiled = None
        if strategy == "returning":
            compiled = update.compile(dialect=self.engine.dialect)
            if compiled._bind_processors:  # (none for psycopg; else SQLAlchemy converts)
                compiled = None
        built = ClaimStatement(eligible, strategy, select, update, floored, compiled)
        self._claims[worker.name, limit] = built
        return built

    def _claim_returning(self, built: ClaimStatement,
                         params: dict[str, Any]) -> list[tuple[int, str, str, int, Any, int]]:
        """One statement: lock the candidates (skipping rows others hold), claim them."""
        # One statement is its own transaction: in autocommit it is one round trip,
        # where BEGIN ... COMMIT around it made three (a third of pickup latency).
        if built.compiled is not None:
            rows = self._run_raw(built.compiled, params)
        else:
            with self.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                rows = list(conn.execute(built.update, params))
        # RETURNING has no order: put back the claim order (priority, then creation).
        rows.sort(key=lambda r: (-r[6], r[0]))
        return [(r[0], r[1], r[2], r[3], r[4], r[5]) for r in rows]

    def _run_raw(self, compiled: Any, params: dict[str, Any]) -> list[Any]:
        """Run a compiled statement in autocommit on the DB-API, on the LISTEN connection
        or a pool connection: the claim is on the path of every pickup, and SQLAlchemy's
        execution (checkout, cache key, result processing) took as long as the database
        to answer it. Errors come out as SQLAlchemy's, like every other statement's (the
        outage handling and the deadlock retry read them)."""
        sql, args = compiled.string, compiled.construct_params(params)
        listener = self.claim_listener
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

    def _claim_lock_then_update(self, built: ClaimStatement,
                                params: dict[str, Any]) -> list[tuple[int, str, str, int, Any, int]]:
        """Lock, then claim: the SELECT keeps a custom order, which RETURNING would not."""
        assert built.select is not None
        with self.engine.begin() as conn:
            rows = conn.execute(built.select, params).all()
            failpoints.reached("coordinator.claim_locked")
            if rows:
                conn.execute(built.update, {**params, IDS: [r.id for r in rows]})
        return [(r[0], r[1], r[2], r[3] + 1, r[4], r[5]) for r in rows]  # attempts read before

    def _claim_immediate_then_update(self, built: ClaimStatement,
                                     params: dict[str, Any]) -> list[tuple[int, str, str, int, Any, int]]:
        """One writer at a time: BEGIN IMMEDIATE takes the write lock before reading, so
        the rows read are still claimable when the UPDATE runs; the UPDATE re-checks
        claimability anyway (the guard)."""
        assert built.select is not None
        with self.writing() as conn:
            rows = conn.execute(built.select, params).all()
            if rows:
                conn.execute(built.update, {**params, IDS: [r.id for r in rows]})
        return [(r[0], r[1], r[2], r[3] + 1, r[4], r[5]) for r in rows]

    @contextmanager
    def writing(self) -> Iterator[Connection]:
        """One transaction for statements that must commit together, on every database:
        where the engine commits each statement (SQLite), BEGIN IMMEDIATE takes the write
        lock first and COMMIT ends it."""
        if not self.vendor.autocommit_engine:
            with self.engine.begin() as conn:
                yield conn
            return
        with self.engine.connect() as conn:
            conn.exec_driver_sql("BEGIN IMMEDIATE")
            try:
                yield conn
                conn.exec_driver_sql("COMMIT")
            except BaseException:
                conn.exec_driver_sql("ROLLBACK")
                raise

    # -- rows that wait for a due time --------------------------------------------------
    def seconds_until_due(self, worker: Worker) -> float | None:
        """Seconds (on the database clock) until the first of the worker's waiting rows
        is due (the waiting index's first entry); None when none waits."""
        e = self.execution
        with self.engine.connect() as conn:
            due, now = conn.execute(sa.select(sa.func.min(e.c.next_attempt_at), self.now())
                                    .where(e.c.waiting_worker == worker.name)).one()
        if due is None:
            return None
        return (_as_datetime(due) - _as_datetime(now)).total_seconds()

    def promote_due(self, worker: Worker) -> int:
        """Rows whose due time has come become claimable (transitions.promote)."""
        with self.writing() as conn:
            return transitions.promote(self.session(conn), worker.name)

    # -- leases -------------------------------------------------------------------------
    def session(self, conn: Connection) -> OnEngine:
        return OnEngine(conn, self.vendor)

    def renew(self, claims: Iterable[Claim]) -> int:
        """Push the lease of rows this coordinator still holds; returns how many."""
        claims = list(claims)
        if not claims:
            return 0
        with self.engine.begin() as conn:
            return transitions.renew(self.session(conn), claims, self.lease_seconds)

    def release(self, claim: Claim, decision: RetryDecision | None = None,
                error: tuple[str, str] | None = None, *, crashed: bool = False) -> bool:
        """End this claim, if it still holds the row; True if it did.

        Without ``decision`` the handler never started: the claim is undone
        (transitions.release). With one, the attempt ended without its handler's answer
        (a timeout; ``crashed``: its process died) and the retry policy's decision says
        what the row becomes (transitions.fail_or_retry); ``error`` (type, message)
        records why.
        """
        w = registry.get(claim.worker)
        recording = w if w is not None and w.records_interruptions and decision and error else None
        # (The release and the task's record of the attempt commit together.)
        with self.writing() as conn:
            session = self.session(conn)
            if decision is None:
                return transitions.release(session, claim, claim.previous_status)
            began = None
            if recording is not None:
                e = self.execution
                began = conn.execute(sa.select(e.c.started_at, e.c.claimed_by)
                                     .where(transitions.held([claim]))).first()
            failure = {"error_type": error[0], "error_message": error[1]} if error else {
                "error_type": "", "error_message": ""}
            released = bool(transitions.fail_or_retry(
                session, transitions.held([claim]), decision, failure,
                crashes="count" if crashed else "keep",
                rerun_on=bool(w is not None and w.rerun_on)))
            if released and recording is not None and began is not None:
                assert error is not None
                recording.on_interrupted(conn, self.source_table(recording), claim.source_id,
                                         claim.attempt, error, not decision.retried,
                                         began.started_at, began.claimed_by, self.now())
        if released and recording is not None:
            recording.after_interrupted(claim.source_id, not decision.retried)
        return released

    def recover_expired(self, worker: Worker) -> int:
        """Make WORKING rows whose lease expired claimable again (their holder is gone),
        or FAILED, as the worker's retry policy decides for an interrupted attempt
        (transitions.recover); a row whose source row was deleted meanwhile fails."""
        src = self.source_table(worker)
        present = sa.exists().where(src.c[worker.pk_column] == self.source_key(worker))

        def decide(row: Any) -> tuple[RetryDecision, dict[str, str]]:
            if not row.present:  # deleted while claimed: nothing can load it
                return FAILED_FOR_GOOD, {
                    "error_type": exception_path(worker.source.DoesNotExist),  # type: ignore[attr-defined]
                    "error_message": "The source row was deleted while it was claimed."}
            return worker.retry_policy.after_interruption(row.attempts), {
                "error_type": "LeaseExpired",
                "error_message": "The claim's lease expired before the handler finished "
                                 "(its process or machine stopped?)"}

        ended: list[tuple[str, bool]] = []  # (source id, final) recorded by the worker
        with self.writing() as conn:
            changed = transitions.recover(self.session(conn), worker.name, present=present,
                                          decide=decide, rerun_on=bool(worker.rerun_on))
            for row, decision in changed:
                if worker.records_interruptions and row.present:
                    final = not decision.retried
                    _, error = decide(row)
                    worker.on_interrupted(conn, src, row.source_id, row.attempts,
                                          (error["error_type"], error["error_message"]),
                                          final, row.started_at, row.claimed_by, self.now())
                    ended.append((row.source_id, final))
        for source_id, final in ended:
            worker.after_interrupted(source_id, final)
        return len(changed)

    # -- coordinators -------------------------------------------------------------------
    def register_coordinator(self, host: str, namespace: str, pid: int,
                             workers: Iterable[str]) -> int:
        h = self.heartbeats
        with self.engine.begin() as conn:
            result = conn.execute(
                sa.insert(h).values(host=host, namespace=namespace, pid=pid,
                                    workers=",".join(workers), started_at=self.now(),
                                    heartbeat_at=self.now())
            )
            return int(result.inserted_primary_key[0])  # type: ignore[index]

    def expire_claims_of_dead(self, host: str, namespace: str, own_id: int | None,
                              alive: Callable[[int], bool]) -> list[int]:
        """Coordinators of this machine and PID namespace whose process is gone (killed,
        crashed): end their leases now, so recovery hands their rows over at once instead
        of when the lease runs out, and forget them. Returns their pids."""
        h = self.heartbeats
        with self.engine.begin() as conn:
            others = conn.execute(
                sa.select(h.c.id, h.c.pid).where(h.c.host == host, h.c.namespace == namespace,
                                                 h.c.id != (own_id or 0))
            ).all()
            dead = [r for r in others if not alive(r.pid)]
            if not dead:
                return []
            # Claims say host:pid only. A coordinator of another PID namespace with the
            # same host name (a container) may have that very pid and be alive: its
            # claims read the same, so those leases are left to run out instead.
            shared = set(conn.execute(
                sa.select(h.c.pid).where(h.c.host == host, h.c.namespace != namespace,
                                         h.c.pid.in_([r.pid for r in dead]))).scalars())
            self._end_leases(conn, [f"{host}:{r.pid}" for r in dead if r.pid not in shared])
            conn.execute(sa.delete(h).where(h.c.id.in_([r.id for r in dead])))
        return [r.pid for r in dead]

    def _end_leases(self, conn: Connection, claimers: list[str]) -> None:
        transitions.end_leases(self.session(conn), claimers)

    def heartbeat(self, coordinator_id: int) -> None:
        h = self.heartbeats
        with self.engine.begin() as conn:
            conn.execute(sa.update(h).where(h.c.id == coordinator_id).values(heartbeat_at=self.now()))

    def unregister_coordinator(self, coordinator_id: int) -> None:
        h = self.heartbeats
        with self.engine.begin() as conn:
            conn.execute(sa.delete(h).where(h.c.id == coordinator_id))

    # -- change detection (where the database cannot notify) -----------------------------
    def change_token(self) -> tuple[Any, ...]:
        """The answer of the vendor's change probe (new rows, then pauses), on a raw
        connection kept for it (no pool, no SQLAlchemy statement: it runs every
        PROBE_SECONDS while idle)."""
        try:
            if self._probe is None:  # (connecting fails with the driver's error, too)
                raw = self.engine.raw_connection()
                # Each probe sees the latest commits (and holds no snapshot open).
                self.vendor.set_autocommit(raw.driver_connection)
                self._probe = raw
            quick = self.vendor.unchanged_probe_sql()
            if quick is not None and self._probe_token is not None and (
                    self.vendor.probe_row(self._probe, quick)[0] == self._probe_token[0]):
                return self._probe_token
            row = self.vendor.probe_row(self._probe, self.vendor.change_probe_sql())
        except (self.engine.dialect.loaded_dbapi.Error, sa.exc.DBAPIError) as exc:
            self._drop_probe()
            raise sa.exc.OperationalError("change probe", None, exc) from exc
        self._probe_token = row
        return row

    # -- what operations ask -------------------------------------------------------------
    def paused_workers(self) -> set[str]:
        with self.engine.connect() as conn:
            return set(conn.execute(sa.select(self.pauses.c.worker)).scalars())

    def backlog(self, workers: Iterable[Worker]) -> dict[str, tuple[int, float | None]]:
        """Worker -> (claimable rows, age in seconds of the first created of them): two
        statements on the claimable index, whose cost follows the backlog only."""
        e = self.execution
        names = [w.name for w in workers]
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(e.c.claimable_worker, sa.func.count(), sa.func.min(e.c.id))
                                .where(e.c.claimable_worker.in_(names))
                                .group_by(e.c.claimable_worker)).all()
            firsts = {r[2]: r[0] for r in rows}
            ages: dict[str, float] = {}
            if firsts:
                for row in conn.execute(sa.select(e.c.id, e.c.created_at, self.now())
                                        .where(e.c.id.in_(list(firsts)))):
                    ages[firsts[row[0]]] = (_as_datetime(row[2]) - _as_datetime(row[1])).total_seconds()
        return {r[0]: (int(r[1]), ages.get(r[0])) for r in rows}

    # -- diagnostics --------------------------------------------------------------------
    def reset_connections(self) -> None:
        """Close the pool's connections and the change probe's (after an outage: they
        were opened before it)."""
        self._drop_probe()
        self.engine.dispose()

    def _drop_probe(self) -> None:
        """Close the change probe's connection. Its last answer goes too: SQLite's
        data_version counts per connection, so a new one's is not comparable."""
        if self._probe is not None:
            self._probe.invalidate()
            self._probe = None
        self._probe_token = None

    def ping(self) -> None:
        """One round trip: raises while the database is unreachable."""
        with self.engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")

    def claim_sql(self, worker: Worker, limit: int = 1) -> str:
        """The candidate SELECT as the database sees it, for EXPLAIN and docs."""
        stmt, _ = self.candidates(worker, limit)
        return str(stmt.compile(self.engine, compile_kwargs={"literal_binds": True}))

    def execute(self, sql: str) -> list[Any]:
        with self.engine.connect() as conn:
            return list(conn.exec_driver_sql(sql).all())


CLAIM_STRATEGIES: dict[str, Callable[..., list[tuple[int, str, str, int, Any, int]]]] = {
    "returning": Bridge._claim_returning,
    "lock_then_update": Bridge._claim_lock_then_update,
    "immediate_then_update": Bridge._claim_immediate_then_update,
}


class Listener:
    """PostgreSQL LISTEN on the channel the pending-row triggers NOTIFY: wakes an idle
    coordinator the moment a row is inserted, instead of at its next poll. It listens on
    a connection of its own, from DBWORKER["LISTEN_DATABASE"] when that names another
    alias (a direct connection, when the claims go through PgBouncer); on the claims'
    own alias, claims run on that connection too (Bridge._run_raw)."""

    def __init__(self, engine: Engine, channel: str) -> None:
        # Raw DBAPI connections raise psycopg's errors, not SQLAlchemy's: wrap them so
        # the coordinator's outage handling (DATABASE_ERRORS) sees them as outages.
        self.channel = channel
        try:
            self._raw = engine.raw_connection()
            conn = self._raw.driver_connection
            assert conn is not None  # a fresh connection from the pool always has one
            self._conn: Any = conn
            self._conn.autocommit = True
            # Notifications that arrive while a statement runs on this connection (a
            # claim: see run()) are read by psycopg with its result, not left on the
            # socket: they are kept here, and the watcher sees them (heard()).
            self._heard: set[str] = set()
            self._conn.add_notify_handler(lambda notify: self._heard.add(notify.payload))
            self._conn.execute(f"LISTEN {channel}")
        except engine.dialect.loaded_dbapi.Error as exc:
            raise sa.exc.OperationalError(f"LISTEN {channel}", None, exc) from exc

    def fileno(self) -> int:
        return int(self._conn.pgconn.socket)

    def drain(self) -> set[str]:
        """Worker names notified since the last call (never blocks)."""
        pgconn = self._conn.pgconn
        pgconn.consume_input()
        names, self._heard = self._heard, set()
        while (notify := pgconn.notifies()) is not None:
            names.add(notify.extra.decode())
        return names

    def heard(self) -> bool:
        """Whether notifications wait in drain() that the socket no longer shows."""
        return bool(self._heard)

    @property
    def usable(self) -> bool:
        return not self._conn.closed and not self._conn.broken  # (closed: by close())

    def run(self, sql: str, params: dict[str, Any]) -> list[Any]:
        """One statement in autocommit on this connection, its rows; the driver's errors."""
        with self._conn.cursor() as cursor:
            cursor.execute(sql, params)
            return cursor.fetchall()

    def hears(self, bridge: Bridge, timeout: float = 2.0) -> bool:
        """Whether a NOTIFY sent the way claims go reaches this connection. Through
        PgBouncer in transaction mode it does not: LISTEN ran on a server connection the
        pool has since given to someone else."""
        import select
        import time

        probe = f".probe-{secrets.token_hex(4)}"
        with bridge.engine.begin() as conn:
            conn.execute(sa.text("SELECT pg_notify(:channel, :payload)"),
                         {"channel": self.channel, "payload": probe})
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            select.select([self], [], [], left)
            if probe in self.drain():
                return True
        return False

    def close(self) -> None:
        if self._conn.closed:
            return  # (closed already: invalidating again only warns)
        try:
            self._raw.invalidate()
        except Exception:  # noqa: BLE001 - closing a connection that may already be broken
            pass


def listener_for(bridge: Bridge, probe_seconds: float) -> Listener | ChangeWait | None:
    """A Listener, on DBWORKER["LISTEN_DATABASE"] (default: the coordination database);
    on MariaDB a ChangeWait (looking every probe_seconds in the server)."""
    if not bridge.vendor.notifies:
        return ChangeWait(bridge, probe_seconds) if bridge.vendor.pushes_changes else None
    alias = conf.value("LISTEN_DATABASE") or bridge.alias
    if alias == bridge.alias:
        # Claims run on it too: a claim answers the NOTIFY it just received. (Not on a
        # LISTEN_DATABASE of its own: that alias connects past the pooler claims go through.)
        bridge.claim_listener = Listener(bridge.engine, NOTIFY_CHANNEL)
        return bridge.claim_listener
    if bridge.listen_engine is None:
        bridge.listen_engine = engine_for(alias, bridge.lease_seconds, pool_size=1, max_overflow=0)
    return Listener(bridge.listen_engine, NOTIFY_CHANNEL)


DATABASE_ERRORS = (sa.exc.DBAPIError, sa.exc.OperationalError, OSError)
