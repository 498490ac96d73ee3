"""The names a task backend gives: its paths, its queues' worker names, the OPTIONS keys
and which Worker field each sets. Pure values, imported by the backend (to check its
settings) and by the queues (to register them) alike, so neither needs the other.
"""

from __future__ import annotations

import re
from typing import Any

BACKEND = "django_dbworker.tasks.DatabaseBackend"
# The paths of DatabaseBackend, known without an import; a subclass of it is ours too.
OUR_PATHS = frozenset({BACKEND, "django_dbworker.tasks.backend.DatabaseBackend"})
NOT_OURS = ("django.tasks.", "django_tasks.")  # Django's own backends, the backport's
PREFIX = "tasks."
MAX_QUEUE_NAME = 32  # Task.queue_name
MAX_ALIAS = 32  # Task.backend
# OPTIONS keys, each with the Worker field it sets; QUEUE_OPTIONS gives them per queue.
QUEUE_SETTINGS = {"CONCURRENCY": "concurrency", "MAX_ATTEMPTS": "max_attempts",
                  "RETRY_BACKOFF": "retry_backoff", "MAX_CRASHES": "max_crashes",
                  "TIMEOUT": "timeout", "MAX_TASKS_PER_CHILD": "max_tasks_per_child",
                  "TOTAL": "total", "RATE": "rate", "PER_KEY": "per_key",
                  "RATE_PER_KEY": "rate_per_key", "FAIR": "fair"}
# MAX_ARGUMENT_BYTES: the backend's limit on a task's stored arguments (backend.py).
OPTION_KEYS = {*QUEUE_SETTINGS, "QUEUE_OPTIONS", "MAX_ARGUMENT_BYTES"}
# What a queue name or a backend alias may hold: letters, digits, "_" and "-" ("default",
# "emails", "high-priority"). Each becomes part of a worker name, which the admin, logs,
# metric labels and SQL all carry; "." is the separator, so no two (alias, queue) pairs
# make one name. Anything else is a system check error (django_dbworker.E023).
SAFE_NAME = re.compile(r"[A-Za-z0-9_-]+\Z")


def is_safe_name(name: object) -> bool:
    return isinstance(name, str) and SAFE_NAME.match(name) is not None


def safe_name(name: object) -> str:
    """A name close to ``name`` that is_safe_name() accepts (for the check's hint)."""
    return re.sub(r"[^A-Za-z0-9_-]+", "_", str(name)).strip("_") or "default"


def queue_worker_name(alias: str, queue: str) -> str:
    return f"{PREFIX}{alias}.{queue}"


def queue_options(alias: str, params: dict[str, Any], queue: str) -> dict[str, Any]:
    """Worker fields for ``queue``: the backend's OPTIONS, then its QUEUE_OPTIONS entry."""
    options = params.get("OPTIONS") or {}
    per_queue = (options.get("QUEUE_OPTIONS") or {}).get(queue) or {}
    fields = {}
    for source in (options, per_queue):
        for key, field in QUEUE_SETTINGS.items():
            if key in source:
                fields[field] = source[key]
    if fields.get("per_key") is not None or fields.get("rate_per_key") or fields.get("fair"):
        fields["key"] = "flow_key"  # (Task.flow_key: what @flow_key computed at enqueue)
    return fields
