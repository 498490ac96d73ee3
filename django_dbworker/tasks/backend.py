"""``django_dbworker.tasks.DatabaseBackend``: ``django.tasks`` on this app's claims.

An enqueued task is a row of ``django_dbworker.Task`` on the coordination database
(``DBWORKER["DATABASE"]``). The pending-row trigger gives it an Execution like any source
row, and ``runworkers`` claims and runs it next to the row workers (one worker per queue).
``enqueue()`` is an INSERT in the caller's transaction: inside ``transaction.atomic()``
it commits or rolls back with the caller's own writes.
"""

from __future__ import annotations

import uuid
from typing import Any

from asgiref.sync import sync_to_async
from django.core import checks
from django.core.exceptions import ImproperlyConfigured

from .. import conf
from . import flow, uniqueness, values
from .compat import (
    BaseTaskBackend,
    InvalidTask,
    Task,
    TaskResult,
    TaskResultDoesNotExist,
    task_enqueued,
)
from .names import (
    MAX_ALIAS,
    MAX_QUEUE_NAME,
    OPTION_KEYS,
    QUEUE_SETTINGS,
    is_safe_name,
    queue_worker_name,
    safe_name,
)


class DatabaseBackend(BaseTaskBackend):
    supports_defer = True
    supports_priority = True
    supports_get_result = True
    supports_async_task = True

    def validate_task(self, task: Task) -> None:
        super().validate_task(task)
        if len(task.queue_name) > MAX_QUEUE_NAME:
            raise InvalidTask(f"Queue name {task.queue_name!r} is longer than "
                              f"{MAX_QUEUE_NAME} characters.")

    def enqueue(self, task: Task, args: Any, kwargs: Any) -> TaskResult:
        from ..models import Task as TaskRow
        from .results import to_result

        self.validate_task(task)
        try:
            limit = values.max_argument_bytes(self.options)
        except ValueError as exc:
            raise ImproperlyConfigured(f"TASKS[{self.alias!r}]['OPTIONS']: {exc}") from None
        # Anything a child could not read back is refused here, not in a child later.
        stored_args, stored_kwargs = values.arguments(task.module_path, args, kwargs, limit)
        fields = {"backend": self.alias, "queue_name": task.queue_name,
                  "task_path": task.module_path, "priority": task.priority,
                  "run_after": task.run_after, "args": stored_args, "kwargs": stored_kwargs,
                  "flow_key": flow.key_of(task.module_path, args, kwargs)}
        rule = uniqueness.rule_for(task.module_path)
        key = (rule.key_of(task.module_path, stored_args, stored_kwargs, (args, kwargs))
               if rule is not None else None)
        if rule is None or key is None:
            row = TaskRow.objects.using(_database()).create(id=uuid.uuid4(), **fields)
        else:
            done = uniqueness.enqueue(_database(), rule, key, fields)
            if not done.added:  # the task holding the key: nothing was enqueued
                return to_result(done.row, done.execution)
            row = done.row
        result = to_result(row, None, task)
        task_enqueued.send(type(self), task_result=result)
        return result

    async def aenqueue(self, task: Task, args: Any, kwargs: Any) -> TaskResult:
        return await sync_to_async(self.enqueue, thread_sensitive=True)(task, args, kwargs)

    def get_result(self, result_id: str) -> TaskResult:
        from django.core.exceptions import ValidationError

        from ..api import source_key
        from ..models import Execution
        from ..models import Task as TaskRow
        from ..registration.registry import registry
        from .results import to_result

        database = _database()
        try:
            row = TaskRow.objects.using(database).get(pk=result_id, backend=self.alias)
        except (TaskRow.DoesNotExist, ValidationError, ValueError):
            raise TaskResultDoesNotExist(result_id) from None
        name = queue_worker_name(row.backend, row.queue_name)
        key = source_key(registry[name], row.pk) if name in registry else str(row.pk)
        execution = Execution.objects.using(database).filter(worker=name, source_id=key).first()
        return to_result(row, execution)

    async def aget_result(self, result_id: str) -> TaskResult:
        return await sync_to_async(self.get_result, thread_sensitive=True)(result_id)

    def check(self, **kwargs: Any) -> list[checks.CheckMessage]:
        errors: list[checks.CheckMessage] = []
        hint = "See docs/tasks.md for the OPTIONS of django_dbworker.tasks.DatabaseBackend."
        options = self.options or {}
        if not isinstance(options, dict):
            return [checks.Error(f"TASKS[{self.alias!r}]['OPTIONS'] must be a dict.", hint=hint,
                                 id="django_dbworker.E020")]
        for key in sorted(set(options) - OPTION_KEYS):
            errors.append(checks.Error(
                f"TASKS[{self.alias!r}]['OPTIONS'] has an unknown key {key!r}.",
                hint=f"Known keys: {', '.join(sorted(OPTION_KEYS))}.", id="django_dbworker.E020"))
        errors += _argument_limit_errors(self.alias, options)
        per_queue = options.get("QUEUE_OPTIONS") or {}
        for queue, queue_options in per_queue.items() if isinstance(per_queue, dict) else []:
            if queue not in self.queues:
                errors.append(checks.Error(
                    f"TASKS[{self.alias!r}]['OPTIONS']['QUEUE_OPTIONS'] names queue {queue!r}, "
                    "which QUEUES does not list.", hint="Add it to QUEUES or remove it.",
                    id="django_dbworker.E021"))
            for key in sorted(set(queue_options or {}) - set(QUEUE_SETTINGS)):
                errors.append(checks.Error(
                    f"TASKS[{self.alias!r}] queue {queue!r} has an unknown option {key!r}.",
                    hint=f"Known: {', '.join(sorted(QUEUE_SETTINGS))}.",
                    id="django_dbworker.E020"))
        for queue in sorted(self.queues, key=str):
            if not is_safe_name(queue):
                errors.append(_unsafe_name(f"TASKS[{self.alias!r}] queue {queue!r}", queue))
            elif len(queue) > MAX_QUEUE_NAME:
                errors.append(checks.Error(
                    f"TASKS[{self.alias!r}] queue {queue!r} is longer than {MAX_QUEUE_NAME} "
                    "characters.", hint="Use a shorter queue name.", id="django_dbworker.E022"))
        if not is_safe_name(self.alias):
            errors.append(_unsafe_name(f"TASKS alias {self.alias!r}", self.alias))
        elif len(self.alias) > MAX_ALIAS:
            errors.append(checks.Error(
                f"TASKS alias {self.alias!r} is longer than {MAX_ALIAS} characters.",
                hint="Use a shorter alias.", id="django_dbworker.E022"))
        return errors


def _unsafe_name(what: str, name: object) -> checks.Error:
    return checks.Error(
        f"{what} may hold only letters, digits, '_' and '-': it becomes part of the worker "
        "name tasks.<alias>.<queue>.",
        hint=f"Rename it, e.g. to {safe_name(name)!r}.", id="django_dbworker.E023")


def _database() -> str:
    return str(conf.value("DATABASE"))


def _argument_limit_errors(alias: str, options: dict[str, Any]) -> list[checks.CheckMessage]:
    try:
        values.max_argument_bytes(options)
    except ValueError as exc:
        return [checks.Error(f"TASKS[{alias!r}]['OPTIONS']: {exc}",
                             hint="e.g. 1048576 (the default, 1 MiB); see docs/tasks.md.",
                             id="django_dbworker.E020")]
    return []
