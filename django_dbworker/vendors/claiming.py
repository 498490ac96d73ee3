"""How a database makes a claim: each vendor names the operation it uses
(``Vendor.claim_operation``), and the operation both builds the statements and runs them.
Rows come back as (id, source_id, previous status, attempts after the claim, ready_at,
crashes), in claim order.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from ..registration.rates import Rate

IDS = "dbw_ids"  # the ids a locking read found (the operations that UPDATE after it)
# A fair claim's parameters: the key of turn i, how many rows a key's turn reads, and how
# many the rows without a key read (0: not their turn).
FAIR_KEY, FAIR_ROWS, FAIR_NULL_ROWS = "dbw_k%d", "dbw_rows", "dbw_null_rows"
ClaimedRow = tuple[int, str, str, int, Any, int]


class ClaimDatabase(Protocol):
    """What an operation needs of the coordinator's connections (store.claims.Claims)."""

    engine: Engine
    # Per worker, seconds (database clock) until a rate-limited worker that used up its
    # rate may claim again: set by ClaimWithinLimits, read by the coordinator.
    rate_waits: dict[str, float]
    # Per worker, the candidates its last claim passed over, by the limit that held them
    # ("per_key", "total", "rate"): set by ClaimWithinLimits, read by /metrics.
    throttled: dict[str, dict[str, int]]
    # Per fair worker, the key its last claim's turns ended at (None: start from the
    # first key): set and read by ClaimWithinLimits.
    fair_after: dict[str, str | None]
    # Per limited worker, the id of the first candidate its last claim read, claimed or
    # passed over (where its next claim may start: Claims._claim_within_floor).
    first_candidate: dict[str, int]

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


@dataclass(frozen=True)
class FairKeys:
    """The statements that walk a keyed worker's keys in key order: from the first key,
    or after the key ``after``; each step is one probe of the key index, so no key's rows
    are read to find the next key, however many it has. In one statement (a recursive
    CTE), or, where the database cannot probe an index with a value the recursion gives
    it (MariaDB reads the whole range then: 400 ms a claim at 100,000 rows), one
    statement per step (``recursive`` False: ``first`` and ``after`` find one key)."""

    first: sa.TextClause
    after: sa.TextClause
    recursive: bool = True

    def walk(self, conn: Connection, worker: str, after: str | None, count: int) -> list[str]:
        """Up to ``count`` keys after ``after`` (None: from the first key), in order."""
        if count <= 0:
            return []
        if self.recursive:
            params = {"dbw_worker": worker, "dbw_count": count, "dbw_after": after}
            return list(conn.execute(self.first if after is None else self.after, params).scalars())
        keys: list[str] = []
        while len(keys) < count:
            key = conn.execute(self.first if after is None else self.after,
                               {"dbw_worker": worker, "dbw_after": after}).scalar()
            if key is None:
                break
            keys.append(key)
            after = key
        return keys


@dataclass(frozen=True)
class LimitPlan:
    """A limited worker's claim (per_key, total) for one claim size, built once."""

    candidates: sa.Select[Any]  # claimable rows in claim order, each with its key (dbw_key)
    values: dict[str, Any]  # what a claim writes (transitions.claimed_values)
    worker: str
    limit: int
    per_key: int | None
    total: int | None
    rate: Rate | None = None
    # A keyed worker's turns (Claims._fair_turns: the first rows of each of the next keys,
    # which ``walk`` finds): a fair worker's candidates; for the others, read when the
    # first ``scan`` candidates' keys were full (a key's backlog hid the keys behind it).
    turns: sa.Select[Any] | None = None
    walk: FairKeys | None = None
    scan: int = 0
    rate_per_key: bool = False  # the rate holds for each key apart
    fair: bool = False  # claims take turns across keys

    @property
    def keyed(self) -> bool:
        """Whether a limit holds per key (per_key, or a rate per key)."""
        return self.per_key is not None or (self.rate is not None and self.rate_per_key)

    @property
    def worker_rate(self) -> Rate | None:
        return None if self.rate_per_key else self.rate


class ClaimWithinLimits:
    """A claim that keeps limits shared by every host: at most ``per_key`` rows of one
    key WORKING, at most ``total`` of the worker, at most ``rate`` claimed rows in any
    window of its period. One transaction, on every database:

    1. read the candidates, each with its key read from its source row now;
    2. lock the worker's FlowLock row ("": the total and the rate; waited for, claims
       hold it for milliseconds) and the rows of the candidates' keys (skipping a key
       another claim holds: its rows wait for the next claim, nobody waits for them);
    3. count the WORKING rows of the worker and of each key locked, and the rows the
       worker's RateLog says were claimed in the last period: under the lock, the counts
       include every claim made before (read committed: each statement sees what was
       committed before it);
    4. take candidates in claim order while their key and the worker have room, lock
       them (skipping rows others hold) and claim them, writing each one's key, and log
       how many were claimed (rate).

    No count of running rows is kept: a row that stops WORKING, however it stops (its
    outcome, a release, recovery after its lease), frees its place. SQLite has one
    writer at a time (BEGIN IMMEDIATE): no row locks, the guard in the UPDATE suffices.

    The rate is exact in any window, not only in fixed ones: a claim at time t counts
    every logged claim after t - period, also those logged at a later time by claims
    that committed before it (PostgreSQL's now() is the transaction's start)."""

    # How many candidates a claim reads for each row it may take: the rows of keys at
    # their limit are skipped, and the rows behind them run. A few (each costs a probe of
    # its source row for its key: reading 200 made a claim of 2 rows take four times as
    # long); when they were not enough, the turns of the next keys (LimitPlan.turns).
    NEAR_PER_ROW, MIN_NEAR = 4, 16
    # How many keys a claim walks and takes turns across at most: each is one branch of
    # the turns' UNION ALL, and a claim may be for thousands of rows (a coordinator's
    # children times the rows each is given ahead), where SQLite refuses a compound
    # statement of more than 500 branches and the others would read thousands of ranges.
    # A claim of more rows than this gives each key more rows instead.
    MAX_TURNS = 64
    # How long a claim waits for the worker's lock row ("": total, rate) before it gives
    # up with the database's lock-timeout error (retried as contention): a claimer frozen
    # while it held the lock (a coordinator stopped mid-claim) must not stop every other.
    LOCK_WAIT_SECONDS = 2
    # How many times a claim reads its candidates again when another claim took every row
    # it picked before it could lock them.
    ROUNDS = 3

    def __init__(self, vendor: Any) -> None:
        self.vendor = vendor

    @classmethod
    def turns(cls, limit: int) -> int:
        """How many keys a claim of ``limit`` rows takes turns across at most."""
        return min(limit, cls.MAX_TURNS)

    @classmethod
    def near(cls, limit: int) -> int:
        """How many candidates a claim that is not fair reads first."""
        return max(limit * cls.NEAR_PER_ROW, cls.MIN_NEAR)

    def plan(self, candidates: sa.Select[Any], values: dict[str, Any], worker: str,
             limit: int, **limits: Any) -> LimitPlan:
        return LimitPlan(candidates, values, worker, limit, **limits)

    def run(self, db: ClaimDatabase, plan: LimitPlan, params: dict[str, Any]) -> list[ClaimedRow]:
        from ..store.tables import execution_table

        e = execution_table()
        with self.transaction(db) as conn:
            if plan.total is not None or plan.worker_rate is not None:
                # The worker's lock before the candidates: read after it, they are what
                # the claim before this one left (read before, they were often that
                # claim's rows, and this one came back empty with rows left).
                self._locks(conn, plan.worker, [""], wait=True)
            counted: tuple[float, str] | None = None
            rooms: dict[str, tuple[int, str]] = {}
            for _ in range(self.ROUNDS):
                if plan.fair:
                    rows, turns = self._turns(db, conn, plan, params)
                else:
                    rows, turns = list(conn.execute(plan.candidates, params).all()), {}
                    if rows:
                        db.first_candidate.setdefault(plan.worker, min(r.id for r in rows))
                if not rows:
                    return []
                if counted is None:
                    counted = self._worker_room(db, conn, plan)
                room, binding = counted
                picked, held = self._pick(conn, plan, rows, room, binding, rooms)
                if (not plan.fair and plan.turns is not None
                        and len(picked) < min(plan.limit, room) and len(rows) >= plan.scan):
                    # The first candidates' keys were full: the next keys' first rows,
                    # which their index finds however long the backlog in front of them.
                    rows, turns = self._turns(db, conn, plan, params)
                    picked, held = self._pick(conn, plan, rows, room, binding, rooms)
                if turns:
                    self._turns_taken(db, plan, turns, picked)
                db.throttled[plan.worker] = held
                if not picked:
                    if held["rate"] and room > 0 and plan.rate_per_key:
                        self._rate_wait(db, conn, plan, keys=[
                            k for k, (n, why) in rooms.items() if n <= 0 and why == "rate"])
                    return []
                ids = self._lock_rows(conn, e, plan.worker, [r.id for r in picked])
                if ids:
                    picked = [r for r in picked if r.id in ids]
                    break
                # Every row it picked was taken by a claim that committed after this one
                # read them (a keyed claim reads before any lock): read again, rather than
                # come back empty and leave the coordinator idle with rows left.
            else:
                return []
            room -= len(picked)
            key_of = {r.id: r.dbw_key for r in picked}
            flow_key = (sa.case(key_of, value=e.c.id) if len(set(key_of.values())) > 1
                        else sa.literal(picked[0].dbw_key, sa.String()))
            claimed = conn.execute(
                sa.update(e).where(e.c.id.in_(list(key_of)), e.c.claimable_worker == plan.worker)
                .values(**plan.values, flow_key=flow_key), params).rowcount
            if claimed != len(picked):  # (the lock, or BEGIN IMMEDIATE, rules this out)
                raise RuntimeError(f"claim of {len(picked)} rows changed {claimed}")
            if plan.rate is not None:
                self._log_rate(conn, plan, picked)
                if room <= 0 and len(rows) > len(picked) and plan.worker_rate is not None:
                    self._rate_wait(db, conn, plan)  # used up, with rows left
        return [(r[0], r[1], r[2], r[3] + 1, r[4], r[5]) for r in picked]

    def transaction(self, db: ClaimDatabase) -> AbstractContextManager[Connection]:
        return db.writing() if self.vendor.autocommit_engine else db.engine.begin()

    def _turns(self, db: ClaimDatabase, conn: Connection, plan: LimitPlan,
               params: dict[str, Any]) -> tuple[list[Any], dict[int, tuple[int, str | None]]]:
        """A fair claim's candidates, round-robin: the next keys after the one the last
        claim ended at (wrapping to the first key, and then giving the rows without a key
        a turn), each key's first rows; then the first row of every key, the second of
        every key, and so on. Returns them with each one's turn: by row id, (turn, key), the
        key None for the rows without one."""
        assert plan.walk is not None and plan.turns is not None
        after = db.fair_after.get(plan.worker)
        count = self.turns(plan.limit)
        keys: list[str | None] = list(plan.walk.walk(conn, plan.worker, after, count))
        if len(keys) < count:
            # The end of the keys: the rows without a key take their turn (one a round),
            # then round again from the first key.
            again = (plan.walk.walk(conn, plan.worker, None, count - len(keys))
                     if after is not None else [])
            keys.append(None)
            keys += [k for k in again if k not in keys]
        # Each turn may fill the claim, less one row for every other turn: a key alone
        # takes the whole claim, and a thousand keys one row each; but no turn reads more
        # than twice its even share (a claim of 4,096 rows over 64 keys reads 128 a key,
        # not 4,033). (The rows without a key are not counted: their turn is often empty.)
        keyed = max(sum(k is not None for k in keys), 1)
        rows_per_turn = max(min(plan.limit - (keyed - 1), 2 * -(-plan.limit // keyed)), 1)
        turn_params: dict[str, str | None] = {FAIR_KEY % i: None for i in range(count)}
        turn_params.update({FAIR_KEY % i: k for i, k in enumerate(keys) if k is not None})
        null_turn = keys.index(None) if None in keys else -1
        rows = conn.execute(plan.turns, {
            **params, **turn_params, FAIR_ROWS: rows_per_turn,
            FAIR_NULL_ROWS: rows_per_turn if null_turn >= 0 else 0}).all()
        # Turn i holds the rows of keys[i]; the keyless turn is the statement's last.
        order = {i: i for i in range(len(keys))}
        if null_turn >= 0:
            order[count] = null_turn
        ranked: list[tuple[int, int, Any]] = []
        seen: Counter[int] = Counter()
        for r in rows:  # (each turn's rows come in its claim order: rank them)
            turn = order[r.dbw_turn]
            ranked.append((seen[turn], turn, r))
            seen[turn] += 1
        ranked.sort(key=lambda t: (t[0], t[1]))
        # The next claim starts after the last key walked; _turns_taken moves it back to
        # the last key served when this claim fills up first. (None: from the first key.)
        db.fair_after[plan.worker] = keys[-1]
        return [r for _, _, r in ranked], {r.id: (t, keys[t]) for _, t, r in ranked}

    def _turns_taken(self, db: ClaimDatabase, plan: LimitPlan,
                     turns: dict[int, tuple[int, str | None]], picked: list[Any]) -> None:
        """Where the next fair claim starts. A full claim: after the last key it took a
        row of (the keys after it had no turn). Else every turn took what it could:
        after the last key walked (``_turns`` set it)."""
        if picked and len(picked) >= plan.limit:
            db.fair_after[plan.worker] = max(turns[r.id] for r in picked)[1]

    def _pick(self, conn: Connection, plan: LimitPlan, rows: Sequence[Any], room: float,
              binding: str, rooms: dict[str, tuple[int, str]]) -> tuple[list[Any], dict[str, int]]:
        """The candidates to claim, in claim order, while the worker (``room``) and their
        key have room; and how many each limit held back. The keys' rooms are counted
        under their locks the first time a key is seen (``rooms`` keeps them, each with
        the limit that binds it: a key not locked has none, another claim holds it)."""
        if plan.keyed and room > 0:
            new = {r.dbw_key for r in rows if r.dbw_key is not None} - rooms.keys()
            if new:
                counted = self._key_rooms(conn, plan, new)
                rooms.update({k: counted.get(k, (0, "per_key")) for k in new})
        left = {k: n for k, (n, _) in rooms.items()}
        picked: list[Any] = []
        held = dict.fromkeys(("per_key", "total", "rate"), 0)
        for i, r in enumerate(rows):
            if len(picked) >= plan.limit:
                break
            if room <= 0:
                held[binding] += len(rows) - i  # the worker's limit holds the rest
                break
            if plan.keyed and r.dbw_key is not None:
                if left.get(r.dbw_key, 0) <= 0:
                    # Over its key's limit or rate, or its key is another claim's now.
                    held[rooms[r.dbw_key][1]] += 1  # (every key seen is in rooms)
                    continue
                left[r.dbw_key] -= 1
            picked.append(r)
            room -= 1
        return picked, held

    def _locks(self, conn: Connection, worker: str, keys: list[str], *, wait: bool) -> set[str]:
        """Lock the FlowLock rows of these keys (made where missing), in key order;
        ``wait``: wait for a row another claim holds, else skip it. Returns the keys locked."""
        from ..store.tables import flow_lock_table

        lock = flow_lock_table()

        def locking(these: list[str]) -> set[str]:
            select = (sa.select(lock.c.key).where(lock.c.worker == worker, lock.c.key.in_(these))
                      .order_by(lock.c.key))
            if self.vendor.row_locks:
                select = select.with_for_update(skip_locked=not wait)
                if wait:  # (claims hold it for milliseconds: a long wait is a frozen holder)
                    select = self.vendor.bounded_lock_wait(conn, select, self.LOCK_WAIT_SECONDS)
            return {k for (k,) in conn.execute(select)}

        # Lock first: once a key's row exists (every claim but its first), one statement.
        locked = locking(keys)
        rest = set(keys) - locked
        if rest:  # each missing, or (skip_locked) held by another claim
            present = {k for (k,) in conn.execute(sa.select(lock.c.key).where(
                lock.c.worker == worker, lock.c.key.in_(sorted(rest))))}
            missing = sorted(rest - present)
            if missing:
                conn.execute(self.vendor.insert_missing(
                    lock, [{"worker": worker, "key": k} for k in missing]))
            # A key waited for may be present now and not locked: another claim made its
            # row and committed between the first statement and the look. It must be
            # locked all the same: two claims that both went on without it both counted
            # the same rows (a total of 3 claimed 4). A key skipped stays skipped.
            again = sorted(rest) if wait else missing
            if again:
                locked |= locking(again)
        return locked

    def _worker_room(self, db: ClaimDatabase, conn: Connection,
                     plan: LimitPlan) -> tuple[float, str]:
        """How many rows the worker's own limits let this claim take, and which binds
        (counted under the worker's lock, taken before the candidates were read); when
        the rate is used up, the coordinator is told when its next token comes."""
        total_room, rate_room = self._total_room(conn, plan), self._rate_room(conn, plan)
        room, binding = (rate_room, "rate") if rate_room < total_room else (total_room, "total")
        if room <= 0 and plan.worker_rate is not None:
            self._rate_wait(db, conn, plan)
        return room, binding

    def _total_room(self, conn: Connection, plan: LimitPlan) -> float:
        if plan.total is None:
            return float("inf")
        from ..store.tables import execution_table

        e = execution_table()
        running = conn.execute(sa.select(sa.func.count()).select_from(e).where(
            e.c.worker == plan.worker, e.c.status == "working")).scalar_one()
        return plan.total - running

    def _rate_room(self, conn: Connection, plan: LimitPlan) -> float:
        """How many rows the worker's rate allows now: its count less the rows claimed in
        the last period, under the worker's lock, which run() took (older log rows are
        deleted on the way).
        A rate per key deletes old rows here too; its count is each key's (_key_rooms)."""
        if plan.rate is None:
            return float("inf")
        from ..store.tables import rate_log_table

        log = rate_log_table()
        conn.execute(sa.delete(log).where(log.c.worker == plan.worker,
                                          log.c.at <= self._now(-plan.rate.seconds)))
        if plan.rate_per_key:
            return float("inf")
        used = conn.execute(sa.select(sa.func.coalesce(sa.func.sum(log.c.claimed), 0))
                            .where(log.c.worker == plan.worker)).scalar_one()
        return plan.rate.limit - int(used)

    def _log_rate(self, conn: Connection, plan: LimitPlan, picked: list[Any]) -> None:
        """Log the claim: its rows, or for a rate per key the rows of each key (a row
        without a key is not limited per key, and not logged)."""
        from ..store.tables import rate_log_table

        if not plan.rate_per_key:
            entries = [{"key": None, "claimed": len(picked)}]
        else:
            per_key = Counter(r.dbw_key for r in picked if r.dbw_key is not None)
            entries = [{"key": k, "claimed": n} for k, n in sorted(per_key.items())]
        if entries:
            conn.execute(sa.insert(rate_log_table()).values(
                worker=plan.worker, at=self._now()), entries)

    def _rate_wait(self, db: ClaimDatabase, conn: Connection, plan: LimitPlan,
                   keys: list[str] | None = None) -> None:
        """Tell the coordinator when the next row may be claimed: the oldest claim in the
        window (of one of ``keys``, for a rate per key: the first of them to get a token)
        leaves it one period after it was logged."""
        from ..store.engine import as_datetime
        from ..store.tables import rate_log_table

        assert plan.rate is not None
        log = rate_log_table()
        mine = log.c.worker == plan.worker
        if keys is not None:
            if not keys:
                return
            # Each key gets a token when its oldest entry leaves the window: the first of
            # them when the oldest entry of all these keys does.
            mine = sa.and_(mine, log.c.key.in_(sorted(keys)))
        oldest, now = conn.execute(sa.select(sa.func.min(log.c.at), self._now()).where(mine)).one()
        if oldest is None:
            return
        age = (as_datetime(now) - as_datetime(oldest)).total_seconds()
        db.rate_waits[plan.worker] = max(plan.rate.seconds - age, 0.0)

    def _now(self, seconds: float | None = None) -> sa.ColumnElement[Any]:
        return sa.literal_column(self.vendor.now_sql() if seconds is None
                                 else self.vendor.now_plus_sql(seconds))

    def _key_rooms(self, conn: Connection, plan: LimitPlan,
                   keys: set[str]) -> dict[str, tuple[int, str]]:
        """Each key's room, counted under its lock (keys another claim holds are left out),
        with the limit that binds it: per_key (its WORKING rows) or rate (its rows claimed
        in the last period)."""
        from ..store.tables import execution_table, rate_log_table

        e = execution_table()
        locked = sorted(self._locks(conn, plan.worker, sorted(keys), wait=False))
        if not locked:
            return {}
        rooms = {k: (2**31, "per_key") for k in locked}
        if plan.per_key is not None:
            running: dict[str, int] = dict(conn.execute(
                sa.select(e.c.flow_key, sa.func.count()).where(
                    e.c.worker == plan.worker, e.c.flow_key.in_(locked),
                    e.c.status == "working").group_by(e.c.flow_key)).all())
            rooms = {k: (plan.per_key - running.get(k, 0), "per_key") for k in locked}
        if plan.rate is not None and plan.rate_per_key:
            log = rate_log_table()
            used: dict[str, int] = {k: int(n) for k, n in conn.execute(
                sa.select(log.c.key, sa.func.sum(log.c.claimed)).where(
                    log.c.worker == plan.worker, log.c.key.in_(locked)).group_by(log.c.key))}
            for k in locked:
                left = plan.rate.limit - used.get(k, 0)
                if left < rooms[k][0]:
                    rooms[k] = (left, "rate")
        return rooms

    def _lock_rows(self, conn: Connection, e: sa.Table, worker: str, ids: list[int]) -> set[int]:
        """The rows among ``ids`` still claimable, locked (skipping rows others hold)."""
        if not self.vendor.row_locks:
            return set(ids)  # one writer at a time: the UPDATE's guard is enough
        from ..processes import failpoints

        found = {i for (i,) in conn.execute(
            sa.select(e.c.id).where(e.c.id.in_(ids), e.c.claimable_worker == worker)
            .order_by(e.c.id).with_for_update(skip_locked=True))}
        failpoints.reached("coordinator.claim_locked")
        return found
