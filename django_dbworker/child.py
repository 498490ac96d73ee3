"""The child process: runs one worker's handler on the rows the coordinator sends it.

Started with ``spawn`` (a fresh interpreter, Django set up once, reused for many rows).
Every row's handler runs in its own savepoint, and its new status is written in the same
transaction, only while the claim token still matches: a row's writes and its outcome
commit together or not at all.

Quick rows are grouped: one transaction holds the rows of up to ``GROUP_SECONDS`` (at
most ``GROUP_ROWS`` of them), loads their source rows with one query and writes their
outcomes with one statement per status. A group that cannot finish as a whole (a lost
claim, a transaction the database aborted) is rolled back and its rows run again one per
transaction. A slow handler is a group of one.
"""

from __future__ import annotations

import os
import random
import signal
import time
import traceback
from collections import deque
from collections.abc import Sequence
from datetime import timedelta
from importlib import import_module
from multiprocessing.connection import Connection
from typing import Any

from . import failpoints

# Messages from a child to its coordinator.
READY = "ready"  # (READY, pid)
SETUP_FAILED = "setup_failed"  # (SETUP_FAILED, traceback)
RESULTS = "results"  # (RESULTS, [(kind, execution_id, detail), ...], seconds the group took)

# Result kinds, one per row sent.
DONE = "done"  # detail: the new status (finished, unfinished, failed)
LOST = "lost"  # the claim was taken over; nothing was saved
INTERRUPTED = "interrupted"  # the database went away while it ran; release the row
SKIPPED = "skipped"  # never started (stopping, or the database went away first)

GROUP_SECONDS = 0.05
GROUP_ROWS = 16

# The shared slot a child writes before each handler: (execution id, time.monotonic() at
# start); id 0 between handlers. The coordinator reads it to enforce timeouts and to know
# which row was running when a child died. CLOCK_MONOTONIC is system-wide on Linux/macOS.
# SLOT_REVOKE is the coordinator's: set, the child starts none of the rows it holds
# (the coordinator gave them back, see Coordinator._revoke_waiting) and reports them
# SKIPPED.
SLOT_ID, SLOT_STARTED, SLOT_REVOKE = 0, 1, 2
SLOT_SIZE = 3

Row = tuple[int, str, str]  # execution id, source id, claim token
Result = tuple[str, int, Any]


def child_main(conn: Connection, worker_name: str, handler_path: str,
               databases: dict[str, str], alias: str, slot: Any, stop: Any) -> None:
    # Ctrl-C in a terminal signals the whole process group; the coordinator alone
    # decides when children stop (and kills them outright when it must).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        worker = _set_up(worker_name, handler_path, databases)
    except BaseException:
        conn.send((SETUP_FAILED, traceback.format_exc()))
        return
    conn.send((READY, os.getpid()))
    pending: deque[Row] = deque()
    while True:
        try:
            if not pending:
                message = conn.recv()
                if message is None:
                    return
                pending.extend(message)
            while conn.poll():  # rows sent while the last group ran
                message = conn.recv()
                if message is None:
                    return
                pending.extend(message)
        except (EOFError, OSError):
            return  # the coordinator is gone
        started = time.monotonic()
        results = run_group(worker, alias, pending, slot, stop)
        failpoints.reached("child.after_commit")
        conn.send((RESULTS, results, time.monotonic() - started))


def _set_up(worker_name: str, handler_path: str, databases: dict[str, str]) -> Any:
    from django.conf import settings

    from .vendors import prepare_child_settings

    # Use the very databases the coordinator uses (under a test runner they are the test
    # databases, whose names the settings module does not know).
    for db_alias, name in databases.items():
        settings.DATABASES[db_alias]["NAME"] = name
        prepare_child_settings(settings.DATABASES[db_alias])

    import django

    django.setup()
    module_name, _, _ = handler_path.partition(":")
    import_module(module_name)  # registers the worker if no workers.py did
    from .registry import registry

    worker = registry[worker_name]
    if worker.handler_path != handler_path:
        raise RuntimeError(
            f"Worker {worker_name!r} is {worker.handler_path} in the child but "
            f"{handler_path} in the coordinator"
        )
    return worker


class _GroupFailed(Exception):
    """The group's transaction cannot commit as a whole; run its rows one at a time
    (``claims_lost``: because some claim is gone; those rows are not run again)."""

    def __init__(self, claims_lost: bool = False) -> None:
        super().__init__()
        self.claims_lost = claims_lost


class _DatabaseGone(Exception):
    def __init__(self, row: Row | None, exc: BaseException) -> None:
        super().__init__(str(exc))
        self.row, self.exc = row, exc


def run_group(worker: Any, alias: str, pending: deque[Row], slot: Any, stop: Any) -> list[Result]:
    """Run rows from the front of ``pending`` in one transaction; return their results
    (rows it did not get to stay in ``pending``, unless it is stopping or the database
    went away: then they come back SKIPPED)."""
    if stop.value or slot[SLOT_REVOKE]:
        slot[SLOT_REVOKE] = 0
        return _skip_all(pending)
    take = [pending.popleft() for _ in range(min(GROUP_ROWS, len(pending)))]
    done: list[Row] = []
    try:
        results = _run_together(worker, alias, take, done, slot, stop)
    except _DatabaseGone as gone:
        slot[SLOT_ID] = 0
        results = [(SKIPPED, r[0], None) for r in done if r is not gone.row]
        if gone.row is not None:
            results.append((INTERRUPTED, gone.row[0], _describe(gone.exc)))
        untouched = [r for r in take if r not in done and r is not gone.row]
        return results + [(SKIPPED, r[0], None) for r in untouched] + _skip_all(pending)
    except _GroupFailed as failed:
        slot[SLOT_ID] = 0
        # Rolled back: run the rows it had reached (all of them if it failed before the
        # first) one per transaction, where each result stands alone.
        done[:] = done or take
        lost = _lost_claims(alias, done) if failed.claims_lost else frozenset()
        results = []
        for i, row in enumerate(done):
            if row[0] in lost:
                results.append((LOST, row[0], None))
                continue
            result = run(worker, alias, *row, slot=slot)
            results.append(result)
            if result[0] == INTERRUPTED:
                return (results + [(SKIPPED, r[0], None) for r in done[i + 1:]]
                        + _requeue_and_skip(pending, take, done))
    # Rows this group did not reach go back to the front, in order.
    pending.extendleft(reversed([r for r in take if r not in done]))
    return results


def _requeue_and_skip(pending: deque[Row], take: list[Row], done: list[Row]) -> list[Result]:
    pending.extendleft(reversed([r for r in take if r not in done]))
    return _skip_all(pending)


def _skip_all(pending: deque[Row]) -> list[Result]:
    results: list[Result] = [(SKIPPED, r[0], None) for r in pending]
    pending.clear()
    return results


def _run_together(worker: Any, alias: str, take: list[Row], done: list[Row], slot: Any,
                  stop: Any) -> list[Result]:
    from django.db import DatabaseError, connections, transaction

    connection = connections[alias]
    deadline = time.monotonic() + GROUP_SECONDS
    outcomes: list[tuple[Row, Any]] = []
    failures: list[Result] = []
    row: Row | None = None
    try:
        with transaction.atomic(using=alias):
            sources = _load_sources(worker, alias, take)
            for row in take:
                if done and (stop.value or time.monotonic() >= deadline):
                    break
                if not _may_start(slot, row):
                    break  # revoked: the rest come back SKIPPED on the next call
                done.append(row)
                try:
                    with transaction.atomic(using=alias):
                        outcome = _call_handler(worker, sources, row, slot)
                    outcomes.append((row, outcome))
                except Exception as exc:
                    slot[SLOT_ID] = 0
                    if _database_gone(alias, exc):
                        raise _DatabaseGone(row, exc) from exc
                    if connection.needs_rollback:
                        # The database aborted the whole transaction (a MySQL deadlock,
                        # say): no savepoint is left to return to.
                        raise _GroupFailed from exc
                    status = record_failure(worker, alias, row[0], row[2], exc)
                    failures.append((DONE, row[0], status) if status else (LOST, row[0], None))
            row = None
            by_status: dict[str, tuple[Any, list[Row]]] = {}
            for done_row, outcome in outcomes:
                by_status.setdefault(outcome.status.value, (outcome, []))[1].append(done_row)
            for outcome, rows in by_status.values():
                if _write_outcome(alias, rows, outcome) != len(rows):
                    raise _GroupFailed(claims_lost=True)
            failpoints.reached("child.before_commit")
    except (_DatabaseGone, _GroupFailed):
        raise
    except DatabaseError as exc:  # the group's own statements, or its commit
        if _database_gone(alias, exc):
            raise _DatabaseGone(row, exc) from exc
        raise _GroupFailed from exc
    results = [(DONE, r[0], o.status.value) for r, o in outcomes] + failures
    return results


def _may_start(slot: Any, row: Row) -> bool:
    """Announce the row, then look for a revocation: the coordinator sets the flag
    before it reads the announced id, so one of the two always sees the other."""
    slot[SLOT_STARTED] = time.monotonic()
    slot[SLOT_ID] = row[0]
    if slot[SLOT_REVOKE]:
        slot[SLOT_ID] = 0
        return False
    return True


def _load_sources(worker: Any, alias: str, rows: Sequence[Row]) -> dict[int, Any]:
    """The source row of each execution id, with one query (missing ones: deleted)."""
    keys = {r[0]: worker.pk_field.to_python(r[1]) for r in rows}
    found = worker.source._default_manager.using(alias).in_bulk(set(keys.values()))
    return {execution_id: found[key] for execution_id, key in keys.items() if key in found}


def _call_handler(worker: Any, sources: dict[int, Any], row: Row, slot: Any) -> Any:

    source = sources.get(row[0])
    if source is None:
        raise worker.source.DoesNotExist(
            f"{worker.source.__name__} with pk {row[1]!r} does not exist (deleted after "
            "it was claimed)."
        )
    outcome = worker.handler(source)
    slot[SLOT_ID] = 0
    return _checked(worker, outcome)


def _checked(worker: Any, outcome: Any) -> Any:
    from .outcomes import Finished, Unfinished

    if not isinstance(outcome, Finished | Unfinished):
        raise TypeError(
            f"Handler {worker.handler_path} returned {outcome!r}; "
            "return Finished() or Unfinished()."
        )
    return outcome


def _held_guard(rows: Sequence[Row]) -> Any:
    """Rows still held by these claims: each id with its own claim token, still working."""
    from django.db.models import Q

    from .status import ExecutionStatus

    by_token: dict[str, list[int]] = {}
    for execution_id, _, token in rows:
        by_token.setdefault(token, []).append(execution_id)
    guard = Q()
    for token, ids in by_token.items():
        guard |= Q(id__in=ids, claim_token=token)
    return guard & Q(status=ExecutionStatus.WORKING)


def _lost_claims(alias: str, rows: Sequence[Row]) -> frozenset[int]:
    """After the group rolled back: which of its rows no claim of ours holds any more
    (rows that would only run to a lost claim again). Empty if the database cannot say."""
    from django.db import DatabaseError

    from .models import Execution

    try:
        held = set(Execution.objects.using(alias).filter(_held_guard(rows))
                   .values_list("id", flat=True))
    except DatabaseError:
        return frozenset()
    return frozenset(r[0] for r in rows if r[0] not in held)


def _write_outcome(alias: str, rows: list[Row], outcome: Any) -> int:
    """One UPDATE for rows with the same outcome, each guarded by its own claim token."""
    from .models import Execution

    return (Execution.objects.using(alias).filter(_held_guard(rows))
            .update(**outcome_values(outcome)))


def run(worker: Any, alias: str, execution_id: int, source_id: str, token: str,
        slot: Any) -> Result:
    """Run one row in its own transaction (the fallback of a group that failed)."""
    from django.db import transaction

    from .exceptions import LostClaim

    try:
        with transaction.atomic(using=alias):
            pk = worker.pk_field.to_python(source_id)
            source = worker.source._default_manager.using(alias).get(pk=pk)
            slot[SLOT_STARTED] = time.monotonic()
            slot[SLOT_ID] = execution_id
            outcome = _checked(worker, worker.handler(source))
            slot[SLOT_ID] = 0
            if _write_outcome(alias, [(execution_id, source_id, token)], outcome) != 1:
                raise LostClaim(f"Execution {execution_id} was claimed by another process")
        return (DONE, execution_id, outcome.status.value)
    except LostClaim:
        return (LOST, execution_id, None)
    except Exception as exc:
        slot[SLOT_ID] = 0
        if _database_gone(alias, exc):
            return (INTERRUPTED, execution_id, _describe(exc))
        try:
            status = record_failure(worker, alias, execution_id, token, exc)
        except Exception as second:
            _database_gone(alias, second)
            return (INTERRUPTED, execution_id, _describe(second))
        return (DONE, execution_id, status) if status else (LOST, execution_id, None)


def outcome_values(outcome: Any) -> dict[str, Any]:
    from django.utils import timezone

    from .outcomes import Unfinished

    now = timezone.now()
    values: dict[str, Any] = {
        "status": outcome.status.value,
        "claim_token": None,
        "lease_expires_at": None,
        "error_type": None,
        "error_message": None,
        "error_traceback": None,
        "updated_at": now,
    }
    if isinstance(outcome, Unfinished):
        values["attempts"] = 0  # progress: continuations do not use up retries
    else:
        values["finished_at"] = now
    return values


def record_failure(worker: Any, alias: str, execution_id: int, token: str,
                   exc: BaseException) -> str | None:
    """Record the error (the handler's writes are already rolled back). Returns the new
    status, or None when the claim was lost meanwhile."""
    from django.db import transaction
    from django.utils import timezone

    from .models import Execution

    now = timezone.now()
    with transaction.atomic(using=alias):
        held = Execution.objects.using(alias).held_by(execution_id, token)
        attempts = held.values_list("attempts", flat=True).first()
        if attempts is None:
            return None
        values = {"claim_token": None, "lease_expires_at": None, "updated_at": now,
                  **error_values(exc), **next_attempt(worker, attempts, now)}
        return values["status"] if held.update(**values) == 1 else None


def next_attempt(worker: Any, attempts: int, now: Any) -> dict[str, Any]:
    """After a failed attempt: retry later (UNFINISHED, invisible to claims until
    next_attempt_at) while attempts remain, else FAILED."""
    from .status import ExecutionStatus

    if worker.max_attempts is not None and attempts < worker.max_attempts:
        return {"status": ExecutionStatus.UNFINISHED.value,
                "next_attempt_at": now + timedelta(seconds=retry_delay(worker, attempts))}
    return {"status": ExecutionStatus.FAILED.value, "finished_at": now}


def retry_delay(worker: Any, attempts: int) -> float:
    """Exponential back-off with full jitter between 50% and 100% of the step."""
    step = worker.retry_backoff * (2 ** max(attempts - 1, 0))
    return step * random.uniform(0.5, 1.0)


def error_values(exc: BaseException) -> dict[str, str]:
    cls = type(exc)
    name = cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    return {
        "error_type": name[:255],
        "error_message": str(exc),
        "error_traceback": "".join(traceback.format_exception(exc)),
    }


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _database_gone(alias: str, exc: BaseException) -> bool:
    """After a database error, drop connections that no longer work (Django reconnects on
    next use) and say whether the failure was the database's rather than the handler's."""
    from django.db import DatabaseError, InterfaceError, OperationalError, connections

    if not isinstance(exc, DatabaseError):
        return False
    gone = False
    for connection in connections.all(initialized_only=True):
        if connection.connection is not None and not connection.is_usable():
            connection.close()
            gone = gone or connection.alias == alias
    return gone and isinstance(exc, OperationalError | InterfaceError)
