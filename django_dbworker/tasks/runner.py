"""What a child does with a Task row: the handler of every task queue.

It runs in the child's transaction like any handler, so the task's own writes on the
coordination database commit together with its SUCCESSFUL status (and roll back with a
failure). The row's result (times, worker, return value) is written with the outcome,
by ``save_results``: together for a group of tasks (one statement on PostgreSQL), not
with an ORM save per task. So a task that calls ``transaction.set_rollback(True)``
discards its own writes and keeps its result, as any handler keeps its outcome.
``task_started`` is sent in the child before the task runs, ``task_finished`` after the
outcome committed.
"""

from __future__ import annotations

import json
import traceback
from functools import partial
from typing import Any

from django.db import transaction
from django.utils import timezone

from .. import child
from ..outcomes import Finished
from .compat import TaskContext, TaskResultStatus, normalize_json, task_finished, task_started
from .results import import_task, to_result, worker_ids_of

# What a success writes; a failure writes its error as well.
RESULT_FIELDS = ["started_at", "last_attempted_at", "worker_ids", "return_value", "finished_at"]
FIELDS = [*RESULT_FIELDS, "errors"]


def _sender() -> type:
    from .backend import DatabaseBackend

    return DatabaseBackend


def _begin_attempt(row: Any, now: Any) -> None:
    attempt = child.current_attempt()
    row.started_at = row.started_at or now
    row.last_attempted_at = now
    row.worker_ids = [*worker_ids_of(row, None, attempt.number - 1)[:attempt.number - 1],
                      attempt.worker_id]


def run_task(row: Any) -> Finished:
    """Run the task of ``row`` (a Task): called with the row, like any handler."""
    task = import_task(row.task_path)
    _begin_attempt(row, timezone.now())
    result = to_result(row, None, task, status=TaskResultStatus.RUNNING)
    task_started.send(_sender(), task_result=result)
    if task.takes_context:
        value = task.call(TaskContext(task_result=result), *result.args, **result.kwargs)
    else:
        value = task.call(*result.args, **result.kwargs)
    row.return_value = json_value(task, value)
    row.finished_at = timezone.now()
    return Finished()


def save_results(alias: str, rows: list[Any]) -> None:
    """Write the result of each of ``rows`` (Tasks whose run returned), in the
    transaction of their outcomes: one statement for a group on PostgreSQL, and no ORM
    save per task anywhere (a task row saved one by one cost two thirds of the task's own
    job in a drain, measured)."""
    from django.db import connections

    from ..models import Task
    from ..vendors import for_connection

    if not rows:
        return
    connection = connections[alias]
    fields = [f for f in Task._meta.concrete_fields if f.name in RESULT_FIELDS]
    pk = Task._meta.pk
    with connection.cursor() as cursor:
        for_connection(connection).update_rows(
            cursor, Task._meta.db_table,
            [(str(f.column), str(f.cast_db_type(connection))) for f in fields],
            (str(pk.column), str(pk.cast_db_type(connection))),
            [[f.get_db_prep_save(getattr(row, f.attname), connection) for f in fields]
             + [pk.get_db_prep_value(row.pk, connection)] for row in rows])
    for row in rows:  # (here, not in run_task: a task's set_rollback() must not drop it)
        transaction.on_commit(partial(_finished, row, None, TaskResultStatus.SUCCESSFUL, None),
                              using=alias)


def json_value(task: Any, value: Any) -> Any:
    """The return value as the JSON it is stored as (a failure if it is not JSON)."""
    try:
        value = normalize_json(value)
        json.dumps(value)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"Task {task.module_path} returned {type(value).__name__}, which is not "
                        f"JSON: return only what json.dumps accepts ({exc}).") from None
    return value


def record_failure(row: Any, exc: BaseException, final: bool) -> None:
    """In the transaction that records a failed attempt (the handler's own writes are
    rolled back, ``row`` is read afresh): keep its error on the row."""
    now = timezone.now()
    _begin_attempt(row, now)
    cls = type(exc)
    row.errors = [*(row.errors or []), {
        "exception_class_path": f"{cls.__module__}.{cls.__qualname__}",
        "traceback": "".join(traceback.format_exception(exc)),
        "attempt": child.current_attempt().number}]
    row.finished_at = now if final else None
    row.save(update_fields=FIELDS)
    if final:
        transaction.on_commit(lambda: _finished(row, None, TaskResultStatus.FAILED, exc),
                              using=row._state.db)


def _finished(row: Any, task: Any, status: TaskResultStatus, exc: BaseException | None) -> None:
    try:
        result = to_result(row, None, task, status=status)
    except Exception:  # noqa: BLE001 - the task is gone from the code: nobody to tell
        return
    if exc is None:
        task_finished.send(_sender(), task_result=result)
        return
    try:  # Django's own receiver logs the failure with sys.exc_info(), as its backends do
        raise exc
    except BaseException:
        task_finished.send(_sender(), task_result=result)
