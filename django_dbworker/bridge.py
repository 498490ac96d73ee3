"""The SQLAlchemy bridge: how the coordinator claims, renews and releases rows.

The only module that imports SQLAlchemy. Tables are reflected from the database; the
eligibility QuerySet is compiled by Django and embedded in the claim statement as text,
so users never write SQLAlchemy. Times come from the database clock (vendors), so leases
mean the same on every machine.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from django.db import connections
from django.db.models import F, OrderBy
from django.db.models.expressions import BaseExpression
from sqlalchemy.engine import URL, Connection, Engine

from . import conf
from .models import CoordinatorHeartbeat, Execution
from .registry import Worker
from .status import ExecutionStatus
from .vendors import Vendor, for_connection

WORKING = ExecutionStatus.WORKING.value
LONG_AGO = datetime(2000, 1, 1)  # an ended lease (naive: every driver takes it)
# Django-only keys of DATABASES[...]["OPTIONS"] that database drivers do not accept.
DJANGO_ONLY_OPTIONS = {
    "isolation_level", "server_side_binding", "pool", "assume_role", "transaction_mode",
    "init_command", "timeout",
}


@dataclass(frozen=True)
class Claim:
    """One claimed row: what a child needs to run it, and what a release restores."""

    execution_id: int
    source_id: str
    token: str
    previous_status: str


def new_token() -> str:
    return secrets.token_hex(16)


def engine_for(alias: str, **options: Any) -> Engine:
    """A SQLAlchemy engine on the same server and credentials as DATABASES[alias]."""
    connection = connections[alias]
    sd = connection.settings_dict
    opts = dict(sd.get("OPTIONS") or {})
    connect_args = {k: v for k, v in opts.items() if k not in DJANGO_ONLY_OPTIONS}
    # No pre-ping: it would add a round trip to every claim. A connection that broke
    # fails its statement instead; SQLAlchemy then discards it and the coordinator
    # backs off and retries with a fresh one.
    kwargs: dict[str, Any] = {"pool_size": 2, "max_overflow": 4}
    if connection.vendor == "postgresql":
        url = URL.create(
            "postgresql+psycopg", username=sd.get("USER") or None,
            password=sd.get("PASSWORD") or None, host=sd.get("HOST") or None,
            port=int(sd["PORT"]) if sd.get("PORT") else None, database=sd.get("NAME"),
        )
    elif connection.vendor == "mysql":
        url = URL.create(
            "mysql+mysqldb", username=sd.get("USER") or None,
            password=sd.get("PASSWORD") or None, host=sd.get("HOST") or None,
            port=int(sd["PORT"]) if sd.get("PORT") else None, database=sd.get("NAME"),
        )
        connect_args.setdefault("charset", "utf8mb4")
        # Locking reads under READ COMMITTED lock only the rows they return.
        kwargs["isolation_level"] = "READ COMMITTED"
    elif connection.vendor == "sqlite":
        url = URL.create("sqlite", database=str(sd["NAME"]))
        # Short: while a handler runs it holds SQLite's only write lock, and a coordinator
        # stuck waiting for it would not react to signals; a failed write is retried.
        connect_args["timeout"] = 1.0
        connect_args["check_same_thread"] = False
        # One statement, one transaction; multi-statement claims say BEGIN IMMEDIATE.
        kwargs["isolation_level"] = "AUTOCOMMIT"
    else:  # pragma: no cover - vendors.for_connection rejects others first
        raise ValueError(connection.vendor)
    kwargs["connect_args"] = connect_args
    kwargs.update(conf.value("ENGINE_OPTIONS") or {})
    kwargs.update(options)
    engine = sa.create_engine(url, **kwargs)
    if connection.vendor == "sqlite":
        sa.event.listen(engine, "connect", _sqlite_on_connect)
    elif connection.vendor == "postgresql":
        sa.event.listen(engine, "connect", _postgresql_on_connect)
    return engine


def _postgresql_on_connect(dbapi_connection: Any, record: Any) -> None:
    # The coordinator's own writes (claims, renewals, releases, heartbeats) need not wait
    # for the WAL flush: if the server crashes before it, the row is simply as it was
    # (claimable, or recovered when its lease runs out). A child's commit, which is
    # synchronous, flushes everything written before it, so no outcome can outlive the
    # claim it was guarded by. This takes an fsync off every claim.
    autocommit = dbapi_connection.autocommit
    dbapi_connection.autocommit = True
    dbapi_connection.execute("SET synchronous_commit = off")
    dbapi_connection.autocommit = autocommit


def _sqlite_on_connect(dbapi_connection: Any, record: Any) -> None:
    # WAL lets children read while the coordinator writes (and the reverse); it is a
    # property of the database file, so setting it once is enough.
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.close()


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


@dataclass(frozen=True)
class OrderTerm:
    alias: str
    descending: bool
    nulls_first: bool
    nulls_last: bool


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
        self.lease_seconds = float(lease_seconds or conf.value("LEASE_SECONDS"))
        self.vendor: Vendor = for_connection(connections[self.alias])
        self.engine = engine_for(self.alias)
        self.metadata = sa.MetaData()
        self.execution = sa.Table(Execution._meta.db_table, self.metadata, autoload_with=self.engine)
        self.heartbeats = sa.Table(
            CoordinatorHeartbeat._meta.db_table, self.metadata, autoload_with=self.engine
        )
        self._sources: dict[str, sa.Table] = {}

    def close(self) -> None:
        self.engine.dispose()

    # -- SQL pieces -------------------------------------------------------------------
    def now(self) -> sa.ColumnElement[Any]:
        return sa.literal_column(self.vendor.now_sql())

    def lease_expiry(self) -> sa.ColumnElement[Any]:
        return sa.literal_column(self.vendor.now_plus_sql(self.lease_seconds))

    def source_table(self, worker: Worker) -> sa.Table:
        if worker.table not in self._sources:
            self._sources[worker.table] = sa.Table(
                worker.table, self.metadata, autoload_with=self.engine
            )
        return self._sources[worker.table]

    def source_key(self, worker: Worker) -> sa.ColumnElement[Any]:
        """Execution.source_id in the source key's own type: the cast sits on the
        Execution side so the source's primary-key index serves the join."""
        e = self.execution
        if not self.vendor.key_needs_cast(worker.pk_field):
            return e.c.source_id
        pk_type = self.source_table(worker).c[worker.pk_column].type
        return sa.cast(e.c.source_id, pk_type)

    def candidates(self, worker: Worker, limit: int) -> tuple[sa.Select[Any], bool]:
        """Claimable, eligible rows of ``worker``, in claim order, at most ``limit``;
        and whether that order is a custom one (else creation order, by id)."""
        e = self.execution
        stmt = sa.select(e.c.id, e.c.source_id, e.c.status).where(
            # Served by the index on (claimable_worker, id) that holds claimable rows only.
            e.c.claimable_worker == worker.name,
            sa.or_(e.c.next_attempt_at.is_(None), e.c.next_attempt_at <= self.now()),
        )
        if worker.eligible is None:
            return stmt.order_by(e.c.id).limit(limit), False
        qs = worker.eligible_queryset()
        annotations, terms = ordering_terms(qs.query.order_by)
        values = qs.order_by().values(dbw_pk=F("pk"), **annotations)
        sql, params = values.query.get_compiler(using=self.alias).as_sql()
        eligible = django_sql_to_text(sql, params).columns(
            sa.column("dbw_pk"), *[sa.column(t.alias) for t in terms]
        )
        key = self.source_key(worker)
        # A correlated EXISTS, not IN (...) or a join: the claimable index drives the
        # statement and the source is only probed by primary key for the rows it yields.
        # (SQLite would build a whole IN list, every eligible source row, i.e. the
        # history, before each claim; PostgreSQL, given a join, may hash the whole
        # source when its statistics are stale.)
        sub = eligible.subquery("dbw_eligible")
        probe: sa.Select[Any] = sa.select(sa.literal_column("1")).select_from(sub).where(sub.c.dbw_pk == key)
        if self.vendor.fence_exists:
            probe = probe.offset(0)
        stmt = stmt.where(probe.exists())
        if not terms:
            return stmt.order_by(e.c.id).limit(limit), False
        # A custom order: each sort key is a correlated subquery probing the source by
        # primary key, so sorting costs grow with the claimable backlog, never with the
        # history or the source table.
        keys = {
            t.alias: self._sort_key(eligible, t.alias, key) for t in terms
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

    def _claim_values(self, token: str, claimer: str) -> dict[str, Any]:
        e = self.execution
        return {
            "status": WORKING,
            "claim_token": token,
            "lease_expires_at": self.lease_expiry(),
            "attempts": e.c.attempts + 1,
            "started_at": self.now(),
            "updated_at": self.now(),
            "claimed_by": claimer,
            "next_attempt_at": None,
        }

    # -- claiming -----------------------------------------------------------------------
    def claim(self, worker: Worker, limit: int, claimer: str) -> list[Claim]:
        """Claim up to ``limit`` rows for ``worker``; no two processes get the same row."""
        if limit <= 0:
            return []
        token = new_token()
        e = self.execution
        stmt, custom_order = self.candidates(worker, limit)
        if self.vendor.name == "postgresql" and not custom_order:
            # One round trip: lock the candidates (skipping rows others hold), claim them.
            picked = stmt.with_for_update(skip_locked=True, of=e).cte("dbw_claim")
            update = (
                sa.update(e)
                .where(e.c.id == picked.c.id)
                .values(**self._claim_values(token, claimer))
                .returning(e.c.id, e.c.source_id, picked.c.status)
            )
            with self.engine.begin() as conn:
                rows = list(conn.execute(update))
            rows.sort(key=lambda r: r[0])  # RETURNING has no order; ids are creation order
        elif self.vendor.name in ("postgresql", "mysql"):
            # Lock, then claim: the SELECT keeps a custom order, which RETURNING would not.
            of = e if self.vendor.lock_of_table else None
            locked = stmt.with_for_update(skip_locked=True, of=of)
            with self.engine.begin() as conn:
                rows = list(conn.execute(locked))
                if rows:
                    conn.execute(
                        sa.update(e).where(e.c.id.in_([r.id for r in rows]))
                        .values(**self._claim_values(token, claimer))
                    )
        else:
            # SQLite: one writer at a time. BEGIN IMMEDIATE takes the write lock before
            # reading, so the rows read are still claimable when the UPDATE runs; the
            # UPDATE re-checks claimability anyway (the guard).
            with self.engine.connect() as conn:
                conn.exec_driver_sql("BEGIN IMMEDIATE")
                try:
                    rows = list(conn.execute(stmt))
                    if rows:
                        conn.execute(
                            sa.update(e)
                            .where(e.c.id.in_([r.id for r in rows]),
                                   e.c.claimable_worker == worker.name)
                            .values(**self._claim_values(token, claimer))
                        )
                    conn.exec_driver_sql("COMMIT")
                except BaseException:
                    conn.exec_driver_sql("ROLLBACK")
                    raise
        return [Claim(r[0], r[1], token, r[2]) for r in rows]

    # -- leases -------------------------------------------------------------------------
    def renew(self, claims: Iterable[Claim]) -> int:
        """Push the lease of rows this coordinator still holds; returns how many."""
        claims = list(claims)
        if not claims:
            return 0
        e = self.execution
        with self.engine.begin() as conn:
            result = conn.execute(
                sa.update(e)
                .where(
                    e.c.id.in_([c.execution_id for c in claims]),
                    e.c.claim_token.in_({c.token for c in claims}),
                    e.c.status == WORKING,
                )
                .values(lease_expires_at=self.lease_expiry(), updated_at=self.now())
            )
            return result.rowcount or 0

    def release(self, claim: Claim, *, started: bool, error: tuple[str, str] | None = None) -> bool:
        """Give a claimed row back (claimable at once), if this claim still holds it.

        A row whose handler never started returns to its previous status and attempt
        count; one whose child died keeps the attempt and records why.
        """
        e = self.execution
        values: dict[str, Any] = {
            "status": claim.previous_status if claim.previous_status != WORKING else "unfinished",
            "claim_token": None,
            "lease_expires_at": None,
            "updated_at": self.now(),
        }
        if not started:
            values["attempts"] = e.c.attempts - 1
        if error is not None:
            values.update(error_type=error[0], error_message=error[1], error_traceback="")
        with self.engine.begin() as conn:
            result = conn.execute(
                sa.update(e)
                .where(e.c.id == claim.execution_id, e.c.claim_token == claim.token,
                       e.c.status == WORKING)
                .values(**values)
            )
            return bool(result.rowcount)

    def fail(self, worker: Worker, claim: Claim, error_type: str, message: str) -> str | None:
        """Record a failed attempt from the coordinator (a child killed past its
        timeout): retried later while attempts remain, else FAILED. Returns the new
        status, or None if the claim no longer held the row."""
        from django.utils import timezone

        from .child import next_attempt

        e = self.execution
        held = sa.and_(e.c.id == claim.execution_id, e.c.claim_token == claim.token,
                       e.c.status == WORKING)
        with self.engine.begin() as conn:
            attempts = conn.execute(sa.select(e.c.attempts).where(held)).scalar()
            if attempts is None:
                return None
            values = next_attempt(worker, attempts, timezone.now())
            conn.execute(
                sa.update(e).where(held)
                .values(claim_token=None, lease_expires_at=None, error_type=error_type,
                        error_message=message, error_traceback="", updated_at=self.now(),
                        **values)
            )
            return str(values["status"])

    def recover_expired(self, worker: Worker) -> int:
        """Make WORKING rows whose lease expired claimable again (their holder is gone).

        A stale holder that wakes up later cannot commit: its token no longer matches.
        """
        e = self.execution
        expired = sa.and_(
            e.c.worker == worker.name, e.c.status == WORKING, e.c.lease_expires_at < self.now()
        )
        common = {"claim_token": None, "lease_expires_at": None, "updated_at": self.now(),
                  "error_type": "LeaseExpired",
                  "error_message": "The claim's lease expired before the handler finished "
                                   "(its process or machine stopped?)",
                  "error_traceback": ""}
        if self.vendor.name != "sqlite":
            # Lock the expired rows first, skipping any that a frozen holder still has
            # locked in an open transaction: recovery must never wait on a dead process.
            with self.engine.begin() as conn:
                ids = [r.id for r in conn.execute(
                    sa.select(e.c.id).where(expired)
                    .with_for_update(skip_locked=True,
                                     of=e if self.vendor.lock_of_table else None)
                ).all()]
                if not ids:
                    return 0
                return self._recover(conn, worker, sa.and_(expired, e.c.id.in_(ids)), common)
        with self.engine.begin() as conn:
            return self._recover(conn, worker, expired, common)

    def _recover(self, conn: Connection, worker: Worker, expired: Any,
                 common: dict[str, Any]) -> int:
        e = self.execution
        total = 0
        src = self.source_table(worker)
        source_gone = ~sa.exists().where(src.c[worker.pk_column] == self.source_key(worker))
        # Its source row was deleted while claimed: no handler can ever load it.
        total += conn.execute(
            sa.update(e).where(expired, source_gone).values(
                status=ExecutionStatus.FAILED.value, finished_at=self.now(),
                **{**common, "error_type": f"{worker.source.__name__}.DoesNotExist",
                   "error_message": "The source row was deleted while it was claimed."})
        ).rowcount or 0
        if worker.max_attempts is not None:
            total += conn.execute(
                sa.update(e).where(expired, e.c.attempts >= worker.max_attempts)
                .values(status=ExecutionStatus.FAILED.value, finished_at=self.now(), **common)
            ).rowcount or 0
        total += conn.execute(
            sa.update(e).where(expired).values(
                status=ExecutionStatus.UNFINISHED.value, **common)
        ).rowcount or 0
        return total

    # -- coordinators -------------------------------------------------------------------
    def register_coordinator(self, host: str, pid: int, workers: Iterable[str]) -> int:
        h = self.heartbeats
        with self.engine.begin() as conn:
            result = conn.execute(
                sa.insert(h).values(host=host, pid=pid, workers=",".join(workers),
                                    started_at=self.now(), heartbeat_at=self.now())
            )
            return int(result.inserted_primary_key[0])  # type: ignore[index]

    def expire_claims_of_dead(self, host: str, own_id: int | None,
                              alive: Callable[[int], bool]) -> list[int]:
        """Coordinators recorded on ``host`` whose process is gone (killed, crashed):
        end their leases now, so recovery hands their rows over at once instead of
        when the lease runs out, and forget them. Returns their pids."""
        h, e = self.heartbeats, self.execution
        with self.engine.begin() as conn:
            others = conn.execute(
                sa.select(h.c.id, h.c.pid).where(h.c.host == host, h.c.id != (own_id or 0))
            ).all()
            dead = [r for r in others if not alive(r.pid)]
            for r in dead:
                conn.execute(
                    sa.update(e)
                    .where(e.c.claimed_by == f"{host}:{r.pid}", e.c.status == WORKING)
                    .values(lease_expires_at=LONG_AGO)
                )
            if dead:
                conn.execute(sa.delete(h).where(h.c.id.in_([r.id for r in dead])))
        return [r.pid for r in dead]

    def heartbeat(self, coordinator_id: int) -> None:
        h = self.heartbeats
        with self.engine.begin() as conn:
            conn.execute(sa.update(h).where(h.c.id == coordinator_id).values(heartbeat_at=self.now()))

    def unregister_coordinator(self, coordinator_id: int) -> None:
        h = self.heartbeats
        with self.engine.begin() as conn:
            conn.execute(sa.delete(h).where(h.c.id == coordinator_id))

    # -- diagnostics --------------------------------------------------------------------
    def claim_sql(self, worker: Worker, limit: int = 1) -> str:
        """The candidate SELECT as the database sees it, for EXPLAIN and docs."""
        stmt, _ = self.candidates(worker, limit)
        return str(stmt.compile(self.engine, compile_kwargs={"literal_binds": True}))

    def execute(self, sql: str) -> list[Any]:
        with self.engine.connect() as conn:
            return list(conn.exec_driver_sql(sql).all())


class Listener:
    """PostgreSQL LISTEN on the channel the pending-row triggers NOTIFY: wakes an idle
    coordinator the moment a row is inserted, instead of at its next poll."""

    def __init__(self, bridge: Bridge, channel: str) -> None:
        # Raw DBAPI connections raise psycopg's errors, not SQLAlchemy's: wrap them so
        # the coordinator's outage handling (DATABASE_ERRORS) sees them as outages.
        try:
            self._raw = bridge.engine.raw_connection()
            conn = self._raw.driver_connection
            assert conn is not None  # a fresh connection from the pool always has one
            self._conn: Any = conn
            self._conn.autocommit = True
            self._conn.execute(f"LISTEN {channel}")
        except bridge.engine.dialect.loaded_dbapi.Error as exc:
            raise sa.exc.OperationalError(f"LISTEN {channel}", None, exc) from exc

    def fileno(self) -> int:
        return int(self._conn.pgconn.socket)

    def drain(self) -> set[str]:
        """Worker names notified since the last call (never blocks)."""
        pgconn = self._conn.pgconn
        pgconn.consume_input()
        names = set()
        while (notify := pgconn.notifies()) is not None:
            names.add(notify.extra.decode())
        return names

    def close(self) -> None:
        try:
            self._raw.invalidate()
        except Exception:  # noqa: BLE001 - closing a connection that may already be broken
            pass


def listener_for(bridge: Bridge) -> Listener | None:
    from .vendors import NOTIFY_CHANNEL

    return Listener(bridge, NOTIFY_CHANNEL) if bridge.vendor.notifies else None


DATABASE_ERRORS = (sa.exc.DBAPIError, sa.exc.OperationalError, OSError)
