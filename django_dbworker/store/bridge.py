"""The coordinator's side of the store: one object per coordinator and database alias
that holds its engine and tables, and runs on them the claim (claims.py), the store's
transitions (transitions.py), heartbeats and the reads operations ask for.

Times come from the database clock, so leases mean the same on every machine. What
differs per database is asked of the vendor.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa
from django.db import connections
from sqlalchemy.engine import Connection, Engine

from .. import conf
from ..models import CoordinatorHeartbeat, WorkerPause
from ..processes.protocol import Claim
from ..registration.registry import Worker, registry
from ..status import ExecutionStatus
from ..vendors import Vendor, for_connection
from . import transitions
from .claims import Claims, EligibleSql
from .engine import as_datetime, engine_for, writing
from .errors import exception_path
from .retry import RetryDecision
from .session import OnEngine
from .tables import execution_table

logger = logging.getLogger("django_dbworker.coordinator")

WORKING = ExecutionStatus.WORKING.value
FAILED_FOR_GOOD = RetryDecision(ExecutionStatus.FAILED, None)


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
        self.claims = Claims(self.alias, self.engine, self.vendor, self.lease_seconds)

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
        return self.claims.source_key(worker)

    # -- claiming -----------------------------------------------------------------------
    def claim(self, worker: Worker, limit: int, claimer: str) -> list[Claim]:
        """Claim up to ``limit`` rows for ``worker``; no two processes get the same row."""
        return self.claims.claim(worker, limit, claimer)

    def rate_wait(self, worker: Worker) -> float | None:
        """Seconds until ``worker`` may claim again, when its last claim used up its rate
        with rows left (None: no rate holds it back)."""
        return self.claims.rate_waits.get(worker.name)

    def throttled(self) -> dict[str, dict[str, int]]:
        """Per limited worker, the rows its last claim passed over, by the limit that held
        them (per_key, total, rate); at most the claim's candidates."""
        return dict(self.claims.throttled)

    def eligible_sql(self, worker: Worker) -> EligibleSql | None:
        return self.claims.eligible_sql(worker)

    @property
    def claim_listener(self) -> Any:
        """The LISTEN connection on this very alias, when there is one: claims run on it
        (Claims.run_raw)."""
        return self.claims.listener

    @claim_listener.setter
    def claim_listener(self, listener: Any) -> None:
        self.claims.listener = listener

    @contextmanager
    def writing(self) -> Iterator[Connection]:
        """One transaction for statements that must commit together (engine.writing)."""
        with writing(self.engine, self.vendor) as conn:
            yield conn

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
        return (as_datetime(due) - as_datetime(now)).total_seconds()

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
                    ages[firsts[row[0]]] = (as_datetime(row[2]) - as_datetime(row[1])).total_seconds()
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
