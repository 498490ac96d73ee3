"""How a database makes a claim: each vendor names the operation it uses
(``Vendor.claim_operation``), and the operation both builds the statements and runs them.
Rows come back as (id, source_id, previous status, attempts after the claim, ready_at,
crashes), in claim order.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

IDS = "dbw_ids"  # the ids a locking read found (the operations that UPDATE after it)
ClaimedRow = tuple[int, str, str, int, Any, int]


class ClaimDatabase(Protocol):
    """What an operation needs of the coordinator's connections (store.claims.Claims)."""

    engine: Engine

    def writing(self) -> AbstractContextManager[Connection]: ...
    def run_raw(self, compiled: Any, params: dict[str, Any]) -> list[Any]: ...


@dataclass(frozen=True)
class ClaimPlan:
    """An operation's statements for one worker and limit, built once."""

    select: sa.Select[Any] | None  # the locking read (the operations that UPDATE after it)
    update: Any
    compiled: Any = None  # the UPDATE compiled once, run on the driver (LockAndClaimInOne)


class LockThenUpdate:
    """Lock, then claim, in one transaction: SELECT ... FOR UPDATE SKIP LOCKED, then an
    UPDATE of the ids it found. Keeps any order (an eligible() with order_by)."""

    def plan(self, execution: sa.Table, candidates: sa.Select[Any], locked: sa.Select[Any],
             values: dict[str, Any], worker: str, dialect: Any) -> ClaimPlan:
        return ClaimPlan(locked, sa.update(execution)
                         .where(execution.c.id.in_(sa.bindparam(IDS, expanding=True)))
                         .values(**values))

    def run(self, db: ClaimDatabase, plan: ClaimPlan, params: dict[str, Any]) -> list[ClaimedRow]:
        assert plan.select is not None
        with self.transaction(db) as conn:
            rows = conn.execute(plan.select, params).all()
            self.locked()
            if rows:
                conn.execute(plan.update, {**params, IDS: [r.id for r in rows]})
        return [(r[0], r[1], r[2], r[3] + 1, r[4], r[5]) for r in rows]  # attempts read before

    def transaction(self, db: ClaimDatabase) -> AbstractContextManager[Connection]:
        return db.engine.begin()

    def locked(self) -> None:
        from ..processes import failpoints

        failpoints.reached("coordinator.claim_locked")


class OneWriterThenUpdate(LockThenUpdate):
    """One writer at a time (SQLite): BEGIN IMMEDIATE takes the write lock before reading,
    so the rows read are still claimable when the UPDATE runs; the UPDATE re-checks
    claimability anyway (the guard)."""

    def plan(self, execution: sa.Table, candidates: sa.Select[Any], locked: sa.Select[Any],
             values: dict[str, Any], worker: str, dialect: Any) -> ClaimPlan:
        return ClaimPlan(candidates, sa.update(execution).where(
            execution.c.id.in_(sa.bindparam(IDS, expanding=True)),
            execution.c.claimable_worker == worker).values(**values))

    def transaction(self, db: ClaimDatabase) -> AbstractContextManager[Connection]:
        return db.writing()

    def locked(self) -> None:
        pass


class LockAndClaimInOne:
    """One statement (PostgreSQL): lock the candidates, skipping rows others hold, and
    claim them, RETURNING what a child needs. In autocommit it is one round trip, where
    BEGIN ... COMMIT around it made three (a third of pickup latency). RETURNING has no
    order, so claims in a custom order use LockThenUpdate."""

    def plan(self, execution: sa.Table, candidates: sa.Select[Any], locked: sa.Select[Any],
             values: dict[str, Any], worker: str, dialect: Any) -> ClaimPlan:
        picked = locked.cte("dbw_claim")
        update = (sa.update(execution).where(execution.c.id == picked.c.id).values(**values)
                  .returning(execution.c.id, execution.c.source_id, picked.c.status,
                             execution.c.attempts, picked.c.ready_at, execution.c.crashes,
                             execution.c.priority))
        return ClaimPlan(None, update, _compiled_once(update, dialect))

    def run(self, db: ClaimDatabase, plan: ClaimPlan, params: dict[str, Any]) -> list[ClaimedRow]:
        if plan.compiled is not None:
            rows = db.run_raw(plan.compiled, params)
        else:
            with db.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                rows = list(conn.execute(plan.update, params))
        # Put back the claim order (priority, then creation).
        rows.sort(key=lambda r: (-r[6], r[0]))
        return [(r[0], r[1], r[2], r[3], r[4], r[5]) for r in rows]


def _compiled_once(update: Any, dialect: Any) -> Any:
    """The statement compiled for the driver, when its parameters need no conversion by
    SQLAlchemy (none do for psycopg): it then runs on the driver directly. (The
    conversions are a private attribute: tests/test_private_apis.py.)"""
    compiled = update.compile(dialect=dialect)
    return None if compiled._bind_processors else compiled
