"""Task queues as workers: each (backend alias, queue) of a ``DatabaseBackend`` is one
worker on the Task model, next to the row workers, with the same claims, leases, children,
retries and timeouts. Its name is ``tasks.<alias>.<queue>``.

The queues are registered from ``settings.TASKS`` when the app is ready (in the
coordinator and in every child alike), so ``runworkers`` runs them without any
registration of yours.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from ..registration.registry import Worker, registry
from .names import (  # BACKEND and queue_worker_name: re-exported, for their old callers
    BACKEND,
    NOT_OURS,
    OUR_PATHS,
    PREFIX,
    queue_options,
    queue_worker_name,
)

__all__ = ["BACKEND", "QueueWorker", "backends", "is_database_backend", "queue_worker_name",
           "queue_workers", "register_queues"]


@dataclass(eq=False)
class QueueWorker(Worker):
    """One queue of one task backend; its rows are the Task model's."""

    alias: str = ""
    queue: str = ""
    prioritized = True
    records_interruptions = True

    def on_interrupted(self, conn: Any, source_table: Any, source_id: str, attempt: int,
                       error: tuple[str, str], final: bool, began: Any, claimer: str | None,
                       now: Any) -> None:
        from .interruptions import record_interruption

        record_interruption(conn, source_table, source_id, attempt, error, final, began,
                            claimer, now)

    def after_interrupted(self, source_id: str, final: bool) -> None:
        if final:
            from .interruptions import announce_failed

            announce_failed(source_id)

    def on_failure(self, alias: str, source_id: str, exc: BaseException, final: bool) -> None:
        from ..models import Task
        from .runner import record_failure

        row = Task.objects.using(alias).filter(pk=source_id).first()
        if row is not None:  # (deleted: the Execution records DoesNotExist)
            record_failure(row, exc, final)

    def before_outcomes(self, alias: str, sources: list[Any]) -> None:
        from .runner import save_results

        save_results(alias, sources)

    def before_attempts(self, alias: str, pending: Any) -> None:
        """Called in the child before it opens the transaction of the next rows it runs
        (the front of ``pending``, its deque of deliveries): sends their task_started."""
        from .runner import announce_started

        announce_started(alias, pending)

    def trigger_source(self) -> Any:
        """One trigger set on the Task table serves every queue: the worker name comes
        from each row's backend and queue, its priority and run_after with it."""
        from ..models import Task
        from ..vendors import TriggerSource, for_connection

        def column(row: str, name: str) -> str:  # (the Task model's own column names)
            return f"{row}.{for_connection(_connection()).qn(name)}"

        def name(row: str, constant: Any) -> str:
            return for_connection(_connection()).concat_sql(
                constant(PREFIX), column(row, "backend"), constant("."),
                column(row, "queue_name"))

        return TriggerSource(
            base="tasks", table=Task._meta.db_table, pk_column="id", pk_field=Task._meta.pk,
            worker=name, priority=lambda row: column(row, "priority"),
            due=lambda row: column(row, "run_after"), key_column="flow_key")


def _connection() -> Any:
    from django.db import connections

    from .. import conf

    return connections[conf.value("DATABASE")]


def backends() -> Iterator[tuple[str, dict[str, Any]]]:
    """(alias, params) of every TASKS backend that is ours."""
    for alias, params in (getattr(settings, "TASKS", None) or {}).items():
        if isinstance(params, dict) and is_database_backend(params.get("BACKEND")):
            yield alias, params


def is_database_backend(path: Any) -> bool:
    """Whether a TASKS ``BACKEND`` path names DatabaseBackend or a subclass of it. Ours
    and Django's own paths are told apart without importing anything (this runs when
    the app is ready, in the coordinator and in every child); any other path is imported,
    once, and its class compared."""
    if not isinstance(path, str):
        return False
    if path in OUR_PATHS:
        return True
    if path.startswith(NOT_OURS):
        return False
    return _subclasses_ours(path)


@cache
def _subclasses_ours(path: str) -> bool:
    from django.utils.module_loading import import_string

    try:
        cls = import_string(path)
        # (Only now: it needs django.tasks or the backport, and a backend of any kind
        # that imported has one of them.)
        from .backend import DatabaseBackend
    except ImportError:
        return False  # Django's own check of TASKS names a path that does not import
    return isinstance(cls, type) and issubclass(cls, DatabaseBackend)


def register_queues() -> None:
    """Register a worker per queue of every DatabaseBackend in TASKS (idempotent)."""
    from ..models import Task
    from ..registration.registry import validate
    from .runner import run_task

    for alias, params in backends():
        for queue in params.get("QUEUES") or ["default"]:
            name = queue_worker_name(alias, queue)
            fields = queue_options(alias, params, queue)
            concurrency = fields.pop("concurrency", 1)
            try:
                validate(name="q", source=Task, handler=run_task, eligible=None,
                         concurrency=concurrency, options=fields)
            except ImproperlyConfigured as exc:
                raise ImproperlyConfigured(
                    f"TASKS[{alias!r}] queue {queue!r}: {str(exc).split(': ', 1)[-1]}") from None
            registry.register(QueueWorker(name=name, source=Task, handler=run_task,
                                          concurrency=concurrency, alias=alias, queue=queue,
                                          **fields))


def queue_workers(queues: list[str] | None = None) -> list[QueueWorker]:
    """The registered queue workers, or those serving the named queues."""
    found = [w for w in registry.values() if isinstance(w, QueueWorker)]
    return found if queues is None else [w for w in found if w.queue in queues]
