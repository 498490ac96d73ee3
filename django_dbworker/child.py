"""The child process: runs one worker's handler on the rows the coordinator sends it.

Started with ``spawn`` (a fresh interpreter, Django set up once, reused for many rows).
Each row runs inside ``transaction.atomic()``: the handler's writes and the new status
commit together, and only while the claim token still matches.
"""

from __future__ import annotations

import os
import random
import signal
import traceback
from datetime import timedelta
from importlib import import_module
from multiprocessing.connection import Connection
from typing import Any

# Messages from a child to its coordinator: (kind, execution_id, detail).
READY = "ready"
SETUP_FAILED = "setup_failed"
DONE = "done"  # detail: the new status (finished, unfinished, failed)
LOST = "lost"  # the claim was taken over; nothing was saved
INTERRUPTED = "interrupted"  # the database went away; the row must be released


def child_main(conn: Connection, worker_name: str, handler_path: str,
               databases: dict[str, str], alias: str) -> None:
    # Ctrl-C in a terminal signals the whole process group; the coordinator alone
    # decides when children stop (and kills them outright when it must).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        worker = _set_up(worker_name, handler_path, databases)
    except BaseException:
        conn.send((SETUP_FAILED, None, traceback.format_exc()))
        return
    conn.send((READY, None, os.getpid()))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return  # the coordinator is gone
        if message is None:
            return
        execution_id, source_id, token = message
        conn.send(run(worker, alias, execution_id, source_id, token))


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


def run(worker: Any, alias: str, execution_id: int, source_id: str, token: str) -> tuple[Any, ...]:
    from django.db import transaction

    from .exceptions import LostClaim
    from .models import Execution
    from .outcomes import Finished, Unfinished

    try:
        with transaction.atomic(using=alias):
            pk = worker.pk_field.to_python(source_id)
            source = worker.source._default_manager.using(alias).get(pk=pk)
            outcome = worker.handler(source)
            if not isinstance(outcome, Finished | Unfinished):
                raise TypeError(
                    f"Handler {worker.handler_path} returned {outcome!r}; "
                    "return Finished() or Unfinished()."
                )
            updated = Execution.objects.using(alias).held_by(execution_id, token).update(
                **outcome_values(outcome)
            )
            if updated != 1:
                raise LostClaim(f"Execution {execution_id} was claimed by another process")
        return (DONE, execution_id, outcome.status.value)
    except LostClaim:
        return (LOST, execution_id, None)
    except Exception as exc:
        if _database_gone(alias, exc):
            return (INTERRUPTED, execution_id, f"{type(exc).__name__}: {exc}")
        try:
            status = record_failure(worker, alias, execution_id, token, exc)
        except Exception as second:
            _database_gone(alias, second)
            return (INTERRUPTED, execution_id, f"{type(second).__name__}: {second}")
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
    from .status import ExecutionStatus

    now = timezone.now()
    with transaction.atomic(using=alias):
        held = Execution.objects.using(alias).held_by(execution_id, token)
        attempts = held.values_list("attempts", flat=True).first()
        if attempts is None:
            return None
        values: dict[str, Any] = {
            "claim_token": None,
            "lease_expires_at": None,
            "updated_at": now,
            **error_values(exc),
        }
        if worker.max_attempts is not None and attempts < worker.max_attempts:
            values["status"] = ExecutionStatus.UNFINISHED.value
            values["next_attempt_at"] = now + timedelta(seconds=retry_delay(worker, attempts))
        else:
            values["status"] = ExecutionStatus.FAILED.value
            values["finished_at"] = now
        return values["status"] if held.update(**values) == 1 else None


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
