"""``django.tasks`` on Django 6, the ``django-tasks`` backport on Django 5.2: whichever is
present, under one set of names."""

from __future__ import annotations

from importlib.util import find_spec
from typing import TYPE_CHECKING

if TYPE_CHECKING or find_spec("django.tasks"):
    from django.tasks import task_backends
    from django.tasks.backends.base import BaseTaskBackend
    from django.tasks.base import (
        Task,
        TaskContext,
        TaskError,
        TaskResult,
        TaskResultStatus,
    )
    from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist
    from django.tasks.signals import task_enqueued, task_finished, task_started
    from django.utils.json import normalize_json
else:  # pragma: no cover - Django 5.2 with the backport (the django-tasks extra)
    try:
        from django_tasks import task_backends
        from django_tasks.backends.base import BaseTaskBackend
        from django_tasks.base import (
            Task,
            TaskContext,
            TaskError,
            TaskResult,
            TaskResultStatus,
        )
        from django_tasks.exceptions import (
            InvalidTaskError as InvalidTask,
        )
        from django_tasks.exceptions import (
            TaskResultDoesNotExist,
        )
        from django_tasks.signals import (
            task_enqueued,
            task_finished,
            task_started,
        )
        from django_tasks.utils import normalize_json
    except ImportError as exc:
        raise ImportError(
            "django_dbworker.tasks needs Django 6's django.tasks, or on Django 5.2 the "
            "backport: pip install 'django-dbworker[tasks]'") from exc

__all__ = [
    "BaseTaskBackend", "InvalidTask", "Task", "TaskContext", "TaskError", "TaskResult",
    "TaskResultDoesNotExist", "TaskResultStatus", "normalize_json", "task_backends",
    "task_enqueued", "task_finished", "task_started",
]
