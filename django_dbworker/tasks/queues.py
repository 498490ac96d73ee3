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
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from ..registry import Worker, registry

BACKEND = "django_dbworker.tasks.DatabaseBackend"
PREFIX = "tasks."
MAX_QUEUE_NAME = 32  # Task.queue_name
MAX_ALIAS = 32  # Task.backend
# OPTIONS keys, each with the Worker field it sets; QUEUE_OPTIONS gives them per queue.
QUEUE_SETTINGS = {"CONCURRENCY": "concurrency", "MAX_ATTEMPTS": "max_attempts",
                  "RETRY_BACKOFF": "retry_backoff", "TIMEOUT": "timeout",
                  "MAX_TASKS_PER_CHILD": "max_tasks_per_child"}
OPTION_KEYS = {*QUEUE_SETTINGS, "QUEUE_OPTIONS"}


def queue_worker_name(alias: str, queue: str) -> str:
    return f"{PREFIX}{alias}.{queue}"


@dataclass(eq=False)
class QueueWorker(Worker):
    """One queue of one task backend; its rows are the Task model's."""

    alias: str = ""
    queue: str = ""
    prioritized = True

    def on_failure(self, alias: str, source_id: str, exc: BaseException, final: bool) -> None:
        from ..models import Task
        from .runner import record_failure

        row = Task.objects.using(alias).filter(pk=source_id).first()
        if row is not None:  # (deleted: the Execution records DoesNotExist)
            record_failure(row, exc, final)

    def before_outcomes(self, alias: str, sources: list[Any]) -> None:
        from .runner import save_results

        save_results(alias, sources)

    def trigger_source(self) -> Any:
        """One trigger set on the Task table serves every queue: the worker name comes
        from each row's backend and queue, its priority and run_after with it."""
        from ..models import Task
        from ..vendors import TriggerSource, for_connection

        def name(row: str) -> str:
            vendor = for_connection(_connection())
            return vendor.concat_sql(f"'{PREFIX}'", f"{row}.{vendor.qn('backend')}", "'.'",
                                     f"{row}.{vendor.qn('queue_name')}")

        return TriggerSource(
            base="tasks", table=Task._meta.db_table, pk_column="id", pk_field=Task._meta.pk,
            worker=name, priority=lambda row: f"{row}.priority",
            due=lambda row: f"{row}.run_after")


def _connection() -> Any:
    from django.db import connections

    from .. import conf

    return connections[conf.value("DATABASE")]


def backends() -> Iterator[tuple[str, dict[str, Any]]]:
    """(alias, params) of every TASKS backend that is ours."""
    for alias, params in (getattr(settings, "TASKS", None) or {}).items():
        if isinstance(params, dict) and params.get("BACKEND") == BACKEND:
            yield alias, params


def queue_options(alias: str, params: dict[str, Any], queue: str) -> dict[str, Any]:
    """Worker fields for ``queue``: the backend's OPTIONS, then its QUEUE_OPTIONS entry."""
    options = params.get("OPTIONS") or {}
    per_queue = (options.get("QUEUE_OPTIONS") or {}).get(queue) or {}
    fields = {}
    for source in (options, per_queue):
        for key, field in QUEUE_SETTINGS.items():
            if key in source:
                fields[field] = source[key]
    return fields


def register_queues() -> None:
    """Register a worker per queue of every DatabaseBackend in TASKS (idempotent)."""
    from ..models import Task
    from ..registry import validate
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
