"""What a child does with a Task row: the handler of every task queue.

It runs in the child's transaction like any handler, so the task's own writes on the
coordination database commit together with its SUCCESSFUL status (and roll back with a
failure). The row's result (times, worker, return value) is written with the outcome,
by ``save_results``: together for a group of tasks (one statement on PostgreSQL), not
with an ORM save per task. So a task that calls ``transaction.set_rollback(True)``
discards its own writes and keeps its result, as any handler keeps its outcome.

The signals are sent where a receiver that writes to the database sees its writes
committed: ``task_started`` by the child before it opens the transaction the task runs in
(``announce_started``, called through ``QueueWorker.before_attempts``), so a receiver's
record of it stays whatever becomes of the task; ``task_finished`` after the transaction
that recorded the outcome committed. A receiver's exception is logged and changes nothing.
"""

from __future__ import annotations

import logging
import os
import traceback
from collections import OrderedDict
from collections.abc import Iterable
from functools import partial
from itertools import islice
from typing import Any

from django.db import transaction

from ..outcomes import Finished
from ..processes import child
from ..processes.protocol import Delivery
from ..store import clock
from . import values
from .compat import TaskContext, TaskResultStatus, task_finished, task_started
from .results import import_task, to_result, worker_ids_of

logger = logging.getLogger("django_dbworker.tasks")

# What a success writes; a failure writes its error as well.
RESULT_FIELDS = ["started_at", "last_attempted_at", "worker_ids", "return_value", "finished_at"]
FIELDS = [*RESULT_FIELDS, "errors"]


# The claims (tokens) this child sent task_started for, the newest last: a group's rows it
# did not reach come back at the front of the next group and are not announced again.
_announced: OrderedDict[str, None] = OrderedDict()
ANNOUNCED_KEPT = 1024
# The attempts (execution id, number) at the front of the child's queue that were
# announced: run_task() sends task_started itself for any other.
_window: frozenset[tuple[int, int]] = frozenset()


def _sender(alias: str) -> type:
    """The class of backend ``alias`` (DatabaseBackend or a subclass), as Django's own
    backends send ``type(self)``."""
    from .backend import DatabaseBackend
    from .compat import task_backends

    try:
        cls = type(task_backends[alias])
    except Exception:  # noqa: BLE001 - the alias is gone from TASKS: the base class
        return DatabaseBackend
    return cls if issubclass(cls, DatabaseBackend) else DatabaseBackend


def send_logged(signal: Any, name: str, result: Any) -> None:
    """Send ``signal``: a receiver's exception is logged and changes nothing of the task."""
    for receiver, response in signal.send_robust(_sender(result.backend), task_result=result):
        if isinstance(response, Exception):
            logger.error("A %s receiver (%s) failed for task %s (%s): %s", name,
                         getattr(receiver, "__qualname__", receiver), result.id,
                         result.task.module_path, response, exc_info=response)


def announce_started(alias: str, pending: Iterable[Delivery]) -> None:
    """Send ``task_started`` for the tasks at the front of ``pending`` (the deliveries
    the child runs next: as many as a group takes), before their transaction opens.
    Receivers run in autocommit: a row one writes is committed at once, and stays
    however the task ends. Nothing here stops a task: if the rows cannot be read, they
    are announced by run_task(), inside their transaction, as before."""
    global _window
    from ..coordinator.identity import host
    from ..models import Task

    front = list(islice(pending, child.GROUP_ROWS))
    fresh = [d for d in front if d.token not in _announced]
    pk = Task._meta.pk
    assert pk is not None
    rows, now = {}, None
    if fresh:
        try:
            rows = Task.objects.using(alias).in_bulk([pk.to_python(d.source_id) for d in fresh])
            now = clock.now(alias)
        except Exception:  # noqa: BLE001 - the group meets the database's error itself
            logger.warning("Could not read tasks to announce them; they announce "
                           "themselves when they start", exc_info=True)
            fresh = []
    worker_id = f"{host()}:{os.getppid()}"  # the coordinator, as child.current_attempt() has it
    for delivery in fresh:
        row = rows.get(pk.to_python(delivery.source_id))
        if row is None:
            continue  # deleted since the claim: its run says so
        try:
            _begin_attempt(row, now, child.Attempt(delivery.execution_id, delivery.attempt, worker_id))
            result = to_result(row, None, status=TaskResultStatus.RUNNING)
        except Exception:  # noqa: BLE001 - not announced here: run_task() does it
            logger.warning("Could not announce task %s", row.pk, exc_info=True)
            continue
        _announced[delivery.token] = None
        send_logged(task_started, "task_started", result)
    while len(_announced) > ANNOUNCED_KEPT:
        _announced.popitem(last=False)
    _window = frozenset((d.execution_id, d.attempt) for d in front if d.token in _announced)


def _begin_attempt(row: Any, now: Any, attempt: child.Attempt | None = None) -> None:
    attempt = attempt or child.current_attempt()
    row.started_at = row.started_at or now
    row.last_attempted_at = now
    row.worker_ids = [*worker_ids_of(row, None, attempt.number - 1)[:attempt.number - 1],
                      attempt.worker_id]


def run_task(row: Any) -> Finished:
    """Run the task of ``row`` (a Task): called with the row, like any handler."""
    task = import_task(row.task_path)
    attempt = child.current_attempt()
    _begin_attempt(row, clock.now(row._state.db), attempt)
    result = to_result(row, None, task, status=TaskResultStatus.RUNNING)
    if (attempt.execution_id, attempt.number) not in _window:
        # Not announced before the transaction (run by child.run() alone, or the rows
        # could not be read then): late, and inside the task's transaction, but sent.
        send_logged(task_started, "task_started", result)
    if task.takes_context:
        value = task.call(TaskContext(task_result=result), *result.args, **result.kwargs)
    else:
        value = task.call(*result.args, **result.kwargs)
    row.return_value = values.return_value(task.module_path, value)
    row.finished_at = clock.now(row._state.db)
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


def record_failure(row: Any, exc: BaseException, final: bool) -> None:
    """In the transaction that records a failed attempt (the handler's own writes are
    rolled back, ``row`` is read afresh): keep its error on the row."""
    now = clock.now(row._state.db)
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
    except Exception:  # noqa: BLE001 - (a stand-in failed too): nothing to send
        logger.warning("No task_finished for task %s: its result cannot be built", row.pk,
                       exc_info=True)
        return
    if exc is None:
        send_logged(task_finished, "task_finished", result)
        return
    try:  # Django's own receiver logs the failure with sys.exc_info(), as its backends do
        raise exc
    except BaseException:
        send_logged(task_finished, "task_finished", result)
