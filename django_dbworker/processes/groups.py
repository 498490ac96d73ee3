"""How a child runs the rows it is sent.

A row's new status is written in the transaction its handler ran in, only while the claim
token still matches: a row's writes and its outcome commit together or not at all.

Quick rows are grouped: one transaction holds the rows of up to ``GROUP_SECONDS`` (at
most ``GROUP_ROWS`` of them), each handler in its own savepoint, loads their source rows
with one query and writes their outcomes with one statement per status. A group that
cannot finish as a whole (a lost claim, a transaction the database aborted) is rolled back
and its rows run again one per transaction. A row that arrives alone runs in a transaction
of its own (run()): a failure rolls it back and is recorded in the next. Where the driver
can tell that a handler left its transaction open, a group's savepoints are kept rather
than released and a row alone has none (savepoints.py).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from ..operations import tracing
from . import failpoints, savepoints, sources
from .attempts import enter as _enter
from .protocol import (
    INTERRUPTED,
    SLOT_REVOKE,
    SLOT_SEQ,
    SLOT_STARTED,
    Delivery,
    Result,
    Timing,
)

logger = logging.getLogger("django_dbworker.child")
GROUP_SECONDS = 0.05
GROUP_ROWS = 16


class _GroupFailed(Exception):
    """The group's transaction cannot commit as a whole; run its rows one at a time
    (``claims_lost``: because some claim is gone; those rows are not run again)."""

    def __init__(self, claims_lost: bool = False) -> None:
        super().__init__()
        self.claims_lost = claims_lost


class _DatabaseGone(Exception):
    def __init__(self, row: Delivery | None, exc: BaseException) -> None:
        super().__init__(str(exc))
        self.row, self.exc = row, exc


def run_group(worker: Any, alias: str, pending: deque[Delivery], slot: Any,
              stop: Any, timings: dict[int, Timing] | None = None) -> list[Result]:
    """Run rows from the front of ``pending`` in one transaction; return their results
    (rows it did not get to stay in ``pending``, unless it is stopping or the database
    went away: then they come back SKIPPED). ``timings`` gets, for each row that ran,
    (seconds its handler took, when it started as time.time())."""
    timings = {} if timings is None else timings
    if stop.value or slot[SLOT_REVOKE]:
        slot[SLOT_REVOKE] = 0
        return _skip_all(pending)
    worker.before_attempts(alias, pending)  # (task queues: task_started, in autocommit)
    if len(pending) == 1:
        return _run_alone(worker, alias, pending, slot, timings)
    take = [pending.popleft() for _ in range(min(GROUP_ROWS, len(pending)))]
    done: list[Delivery] = []
    try:
        results = _run_together(worker, alias, take, done, slot, stop, timings)
    except _DatabaseGone as gone:
        slot[SLOT_SEQ] = 0
        # Every waiting row goes back below: a revocation asked for meanwhile is answered
        # too. Left set, it would keep the pool from ever sending this child a row again.
        slot[SLOT_REVOKE] = 0
        results = [Result.skipped(r.seq) for r in done if r is not gone.row]
        if gone.row is not None:
            results.append(Result.interrupted(gone.row.seq, _describe(gone.exc)))
        untouched = [r for r in take if r not in done and r is not gone.row]
        return results + [Result.skipped(r.seq) for r in untouched] + _skip_all(pending)
    except _GroupFailed as failed:
        slot[SLOT_SEQ] = 0
        # Rolled back: run the rows it had reached (all of them if it failed before the
        # first) one per transaction, where each result stands alone.
        done[:] = done or take
        lost = _lost_claims(alias, done) if failed.claims_lost else frozenset()
        results = []
        for i, row in enumerate(done):
            if row.seq in lost:
                results.append(Result.lost(row.seq))
                continue
            result = run(worker, alias, row, slot=slot, timings=timings)
            results.append(result)
            if result.kind == INTERRUPTED:
                slot[SLOT_REVOKE] = 0  # (as above: everything waiting goes back)
                return (results + [Result.skipped(r.seq) for r in done[i + 1:]]
                        + _requeue_and_skip(pending, take, done))
    # Rows this group did not reach go back to the front, in order.
    pending.extendleft(reversed([r for r in take if r not in done]))
    return results


def _run_alone(worker: Any, alias: str, pending: deque[Delivery], slot: Any,
               timings: dict[int, Timing]) -> list[Result]:
    """A group of one row (a row that arrived alone: the common case of an idle queue)
    runs as run() runs it: no savepoint, so two round trips fewer before its handler
    starts; a failure rolls its transaction back and is recorded in the next."""
    row = pending[0]
    failpoints.reached("child.before_begin")  # row received, not started, no transaction
    if not _may_start(slot, row):
        return []  # revoked: the next call hands it back
    pending.popleft()
    result = run(worker, alias, row, slot, timings)
    if result.kind == INTERRUPTED:
        # (as for a group: a revocation asked for meanwhile counts as answered)
        slot[SLOT_REVOKE] = 0
    return [result]


def _requeue_and_skip(pending: deque[Delivery], take: list[Delivery],
                      done: list[Delivery]) -> list[Result]:
    pending.extendleft(reversed([r for r in take if r not in done]))
    return _skip_all(pending)


def _skip_all(pending: deque[Delivery]) -> list[Result]:
    results: list[Result] = [Result.skipped(r.seq) for r in pending]
    pending.clear()
    return results


def _run_together(worker: Any, alias: str, take: list[Delivery], done: list[Delivery],
                  slot: Any, stop: Any, timings: dict[int, Timing]) -> list[Result]:
    from django.db import DatabaseError, connections, transaction
    from django.utils import timezone

    connection = connections[alias]
    deadline = time.monotonic() + GROUP_SECONDS
    outcomes: list[tuple[Delivery, Any, datetime, datetime]] = []
    failures: list[Result] = []
    row: Delivery | None = None
    ran_on = None
    failpoints.reached("child.before_begin")  # rows received, no transaction open yet
    try:
        with transaction.atomic(using=alias):
            ran_on = connection.connection
            loaded = sources.load_many(worker.source, worker.pk_field, alias, take)
            for row in take:
                if done and (stop.value or time.monotonic() >= deadline):
                    break
                if not _may_start(slot, row):
                    break  # revoked: the rest come back SKIPPED on the next call
                done.append(row)
                started = timezone.now()
                try:
                    with savepoints.handler_block(alias, grouped=True):
                        outcome = _call_handler(worker, loaded, row, slot)
                    finished = timezone.now()
                    outcomes.append((row, outcome, started, finished))
                    _timed(timings, row, started, finished)
                    _after_commit(alias, worker, row, outcome.status.value, None, None)
                except Exception as exc:
                    slot[SLOT_SEQ] = 0
                    if _database_gone(alias, exc):
                        raise _DatabaseGone(row, exc) from exc
                    if connection.needs_rollback:
                        # The database aborted the whole transaction (a MySQL deadlock,
                        # say): no savepoint is left to return to.
                        raise _GroupFailed from exc
                    _timed(timings, row, started, timezone.now())
                    status = record_failure(worker, alias, row, exc, started)
                    failures.append(Result.done(row.seq, status) if status else Result.lost(row.seq))
            row = None
            if outcomes:
                try:
                    worker.before_outcomes(alias, [loaded[r.seq] for r, _, _, _ in outcomes])
                except DatabaseError:
                    raise
                except Exception as exc:  # (a bug of the hook's: the rows run alone)
                    raise _GroupFailed from exc
            by_status: dict[str, list[tuple[Delivery, Any, datetime, datetime]]] = {}
            for item in outcomes:
                by_status.setdefault(item[1].status.value, []).append(item)
            for items in by_status.values():
                if _write_outcomes(worker, alias, items) != len(items):
                    raise _GroupFailed(claims_lost=True)
            failpoints.reached("child.before_commit")
    except (_DatabaseGone, _GroupFailed):
        raise
    except DatabaseError as exc:  # the group's own statements, or its commit
        if _database_gone(alias, exc, ran_on):
            raise _DatabaseGone(row, exc) from exc
        raise _GroupFailed from exc
    return [Result.done(r.seq, o.status.value) for r, o, _, _ in outcomes] + failures


def _may_start(slot: Any, row: Delivery) -> bool:
    """Announce the row, then look for a revocation: the coordinator sets the flag
    before it reads the announced delivery, so one of the two always sees the other."""
    slot[SLOT_STARTED] = time.monotonic()
    slot[SLOT_SEQ] = row.seq
    if slot[SLOT_REVOKE]:
        slot[SLOT_SEQ] = 0
        return False
    return True


def _call_handler(worker: Any, loaded: dict[int, Any], row: Delivery, slot: Any) -> Any:
    source = loaded.get(row.seq)
    if source is None:
        raise worker.source.DoesNotExist(
            f"{worker.source.__name__} with pk {row.source_id!r} does not exist (deleted after "
            "it was claimed)."
        )
    _enter(row)
    with tracing.span(worker.name, row.source_id, row.attempt) as current:
        try:
            outcome = _checked(worker, worker.handler(source))
        except BaseException:
            _set_outcome(current, "failed")
            raise
        _set_outcome(current, outcome.status.value)
    slot[SLOT_SEQ] = 0
    return outcome


def _checked(worker: Any, outcome: Any) -> Any:
    from ..outcomes import Finished, Unfinished

    if not isinstance(outcome, Finished | Unfinished):
        raise TypeError(
            f"Handler {worker.handler_path} returned {outcome!r}; "
            "return Finished() or Unfinished()."
        )
    return outcome


def _lost_claims(alias: str, rows: Sequence[Delivery]) -> frozenset[int]:
    """After the group rolled back: which of its deliveries no claim of ours holds any
    more (rows that would only run to a lost claim again). Empty if the database cannot
    say."""
    from django.db import DatabaseError

    from ..models import Execution

    try:
        held = set(Execution.objects.using(alias).held_by_any(rows)
                   .values_list("id", flat=True))
    except DatabaseError:
        return frozenset()
    return frozenset(r.seq for r in rows if r.execution_id not in held)


def _write_outcomes(worker: Any, alias: str,
                    items: Sequence[tuple[Delivery, Any, datetime, datetime]]) -> int:
    """One UPDATE for rows with the same outcome, each guarded by its own claim token and
    given its own start and finish times: this process measured how long ago they were,
    the database's clock says when that was."""
    from django.utils import timezone

    from ..outcomes import Unfinished
    from ..store import transitions
    from ..store.session import OnDjango
    from ..store.transitions import Ended

    at = timezone.now()
    ended = [Ended(row.execution_id, row.token, _since(started, at), _since(finished, at))
             for row, _, started, finished in items]
    session = OnDjango(alias)
    if isinstance(items[0][1], Unfinished):
        return transitions.continue_later(session, ended, rerun_on=bool(worker.rerun_on))
    every = worker.rerun_every.total_seconds() if worker.rerun_every is not None else None
    return transitions.finish(session, ended, rerun_on=bool(worker.rerun_on), rerun_every=every)


def _since(then: datetime, at: datetime) -> float:
    """``then`` as seconds from ``at`` (negative: it is past)."""
    return (then - at).total_seconds()


def run(worker: Any, alias: str, row: Delivery, slot: Any,
        timings: dict[int, Timing] | None = None) -> Result:
    """Run one row in its own transaction (a row that arrived alone, or one of a group
    that failed), with no savepoint where the driver can tell that the handler left the
    transaction open (savepoints.py): a failure rolls it all back, and record_failure()
    writes it in the next."""
    from django.db import connections, transaction
    from django.utils import timezone

    from ..exceptions import LostClaim

    seq = row.seq
    started = timezone.now()
    ran_on = None
    try:
        with transaction.atomic(using=alias):
            ran_on = connections[alias].connection
            source = sources.load(worker.source, alias, worker.pk_field.to_python(row.source_id))
            slot[SLOT_STARTED] = time.monotonic()
            slot[SLOT_SEQ] = seq
            started = timezone.now()
            _enter(row)
            with tracing.span(worker.name, row.source_id, row.attempt) as current:
                with savepoints.handler_block(alias, grouped=False):
                    outcome = _checked(worker, worker.handler(source))
                _set_outcome(current, outcome.status.value)
            slot[SLOT_SEQ] = 0
            finished = timezone.now()
            _timed(timings, row, started, finished)
            if not connections[alias].needs_rollback:
                return _commit_outcome(worker, alias, row, source, outcome, started, finished)
        # The handler called transaction.set_rollback(True): its writes are rolled back
        # and its outcome stands, in a transaction of its own (in a group, its savepoint
        # gives the same).
        with transaction.atomic(using=alias):
            return _commit_outcome(worker, alias, row, source, outcome, started, finished)
    except LostClaim:
        return Result.lost(seq)
    except Exception as exc:
        slot[SLOT_SEQ] = 0
        _timed(timings, row, started, timezone.now())
        if _database_gone(alias, exc, ran_on):
            return Result.interrupted(seq, _describe(exc))
        try:
            status = record_failure(worker, alias, row, exc, started)
        except Exception as second:
            _database_gone(alias, second)
            return Result.interrupted(seq, _describe(second))
        return Result.done(seq, status) if status else Result.lost(seq)


def _commit_outcome(worker: Any, alias: str, row: Delivery, source: Any, outcome: Any,
                    started: datetime, finished: datetime) -> Result:
    """In the row's transaction, about to commit: its outcome, if its claim still holds."""
    from ..exceptions import LostClaim

    worker.before_outcomes(alias, [source])
    if _write_outcomes(worker, alias, [(row, outcome, started, finished)]) != 1:
        raise LostClaim(f"Execution {row.execution_id} was claimed by another process")
    _after_commit(alias, worker, row, outcome.status.value, None, None)
    failpoints.reached("child.before_commit")
    return Result.done(row.seq, outcome.status.value)


def record_failure(worker: Any, alias: str, row: Delivery, exc: BaseException,
                   started: datetime) -> str | None:
    """Record the error (the handler's writes are already rolled back) and what the retry
    policy makes of it (transitions.fail_or_retry). Returns the new status, or None when
    the claim was lost."""
    from django.db import transaction
    from django.utils import timezone

    from ..models import Execution
    from ..status import ExecutionStatus
    from ..store import transitions
    from ..store.errors import failure_fields
    from ..store.session import OnDjango

    with transaction.atomic(using=alias):
        attempts = (Execution.objects.using(alias).held_by(row.execution_id, row.token)
                    .values_list("attempts", flat=True).first())
        if attempts is None:
            return None
        decision = worker.retry_policy.after_failure(attempts)
        _enter(row)
        worker.on_failure(alias, row.source_id, exc, final=not decision.retried)
        if transitions.fail_or_retry(OnDjango(alias), transitions.held([row]), decision,
                                     failure_fields(exc), crashes="reset",
                                     rerun_on=bool(worker.rerun_on),
                                     started=_since(started, timezone.now())) != 1:
            return None
        outcome = "retried" if decision.retried else ExecutionStatus.FAILED.value
        _after_commit(alias, worker, row, outcome, exc, decision.delay)
        return outcome


def _timed(timings: dict[int, Timing] | None, row: Delivery, started: datetime,
           finished: datetime) -> None:
    if timings is not None:
        timings[row.seq] = Timing((finished - started).total_seconds(), started.timestamp())


def _set_outcome(current: Any, outcome: str) -> None:
    if current is not None:
        current.set_attribute("dbworker.outcome", outcome)


def _after_commit(alias: str, worker: Any, row: Delivery, outcome: str,
                  exc: BaseException | None, retry_in: float | None) -> None:
    """Once the outcome committed (never for a rolled-back group): the log lines and
    signals of this row, in the child."""
    from django.db import transaction

    transaction.on_commit(lambda: _announce(worker, row, outcome, exc, retry_in), using=alias)


def _announce(worker: Any, row: Delivery, outcome: str, exc: BaseException | None,
              retry_in: float | None) -> None:
    from .. import signals

    details = {"worker": worker.name, "execution_id": row.execution_id, "source_id": row.source_id,
               "attempt": row.attempt}
    if exc is not None:
        total = worker.max_attempts or 1
        retried = outcome == "retried"
        then = f"retry in {retry_in or 0:.1f}s" if retried else "no retry left: failed"
        # ERROR when no retry is left (what logging integrations such as Sentry's report
        # as an event by default); WARNING when it will be retried.
        logger.log(logging.WARNING if retried else logging.ERROR,
                   "Worker %s: execution %s (source %s) failed on attempt %d of %d: %s; %s",
                   worker.name, row.execution_id, row.source_id, row.attempt, total, _describe(exc), then,
                   exc_info=exc)
        if retried:
            logger.info("Worker %s: execution %s will be retried in %.1fs (attempt %d of %d)",
                        worker.name, row.execution_id, retry_in or 0, row.attempt + 1, total)
    signal = {"retried": signals.execution_retried,
              "failed": signals.execution_failed}.get(outcome, signals.execution_finished)
    signal.send_robust(sender=worker, **details)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _database_gone(alias: str, exc: BaseException, ran_on: Any = None) -> bool:
    """After a database error, drop connections that no longer work (Django reconnects on
    next use) and say whether the failure was the database's rather than the handler's
    (``ran_on``: the DB-API connection the failed transaction ran on)."""
    from django.db import DatabaseError, InterfaceError, OperationalError, connections

    if not isinstance(exc, DatabaseError):
        return False
    gone = False
    for connection in connections.all(initialized_only=True):
        if connection.connection is not None and not connection.is_usable():
            connection.close()
            gone = gone or connection.alias == alias
    # Past the end of an atomic block that met a dead connection, Django has dropped it
    # (its rollback failed) and may have connected again already: the database's failure
    # all the same.
    gone = gone or (ran_on is not None and connections[alias].connection is not ran_on)
    return gone and isinstance(exc, OperationalError | InterfaceError)
