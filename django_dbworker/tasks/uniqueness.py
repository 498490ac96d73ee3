"""Unique and debounced tasks: ``@unique(...)`` above ``@task()`` (docs/tasks.md).

A unique task's ``enqueue()`` computes a key from its arguments and holds the key's row
(``TaskUniqueKey``, one per backend, task path and key) locked for the rest of the
caller's transaction. Concurrent enqueues of one key take turns on that row, each seeing
what the one before it committed, so the decision "the held task still counts: return
it" or "it does not: add a task and hold the key with it" is exact on every host. It is
never a check and then an insert: the row is created by an insert that skips an existing
one, then locked, then read.

Within a window (``within=``): the held task also counts for that long after it was
enqueued (its Execution's created_at against the database's now), whatever it became
(finished, failed): at most one task per key per window.

Debounced (``debounce=``): the held task, while it has not started, takes the new
arguments and runs ``debounce`` after the latest enqueue. Its Execution is postponed by an
UPDATE guarded by its status, so a claim that took it first leaves the update nothing to
change (the enqueue then adds a task: the running one has the old arguments), and a claim
after it finds the task not due.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal

from django.core.exceptions import ImproperlyConfigured
from django.utils import timezone

from ..status import ExecutionStatus
from .values import key_text

Among = Literal["pending", "pending_or_running"]
AMONG: dict[str, tuple[ExecutionStatus, ...]] = {
    # READY in django.tasks' terms: not started yet, or waiting for a retry.
    "pending": (ExecutionStatus.PENDING, ExecutionStatus.UNFINISHED),
    "pending_or_running": (ExecutionStatus.PENDING, ExecutionStatus.UNFINISHED,
                           ExecutionStatus.WORKING),
}


@dataclass(frozen=True, slots=True)
class UniqueRule:
    """What ``@unique`` declared for one task."""

    key: Callable[..., Any] | None  # None: the arguments themselves
    among: Among
    debounce: timedelta | None
    within: timedelta | None = None  # the held task counts this long after its enqueue

    def key_of(self, task_path: str, args: list[Any], kwargs: dict[str, Any],
               original: tuple[Any, Any]) -> str | None:
        """The enqueue's key: ``key(*args, **kwargs)`` as text (None: this enqueue is
        not unique), or without ``key`` a digest of the arguments as stored."""
        if self.key is None:
            stored = json.dumps([args, kwargs], sort_keys=True, separators=(",", ":"))
            return hashlib.sha256(stored.encode()).hexdigest()
        return key_text(self.key(*original[0], **original[1]),
                        f"The unique key of task {task_path}",
                        "have key= return something shorter (a digest)")


_rules: dict[str, UniqueRule] = {}


def unique(*, key: Callable[..., Any] | None = None, among: Among = "pending",
           debounce: timedelta | float | None = None,
           within: timedelta | float | None = None) -> Callable[[Any], Any]:
    """Enqueue a task at most once per key: ``@unique(key=lambda order_id, **_: order_id)``
    above ``@task()``. While a task with the key is ``among`` (``"pending"``: not started;
    ``"pending_or_running"``: not finished), ``enqueue()`` returns that task's result
    instead of adding one. ``key`` receives the task's arguments; without it the arguments
    themselves are the key. ``debounce`` (seconds or a timedelta): the pending task takes
    the latest arguments and runs that long after the latest enqueue. ``within`` (seconds
    or a timedelta): the task also holds its key that long after it was enqueued, whatever
    it became: at most one task per key per window. Returns the task unchanged."""

    def decorate(task: Any) -> Any:
        path = getattr(task, "module_path", None)
        where = f"@unique on {path or task!r}"
        if path is None:
            raise ImproperlyConfigured(f"{where}: put @unique(...) above @task(), on a task.")
        if among not in AMONG:
            raise ImproperlyConfigured(
                f"{where}: among={among!r} is not one of {', '.join(map(repr, AMONG))}.")
        if key is not None and not callable(key):
            raise ImproperlyConfigured(f"{where}: key must be a function of the task's "
                                       "arguments (or left out: the arguments are the key).")
        window = _duration(where, "debounce", debounce)
        if window is not None and among != "pending":
            raise ImproperlyConfigured(
                f"{where}: debounce needs among=\"pending\" (a running task has the old "
                "arguments, so a later enqueue must add a task).")
        held_for = _duration(where, "within", within)
        if held_for is not None and window is not None:
            raise ImproperlyConfigured(
                f"{where}: use debounce or within, not both (a debounce's last arguments "
                "would be dropped by a finished task that still holds the key).")
        _rules[path] = UniqueRule(key=key, among=among, debounce=window, within=held_for)
        return task

    return decorate


def _duration(where: str, option: str, value: Any) -> timedelta | None:
    if value is None:
        return None
    if isinstance(value, int | float) and not isinstance(value, bool):
        value = timedelta(seconds=value)
    if not isinstance(value, timedelta) or value.total_seconds() <= 0:
        raise ImproperlyConfigured(f"{where}: {option} must be a positive number of seconds "
                                   "or a timedelta.")
    return value


def rule_for(task_path: str) -> UniqueRule | None:
    return _rules.get(task_path)


@dataclass(frozen=True, slots=True)
class Enqueued:
    """What a unique enqueue did: ``row`` is the new Task (``added``) or the held one,
    with its Execution as read under the key's lock (None for a new task)."""

    row: Any
    added: bool
    execution: Any = None


def enqueue(database: str, rule: UniqueRule, key: str, fields: dict[str, Any]) -> Enqueued:
    """Add a Task row of ``fields``, or return the one holding ``key``. Runs in the
    caller's transaction (in a savepoint of it: a failure here undoes only this
    enqueue)."""
    from django.db import connections, transaction

    from ..models import Execution, TaskUniqueKey
    from ..models import Task as TaskRow
    from ..store.session import OnDjango
    from ..store.tables import task_unique_key_table
    from ..store.transitions import postpone
    from .names import queue_worker_name

    names = {"backend": fields["backend"], "task_path": fields["task_path"], "key": key}
    on = OnDjango(database)
    with transaction.atomic(using=database):
        # The key's row, created when missing (an insert that skips a present row: two
        # first enqueues of a key meet on the unique index, the second waits for the first
        # to commit), then locked: every enqueue of the key from here on takes its turn.
        on.run(on.vendor.insert_missing(task_unique_key_table(), [names]))  # (task_id NULL)
        holder = TaskUniqueKey.objects.using(database).select_for_update().get(**names)
        held = (TaskRow.objects.using(database).filter(pk=holder.task_id).first()
                if holder.task_id is not None else None)
        execution = None
        if held is not None:
            # As last committed (READ COMMITTED, Django's level on every backend): a claim
            # of the task that has not committed yet is not seen, and the task, still
            # pending here, starts after this enqueue. A debounce's postpone re-checks the
            # status as it writes (a claim in between leaves it nothing to change).
            execution = (Execution.objects.using(database)
                         .filter(worker=queue_worker_name(held.backend, held.queue_name),
                                 source_id=_source_id(database, held.pk)).first())
        if held is not None and execution is not None and execution.status in AMONG[rule.among]:
            if rule.debounce is None:
                return Enqueued(held, added=False, execution=execution)
            run_after = _debounced(rule.debounce)
            # (Bound as the ORM binds a DateTimeField: SQLite stores naive UTC text.)
            until = connections[database].ops.adapt_datetimefield_value(run_after)
            if postpone(on, execution.pk, until, AMONG[rule.among]):
                TaskRow.objects.using(database).filter(pk=held.pk).update(
                    args=fields["args"], kwargs=fields["kwargs"], run_after=run_after)
                held.args, held.kwargs, held.run_after = fields["args"], fields["kwargs"], run_after
                return Enqueued(held, added=False, execution=execution)
        if execution is not None and rule.within is not None and _in_window(
                database, on.vendor, execution.pk, rule.within):
            return Enqueued(held, added=False, execution=execution)
        if rule.debounce is not None:
            fields = {**fields, "run_after": _debounced(rule.debounce)}
        row = TaskRow.objects.using(database).create(id=uuid.uuid4(), **fields)
        TaskUniqueKey.objects.using(database).filter(pk=holder.pk).update(task_id=row.pk)
        return Enqueued(row, added=True)


def _in_window(database: str, vendor: Any, execution_id: int, within: timedelta) -> bool:
    """Whether the task's Execution was made less than ``within`` ago, both times the
    database's: the insert trigger wrote its created_at, in the enqueue's transaction, and
    hosts' clocks never take part. Inside its window a task holds its key whatever it
    became."""
    from ..models import Execution

    since = vendor.now_expression(-within.total_seconds())
    return Execution.objects.using(database).filter(pk=execution_id, created_at__gt=since).exists()


def _source_id(database: str, pk: uuid.UUID) -> str:
    """The task's key as its Execution stores it: the database's text of the column (on
    SQLite a UUID is 32 hex digits, elsewhere the dashed form)."""
    from django.db import connections

    from ..models import Task as TaskRow

    return str(TaskRow._meta.pk.get_db_prep_value(pk, connections[database], prepared=False))


def _debounced(window: timedelta) -> datetime:
    # A task's run_after is the enqueuing process's time, as django.tasks defines it.
    return timezone.now() + window
