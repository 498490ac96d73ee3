"""A task's flow-control key: ``@flow_key(...)`` above ``@task()`` (docs/flow-control.md).

The key is computed from the task's arguments at ``enqueue()`` and stored on its Task row
(``Task.flow_key``), so a queue with ``PER_KEY`` limits it as a row worker's ``per_key``
limits its source rows: the claim reads the key from the row. A task of a queue with
``PER_KEY`` that has no key (no declaration, or the function returned None) is not
limited per key.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.core.exceptions import ImproperlyConfigured

from .values import key_text

_keys: dict[str, Callable[..., Any]] = {}


def flow_key(key: Callable[..., Any]) -> Callable[[Any], Any]:
    """Give a task a flow-control key: ``@flow_key(lambda customer_id, *args, **kwargs:
    customer_id)`` above ``@task()``. ``key`` receives the task's arguments; its value, as
    text, is the key (None: no key). Returns the task unchanged."""

    def decorate(task: Any) -> Any:
        path = getattr(task, "module_path", None)
        if path is None:
            raise ImproperlyConfigured(f"@flow_key on {task!r}: put @flow_key(...) above "
                                       "@task(), on a task.")
        if not callable(key):
            raise ImproperlyConfigured(f"@flow_key on {path}: give a function of the task's "
                                       "arguments, e.g. lambda customer_id, *a, **kw: customer_id.")
        _keys[path] = key
        return task

    return decorate


def key_of(task_path: str, args: Any, kwargs: Any) -> str | None:
    """The task's key for these arguments (None: it has none)."""
    key = _keys.get(task_path)
    if key is None:
        return None
    return key_text(key(*args, **kwargs), f"The flow key of task {task_path}",
                    "have @flow_key return something shorter")
