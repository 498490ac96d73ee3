"""A Task row and its Execution, read as a ``django.tasks`` TaskResult.

The Execution holds the state every worker shares (status, attempts, lease, claimer, the
last error); the Task row holds what only tasks have (arguments, return value, the errors
of attempts that ran to a recorded end, the workers that ran them).
"""

from __future__ import annotations

import sys
from importlib import import_module
from typing import Any

from ..status import ExecutionStatus
from .compat import Task as DjangoTask
from .compat import TaskError, TaskResult, TaskResultStatus

STATUSES = {
    ExecutionStatus.PENDING: TaskResultStatus.READY,
    ExecutionStatus.UNFINISHED: TaskResultStatus.READY,  # waiting for a retry
    ExecutionStatus.WORKING: TaskResultStatus.RUNNING,
    ExecutionStatus.FINISHED: TaskResultStatus.SUCCESSFUL,
    ExecutionStatus.FAILED: TaskResultStatus.FAILED,
}
# Failures the coordinator records on the Execution alone (the child was gone): a task's
# result lists them among its errors all the same.
COORDINATOR_ERRORS = {"TimeoutError": "builtins.TimeoutError",
                      "ChildDied": "django_dbworker.exceptions.ChildDied",
                      "LeaseExpired": "django_dbworker.exceptions.LeaseExpired",
                      "Interrupted": "django_dbworker.exceptions.Interrupted"}


def import_task(path: str) -> DjangoTask:
    """The task a stored ``task_path`` names. The path is data (anyone who can write the
    table writes it), so it imports only code the project runs anyway: a module already
    imported, or one inside the package of an installed app or of the settings module.
    Any other path is refused before any of its code runs, and what is found must be a
    task."""
    module_name, _, name = path.rpartition(".")
    module = sys.modules.get(module_name) if module_name and name else None
    if module is None:
        if not (module_name and name and _in_the_project(module_name)):
            raise ImportError(
                f"Task path {path!r} is not in an installed app (nor in the settings "
                "module's package), so it is not imported: a task is an @task function "
                "of an installed app's module.")
        module = import_module(module_name)
    task = getattr(module, name, None)
    if task is None:
        raise ImportError(f"Module {module_name!r} has no task {name!r} (renamed or removed "
                          "since the task was enqueued?).")
    if not isinstance(task, DjangoTask):
        raise TypeError(f"{path} is not a task (decorate the function with @task).")
    return task


def _in_the_project(module_name: str) -> bool:
    from django.apps import apps
    from django.conf import settings

    packages = {config.name for config in apps.get_app_configs()}
    settings_module = getattr(settings, "SETTINGS_MODULE", None) or ""
    if "." in settings_module:  # (its top package: the project's own code)
        packages.add(settings_module.partition(".")[0])
    return any(module_name == p or module_name.startswith(f"{p}.") for p in packages)


def missing_task(row: Any) -> DjangoTask:
    """A stand-in for the task of ``row`` when its path does not import here (renamed or
    removed since it was enqueued, or refused): the result still reads as stored, under
    the stored path. Calling it raises ImportError."""
    module_name, _, name = row.task_path.rpartition(".")

    def missing(*args: Any, **kwargs: Any) -> None:
        raise ImportError(f"Task {row.task_path} cannot be imported in this process.")

    missing.__module__ = module_name
    missing.__name__ = missing.__qualname__ = name
    return DjangoTask(func=missing, backend=row.backend, queue_name=row.queue_name,
                      priority=row.priority, run_after=row.run_after)


def errors_of(row: Any, execution: Any) -> list[dict[str, Any]]:
    """The recorded errors, plus the Execution's own last error when the coordinator
    recorded it (a timeout, a dead child, an expired lease) for an attempt the row does
    not mention."""
    errors = list(row.errors or [])
    if execution is not None and execution.error_type in COORDINATOR_ERRORS and (
            execution.attempts not in {e.get("attempt") for e in errors}):
        errors.append({"exception_class_path": COORDINATOR_ERRORS[execution.error_type],
                       "traceback": execution.error_message or "", "attempt": execution.attempts})
    return errors


def worker_ids_of(row: Any, execution: Any, attempts: int | None = None) -> list[str]:
    """One worker id per attempt: those the row recorded, then the Execution's claimer
    for attempts that ended without a record of their own."""
    ids = list(row.worker_ids or [])
    attempts = (execution.attempts if execution is not None else len(ids)) if attempts is None else attempts
    claimer = (execution.claimed_by if execution is not None else None) or "unknown"
    return ids + [claimer] * max(attempts - len(ids), 0)


def to_result(row: Any, execution: Any, task: DjangoTask | None = None,
              status: TaskResultStatus | None = None) -> TaskResult:
    if task is None:
        try:
            task = import_task(row.task_path)
        except Exception:  # noqa: BLE001 - renamed, removed, refused or broken: as stored
            task = missing_task(row)
    task = task.using(priority=row.priority, queue_name=row.queue_name,
                      run_after=row.run_after, backend=row.backend)
    if status is None:
        status = (TaskResultStatus.READY if execution is None
                  else STATUSES.get(ExecutionStatus(execution.status), TaskResultStatus.READY))
    finished = row.finished_at if status in (TaskResultStatus.SUCCESSFUL,
                                             TaskResultStatus.FAILED) else None
    result: TaskResult = TaskResult(
        task=task, id=str(row.pk), status=status, enqueued_at=row.enqueued_at,
        started_at=row.started_at, finished_at=finished,
        last_attempted_at=row.last_attempted_at, args=list(row.args or []),
        kwargs=dict(row.kwargs or {}), backend=row.backend,
        errors=[TaskError(exception_class_path=e["exception_class_path"],
                          traceback=e.get("traceback", "")) for e in errors_of(row, execution)],
        worker_ids=worker_ids_of(row, execution),
    )
    if status == TaskResultStatus.SUCCESSFUL:
        object.__setattr__(result, "_return_value", row.return_value)
    return result
