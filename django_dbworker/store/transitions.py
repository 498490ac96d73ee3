"""Every transition of an ``Execution`` row, one named function each (see the package's
docstring for the state machine). Whoever makes a transition calls it here: the
coordinator, the child, the admin, the API and the test runner alike, so a rule is
written once. Every time written or compared is the database's (``now``).

Transitions that end a claim are guarded by it (``held``): the row's id with that claim's
token, still WORKING. A process whose claim was taken over (its lease expired) changes
nothing, and learns so from the count of rows changed.

``claimed_by`` names the coordinator that ran the row's latest attempt: it stays when an
attempt ends, however it ends, and goes when the attempt is undone (``release``) or the
row starts afresh (``reset``, ``run_again``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import sqlalchemy as sa

from ..status import ExecutionStatus
from ..vendors import Vendor
from .retry import RetryDecision
from .session import Session
from .tables import execution_table

WORKING = ExecutionStatus.WORKING.value
PENDING = ExecutionStatus.PENDING.value
UNFINISHED = ExecutionStatus.UNFINISHED.value
FINISHED = ExecutionStatus.FINISHED.value
FAILED = ExecutionStatus.FAILED.value
TOKEN, CLAIMER = "dbw_token", "dbw_claimer"  # a claim's bound parameters
CHUNK = 500  # rows per statement when a transition is given many ids


class Holding(Protocol):
    """A claim on one row: its id and the claim's token."""

    @property
    def execution_id(self) -> int: ...
    @property
    def token(self) -> str: ...


@dataclass(frozen=True, slots=True)
class Ended:
    """An attempt its handler ended, with when (seconds from now, negative: past; the
    child measured them, the database's clock says when that was)."""

    execution_id: int
    token: str
    started: float
    finished: float


# -- pieces ------------------------------------------------------------------------------
def now(vendor: Vendor, seconds: float | None = None) -> sa.ColumnElement[Any]:
    """The database's now (plus ``seconds``)."""
    return sa.literal_column(vendor.now_sql() if seconds is None else vendor.now_plus_sql(seconds))


def held(claims: Iterable[Holding]) -> sa.ColumnElement[bool]:
    """Rows still held by these claims: each id with its own token, still WORKING."""
    e = execution_table()
    by_token: dict[str, list[int]] = {}
    for claim in claims:
        by_token.setdefault(claim.token, []).append(claim.execution_id)
    return sa.and_(e.c.status == WORKING, sa.or_(*[
        sa.and_(e.c.id.in_(ids), e.c.claim_token == token) for token, ids in by_token.items()]))


def locked(vendor: Vendor, select: sa.Select[Any]) -> sa.Select[Any]:
    """``select`` locking the Execution rows it returns, skipping rows others hold:
    nobody ever waits for a row another process has locked."""
    if vendor.row_locks == "of_table":
        return select.with_for_update(skip_locked=True, of=execution_table())
    if vendor.row_locks == "rows":
        return select.with_for_update(skip_locked=True)
    return select  # one writer at a time (SQLite): the UPDATEs re-check instead


def per_row(vendor: Vendor, name: str, rows: int) -> sa.ColumnElement[Any]:
    """A time that differs per row, in one statement: ``CASE id WHEN :id0 THEN now +
    :name0 ...`` (the ids are the parameters ``held_rows`` binds; the seconds are
    ``name0``, ``name1``... in the vendor's form, ``Vendor.seconds_value``)."""
    times = [vendor.now_plus_bound(sa.bindparam(f"{name}{i}")) for i in range(rows)]
    if rows == 1:
        return times[0]
    e = execution_table()
    return sa.case(*[(e.c.id == sa.bindparam(f"{ROW_ID}{i}"), times[i]) for i in range(rows)])


ROW_ID, ROW_TOKEN = "dbw_id", "dbw_tok"  # held_rows' parameters, numbered per row


def held_rows(rows: int) -> sa.ColumnElement[bool]:
    """``held`` for ``rows`` rows whose ids and tokens are parameters (``dbw_id0``,
    ``dbw_tok0``...): one statement text for any group of that many rows."""
    e = execution_table()
    each = [sa.and_(e.c.id == sa.bindparam(f"{ROW_ID}{i}"),
                    e.c.claim_token == sa.bindparam(f"{ROW_TOKEN}{i}")) for i in range(rows)]
    return sa.and_(e.c.status == WORKING, sa.or_(*each))


def _rerun_aware(values: list[tuple[str, Any]], rerun_on: bool) -> list[tuple[str, Any]]:
    """With rerun_on, a listed column that changed while the handler ran (the trigger
    flagged the row) makes it pending again instead of ended: the change is not lost."""
    if not rerun_on:
        return [*values, ("rerun_requested", False)]
    e = execution_table()
    flagged = e.c.rerun_requested == sa.true()
    out = []
    for name, value in values:
        if name == "status":
            value = sa.case((flagged, PENDING), else_=value)
        elif name == "next_attempt_at" and value is not None:
            value = sa.case((flagged, sa.null()), else_=value)
        elif name == "rerun_reason":
            value = sa.case((flagged, e.c.rerun_reason), else_=value)
        out.append((name, value))
    # Last: MySQL assigns left to right, and the cases above read the flag.
    return [*out, ("rerun_requested", False)]


def _update(where: sa.ColumnElement[bool], values: list[tuple[str, Any]]) -> sa.Update:
    # In the order given: MySQL evaluates SET left to right, each seeing those before it.
    e = execution_table()
    return sa.update(e).where(where).ordered_values(*((e.c[k], v) for k, v in values))


# -- claim and renew ------------------------------------------------------------------------
def claimed_values(vendor: Vendor, lease_seconds: float) -> dict[str, Any]:
    """What a claim writes (its token and claimer are the bound parameters TOKEN and
    CLAIMER): the coordinator's claim statements, and the test runner's ``claim_rows``."""
    e = execution_table()
    return {
        "status": WORKING,
        "claim_token": sa.bindparam(TOKEN),
        "lease_expires_at": now(vendor, lease_seconds),
        "attempts": e.c.attempts + 1,
        "started_at": now(vendor),
        "updated_at": now(vendor),
        "claimed_by": sa.bindparam(CLAIMER),
        "rerun_requested": sa.false(),  # (a literal: no bind parameter to convert)
    }


def claim_rows(session: Session, ids: Sequence[int], token: str, claimer: str,
               lease_seconds: float) -> int:
    """Claim these rows, if they are claimable (the in-process test runner's claim; the
    coordinator's, which picks the rows too, is built by the bridge from claimed_values).
    A row waiting for a due time is claimed too, and waits no more."""
    e = execution_table()
    claimable = e.c.status.in_([PENDING, UNFINISHED])
    return sum(session.run(
        sa.update(e).where(claimable, e.c.id.in_(chunk))
        .values({**claimed_values(session.vendor, lease_seconds), "claim_token": token,
                 "claimed_by": claimer, "next_attempt_at": None})).rowcount
        for chunk in _chunks(ids))


def renew(session: Session, claims: Sequence[Holding], lease_seconds: float) -> int:
    """Push the lease of rows these claims still hold; returns how many."""
    if not claims:
        return 0
    return session.run(_update(held(claims), [
        ("lease_expires_at", now(session.vendor, lease_seconds)),
        ("updated_at", now(session.vendor))])).rowcount


# -- the handler's outcomes -------------------------------------------------------------
def finish(session: Session, attempts: Sequence[Ended], *, rerun_on: bool = False,
           rerun_every: float | None = None) -> int:
    """FINISHED: the handler is done with the row. With ``rerun_every`` (seconds) it
    waits to go stale that long after it finished. Returns rows changed."""
    stale = rerun_every is not None
    params = _ended_params(session.vendor, attempts, stale_after=rerun_every)
    return session.run(_handler_ended(session.vendor, FINISHED, len(attempts), rerun_on, stale),
                       params, shape=(FINISHED, len(attempts), rerun_on, stale)).rowcount


def continue_later(session: Session, attempts: Sequence[Ended], *,
                   rerun_on: bool = False) -> int:
    """UNFINISHED: the handler made progress and wants to run again, claimable at once
    (a continuation uses up no retries: attempts start again at 0)."""
    params = _ended_params(session.vendor, attempts)
    return session.run(_handler_ended(session.vendor, UNFINISHED, len(attempts), rerun_on, False),
                       params, shape=(UNFINISHED, len(attempts), rerun_on, False)).rowcount


# The child ends every group of rows with finish or continue_later: their statements are
# built once per shape (status, rows in the group, options) with every value a parameter,
# and a session may keep them compiled (store/session.py). Building and compiling one
# took longer than the database took to run it.
_ENDED: dict[tuple[str, str, int, bool, bool], sa.Update] = {}


def _handler_ended(vendor: Vendor, status: str, rows: int, rerun_on: bool,
                   stale: bool) -> sa.Update:
    key = (vendor.name, status, rows, rerun_on, stale)
    statement = _ENDED.get(key)
    if statement is None:
        values: list[tuple[str, Any]] = [
            ("status", status), ("claim_token", None), ("lease_expires_at", None),
            ("error_type", None), ("error_message", None), ("error_traceback", None),
            ("rerun_reason", None), ("crashes", 0), ("updated_at", now(vendor)),
            ("started_at", per_row(vendor, "dbw_started", rows))]
        if status == FINISHED:
            values.append(("finished_at", per_row(vendor, "dbw_finished", rows)))
            if stale:
                values.append(("next_attempt_at", per_row(vendor, "dbw_stale", rows)))
        else:
            values += [("attempts", 0), ("ready_at", now(vendor))]
        statement = _ENDED[key] = _update(held_rows(rows), _rerun_aware(values, rerun_on))
    return statement


def _ended_params(vendor: Vendor, attempts: Sequence[Ended],
                  stale_after: float | None = None) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for i, a in enumerate(attempts):
        params[f"{ROW_ID}{i}"], params[f"{ROW_TOKEN}{i}"] = a.execution_id, a.token
        params[f"dbw_started{i}"] = vendor.seconds_value(a.started)
        params[f"dbw_finished{i}"] = vendor.seconds_value(a.finished)
        if stale_after is not None:
            params[f"dbw_stale{i}"] = vendor.seconds_value(stale_after + a.finished)
    return params


# -- failures and interruptions -------------------------------------------------------------
Crashes = Literal["reset", "count", "keep"]


def fail_or_retry(session: Session, where: sa.ColumnElement[bool], decision: RetryDecision,
                  error: Mapping[str, str], *, crashes: Crashes, rerun_on: bool = False,
                  started: float | None = None) -> int:
    """The attempt failed: FAILED for good, or UNFINISHED to run again after the
    decision's delay, with the error recorded. The child calls it when a handler raised
    (``crashes="reset"``: the handler itself answered), the coordinator when a handler
    timed out (``"keep"``) or its process died (``"count"``: toward max_crashes), and
    recovery when a lease expired. ``where`` is the guard (``held``, ``expired``)."""
    vendor = session.vendor
    values: list[tuple[str, Any]] = [
        ("status", decision.status.value), ("claim_token", None), ("lease_expires_at", None),
        ("error_type", error["error_type"]), ("error_message", error["error_message"]),
        ("error_traceback", error.get("error_traceback", "")), ("rerun_reason", None),
        ("updated_at", now(vendor))]
    if decision.retried:
        values.append(("next_attempt_at",
                       None if decision.delay is None else now(vendor, decision.delay)))
    else:
        values += [("next_attempt_at", None), ("finished_at", now(vendor))]
    if started is not None:
        values.append(("started_at", now(vendor, started)))
    if crashes != "keep":
        values.append(("crashes", 0 if crashes == "reset" else execution_table().c.crashes + 1))
    return session.run(_update(where, _rerun_aware(values, rerun_on))).rowcount


def release(session: Session, claim: Holding, previous_status: str) -> bool:
    """Undo a claim whose handler never started: the row returns to its previous status
    and attempt count, claimable at once. True if the claim still held it."""
    e = execution_table()
    status = previous_status if previous_status != WORKING else UNFINISHED
    return bool(session.run(_update(held([claim]), [
        ("status", status), ("attempts", e.c.attempts - 1), ("claim_token", None),
        ("lease_expires_at", None), ("claimed_by", None), ("rerun_requested", False),
        ("updated_at", now(session.vendor))])).rowcount)


def expired(worker: str, vendor: Vendor) -> sa.ColumnElement[bool]:
    """WORKING rows of ``worker`` whose lease ran out: their holder is gone."""
    e = execution_table()
    return sa.and_(e.c.worker == worker, e.c.status == WORKING,
                   e.c.lease_expires_at < now(vendor))


def recover(session: Session, worker: str, *, present: sa.ColumnElement[Any],
            decide: Callable[[Any], tuple[RetryDecision, dict[str, str]]],
            rerun_on: bool = False) -> list[tuple[Any, RetryDecision]]:
    """Rows of ``worker`` whose lease expired become claimable again after the retry
    policy's delay, or FAILED, as ``decide(row)`` says (row: id, source_id, attempts,
    started_at, claimed_by and ``present``, whether its source row still exists). Returns
    the rows it changed with their decisions.

    Locked in id order, skipping any row a frozen holder still has locked in an open
    transaction: recovery never waits on a dead process, and two coordinators recovering
    at once never deadlock. A stale holder that wakes up later cannot commit: its token
    no longer matches."""
    e = execution_table()
    where = expired(worker, session.vendor)
    select = locked(session.vendor, sa.select(
        e.c.id, e.c.source_id, e.c.attempts, e.c.started_at, e.c.claimed_by,
        present.label("present")).where(where).order_by(e.c.id))
    changed = []
    for row in session.run(select).rows:
        decision, error = decide(row)
        # (The UPDATE re-checks: where rows are not locked, the holder may have
        # committed since the SELECT.)
        if fail_or_retry(session, sa.and_(where, e.c.id == row.id), decision, error,
                         crashes="keep", rerun_on=rerun_on):
            changed.append((row, decision))
    return changed


def end_leases(session: Session, claimers: Sequence[str]) -> int:
    """The leases of rows these (dead) coordinators hold end now, so recovery hands the
    rows over at once. WORKING rows only (the status index), locked in id order and
    skipping rows another coordinator is ending right now: two coordinators that find
    the same dead one never deadlock."""
    e = execution_table()
    mine = sa.and_(e.c.status == WORKING, e.c.claimed_by.in_(claimers))
    ids = [r.id for r in session.run(locked(session.vendor, sa.select(e.c.id).where(mine)
                                                .order_by(e.c.id))).rows]
    if not ids:
        return 0
    return session.run(_update(sa.and_(mine, e.c.id.in_(ids)),
                               [("lease_expires_at", now(session.vendor, -LONG_AGO_SECONDS))])
                       ).rowcount


LONG_AGO_SECONDS = 86400.0  # an ended lease: a day before now


# -- rows waiting for a due time ---------------------------------------------------------------
def _due(vendor: Vendor, worker: str) -> sa.ColumnElement[bool]:
    e = execution_table()
    return sa.and_(e.c.waiting_worker == worker, e.c.next_attempt_at <= now(vendor))


def due_rows(vendor: Vendor, worker: str, limit: int = 1000) -> sa.Select[Any]:
    """The ids of ``worker``'s rows whose due time has come, earliest first: the waiting
    index's order."""
    e = execution_table()
    return sa.select(e.c.id).where(_due(vendor, worker)).order_by(e.c.next_attempt_at).limit(limit)


def promote(session: Session, worker: str, limit: int = 1000) -> int:
    """Rows whose due time has come become claimable: a retry after its back-off, a
    task after its run_after, a finished row of a rerun_every worker (PENDING again,
    "stale"). In the waiting index's order (earliest due first: never a sort of the due
    rows), skipping rows another coordinator promotes right now. Returns how many."""
    e = execution_table()
    vendor = session.vendor
    due = _due(vendor, worker)
    ids = [r.id for r in session.run(locked(vendor, due_rows(vendor, worker, limit))).rows]
    if not ids:
        return 0
    finished = e.c.status == FINISHED
    # In this order: MySQL evaluates SET left to right (the reason reads the old status,
    # ready_at the old due time).
    return session.run(_update(sa.and_(due, e.c.id.in_(ids)), [
        ("rerun_reason", sa.case((finished, "stale"), else_=e.c.rerun_reason)),
        ("ready_at", e.c.next_attempt_at),
        ("status", sa.case((finished, PENDING), else_=e.c.status)),
        ("next_attempt_at", None),
        ("updated_at", now(vendor))])).rowcount


def postpone(session: Session, execution_id: int, until: Any,
             statuses: Sequence[str]) -> int:
    """The row, while it has one of ``statuses`` (none of them WORKING: a claimed row is
    not moved), waits until ``until``: a debounced task's new run_after (the enqueuing
    process's time, as django.tasks defines run_after and as the insert trigger copies
    it; bound as the database's DateTimeField takes it). Returns 1, or 0 when the row had
    moved on."""
    e = execution_table()
    assert WORKING not in statuses, "a claimed row is never postponed"
    return session.run(_update(sa.and_(e.c.id == execution_id, e.c.status.in_(list(statuses))), [
        ("next_attempt_at", until), ("updated_at", now(session.vendor))])).rowcount


def reschedule_finished(session: Session, worker: str, rerun_every: float | None) -> int:
    """Finished rows of ``worker`` wait to go stale exactly when it has ``rerun_every``
    (seconds after they finished): run by ``migrate`` when a worker gains or loses it."""
    e = execution_table()
    finished = sa.and_(e.c.worker == worker, e.c.status == FINISHED)
    if rerun_every is None:
        return session.run(_update(sa.and_(finished, e.c.waiting_worker == worker),
                                   [("next_attempt_at", None)])).rowcount
    vendor = session.vendor
    due: sa.ColumnElement[Any] = sa.literal_column(vendor.plus_seconds_sql(vendor.qn("finished_at"), rerun_every))
    return session.run(_update(sa.and_(finished, e.c.next_attempt_at.is_(None),
                                       e.c.finished_at.is_not(None)),
                               [("next_attempt_at", due)])).rowcount


# -- fresh starts (the admin, the API, the mixins) ---------------------------------------------
def reset(session: Session, ids: Sequence[int]) -> int:
    """FAILED -> UNFINISHED, claimable again from a clean slate. Other statuses are left
    alone. Returns how many rows changed."""
    return _fresh_start(session, ids, FAILED)


def run_again(session: Session, ids: Sequence[int]) -> int:
    """FINISHED -> UNFINISHED: claimable again when eligible, from a clean slate. Other
    statuses are left alone. Returns how many rows changed."""
    return _fresh_start(session, ids, FINISHED)


def _fresh_start(session: Session, ids: Sequence[int], status: str) -> int:
    e = execution_table()
    vendor = session.vendor
    values: list[tuple[str, Any]] = [
        ("status", UNFINISHED), ("claim_token", None), ("lease_expires_at", None),
        ("next_attempt_at", None), ("attempts", 0), ("crashes", 0), ("error_type", None),
        ("error_message", None), ("error_traceback", None), ("finished_at", None),
        ("claimed_by", None), ("rerun_requested", False), ("rerun_reason", None),
        ("ready_at", now(vendor)), ("updated_at", now(vendor))]
    return sum(session.run(_update(sa.and_(e.c.status == status, e.c.id.in_(chunk)), values))
               .rowcount for chunk in _chunks(ids))


def _chunks(ids: Sequence[int]) -> Iterable[list[int]]:
    ids = list(ids)
    for start in range(0, len(ids), CHUNK):
        yield ids[start:start + CHUNK]
