"""A ``django.tasks`` backend on django-dbworker's claims: see docs/tasks.md.

    TASKS = {"default": {"BACKEND": "django_dbworker.tasks.DatabaseBackend"}}
"""

from __future__ import annotations

from typing import Any

from .flow import flow_key
from .uniqueness import unique

__all__ = ["DatabaseBackend", "flow_key", "unique"]


def __getattr__(name: str) -> Any:
    # Loaded on first use: the queues are registered at start-up (tasks.queues) without
    # importing django.tasks, which Django 5.2 has only through the backport.
    if name == "DatabaseBackend":
        from .backend import DatabaseBackend

        return DatabaseBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
