"""Attempts of a task that the coordinator ended: past its ``TIMEOUT``, its child dead, its
lease expired. The child never reached a commit, so the coordinator keeps their record on
the Task row itself (one error per attempt, its times and its worker, as for an attempt
that raised), in the transaction that releases the row, and sends ``task_finished`` once
that transaction committed when no retry follows.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import sqlalchemy as sa

from .results import COORDINATOR_ERRORS

logger = logging.getLogger("django_dbworker.tasks")


def record_interruption(conn: Any, table: sa.Table, source_id: str, attempt: int,
                        error: tuple[str, str], final: bool, began: Any, claimer: str | None,
                        now: Any) -> None:
    """Append the attempt's error (and worker) to the Task row ``source_id`` and set its
    times. ``conn``: the release's SQLAlchemy connection; ``began``: when the attempt was
    claimed; ``claimer``: the coordinator that held it; ``now``: the database's clock."""
    from django.db import connections

    from .. import conf
    from ..models import Task

    pk = Task._meta.pk
    assert pk is not None
    key = pk.get_db_prep_value(pk.to_python(source_id), connections[conf.value("DATABASE")])
    row = conn.execute(sa.select(table.c.errors, table.c.worker_ids)
                       .where(table.c.id == key)).first()
    if row is None:
        return  # the task row was deleted meanwhile: nothing to keep a record on
    errors = _list(row.errors)
    errors.append({"exception_class_path": COORDINATOR_ERRORS.get(error[0], error[0]),
                   "traceback": error[1], "attempt": attempt})
    ids = _list(row.worker_ids)[:max(attempt - 1, 0)]
    ids += ["unknown"] * (attempt - 1 - len(ids))
    ids.append(claimer or "unknown")
    began = now if began is None else began
    values: dict[str, Any] = {
        "errors": json.dumps(errors), "worker_ids": json.dumps(ids),
        "last_attempted_at": began,
        "started_at": sa.func.coalesce(table.c.started_at, began),
    }
    if final:
        values["finished_at"] = now
    conn.execute(sa.update(table).where(table.c.id == key).values(**values))


def announce_failed(source_id: str) -> None:
    """``task_finished`` for a task that ended FAILED in the coordinator (after the
    release committed): receivers see its final result, as for any other end."""
    from .. import conf
    from ..models import Task
    from .compat import task_finished
    from .results import to_result
    from .runner import send_logged

    try:
        row = Task.objects.using(conf.value("DATABASE")).get(pk=source_id)
        result = to_result(row, None, status=_failed())
    except Exception:  # noqa: BLE001 - the row or its task is gone: nobody to tell
        logger.debug("No task_finished for task %s: it cannot be read back", source_id,
                     exc_info=True)
        return
    send_logged(task_finished, "task_finished", result)


def _failed() -> Any:
    from .compat import TaskResultStatus

    return TaskResultStatus.FAILED


def _list(value: Any) -> list[Any]:
    """A JSON list column as read by SQLAlchemy (text on some databases); anything else
    stored there (null, a damaged value) counts as empty rather than stopping the release."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return []
    return list(value) if isinstance(value, list) else []
