"""Schedules: tasks enqueued at cron times or intervals, exactly once per slot.

Declared in code with ``@periodic(cron="0 3 * * *")`` on a task of
``django_dbworker.tasks.DatabaseBackend``, or in ``DBWORKER["SCHEDULES"]``. Every
coordinator (unless started with ``--no-schedules``) looks at each schedule when a slot
is due; the slot is enqueued by whoever inserts its ``ScheduleSlot`` row first: a unique
(schedule, slot) constraint, in the same transaction as the enqueue, makes it exactly once
however many coordinators run, on however many machines. No leader is elected.

Cron expressions are parsed by ``cronsim`` (five fields, or six with seconds first), in
``settings.TIME_ZONE``; a DST change is handled the way cronsim documents (a slot in the
skipped hour runs when the hour resumes; a slot in the repeated hour runs once).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

from . import conf
from .processes import failpoints
from .store import clock

logger = logging.getLogger("django_dbworker.schedules")
CATCH_UP = ("latest", "all", "skip")
# After a coordinator was down: "all" enqueues at most this many missed slots.
MAX_CATCH_UP = 1000
# "skip": a slot still runs when a coordinator sees it this soon after its time (never
# later than half the gap to the next slot).
SKIP_GRACE = timedelta(seconds=60)
EPOCH = datetime(2000, 1, 1, tzinfo=UTC)
# Another coordinator is enqueueing a schedule: look again this soon.
BUSY_RETRY = timedelta(seconds=0.25)


@dataclass
class Schedule:
    name: str
    task_path: str
    cron: str | None = None
    every: timedelta | None = None
    args: list[Any] = field(default_factory=list)
    kwargs: dict[str, Any] = field(default_factory=dict)
    catch_up: str = "latest"

    def describe(self) -> str:
        return f"cron {self.cron}" if self.cron else f"every {self.every}"

    def zone(self) -> ZoneInfo:
        return ZoneInfo(str(getattr(settings, "TIME_ZONE", None) or "UTC"))

    def slots_after(self, start: datetime) -> Iterator[datetime]:
        """The slots strictly after ``start``, in order, as UTC datetimes."""
        if self.every is not None:
            step = self.every
            n = (start - EPOCH) // step + 1
            while True:
                yield EPOCH + n * step
                n += 1
        from cronsim import CronSim

        for slot in CronSim(str(self.cron), start.astimezone(self.zone())):
            yield slot.astimezone(UTC)

    def previous_slot(self, now: datetime) -> datetime:
        """The last slot at or before ``now`` (the history of a new schedule starts there)."""
        if self.every is not None:
            return EPOCH + ((now - EPOCH) // self.every) * self.every
        from cronsim import CronSim

        local = now.astimezone(self.zone())
        return next(CronSim(str(self.cron), local, reverse=True)).astimezone(UTC)

    def due(self, last: datetime, now: datetime) -> list[datetime]:
        """The slots to enqueue now, after ``last`` (the latest recorded), by the
        catch-up policy."""
        missed = []
        for slot in self.slots_after(last):
            if slot > now:
                break
            missed.append(slot)
            if len(missed) > MAX_CATCH_UP:
                missed.pop(0)
        if not missed:
            return []
        if self.catch_up == "all":
            return missed
        latest = missed[-1]
        if self.catch_up == "skip":
            gap = next(self.slots_after(latest)) - latest
            return [latest] if now - latest <= min(SKIP_GRACE, gap / 2) else []
        return [latest]

    def next_slot(self, now: datetime) -> datetime:
        return next(self.slots_after(now))

    def task(self) -> Any:
        from .tasks.results import import_task

        return import_task(self.task_path)


_declared: dict[str, Schedule] = {}


def periodic(*, cron: str | None = None, every: timedelta | float | None = None,
             name: str | None = None, args: Any = (), kwargs: Any = None,
             catch_up: str = "latest") -> Callable[[Any], Any]:
    """Run a task at cron times or intervals: ``@periodic(cron="0 3 * * *")`` above
    ``@task()``. Returns the task unchanged. ``name`` defaults to the task's path."""

    def decorate(task: Any) -> Any:
        schedule = Schedule(name=name or task.module_path, task_path=task.module_path,
                            cron=cron, every=_interval(every), args=list(args),
                            kwargs=dict(kwargs or {}), catch_up=catch_up)
        problem = validate(schedule)
        if problem:
            raise ImproperlyConfigured(problem)
        _declared[schedule.name] = schedule
        return task

    return decorate


def _interval(every: Any) -> timedelta | None:
    if every is None or isinstance(every, timedelta):
        return every
    if isinstance(every, int | float) and not isinstance(every, bool):
        return timedelta(seconds=every)
    return every  # refused by validate()


def from_settings() -> dict[str, Schedule]:
    found = {}
    for name, spec in (conf.value("SCHEDULES") or {}).items():
        found[name] = Schedule(name=name, task_path=spec.get("task", ""), cron=spec.get("cron"),
                               every=_interval(spec.get("every")),
                               args=list(spec.get("args") or []),
                               kwargs=dict(spec.get("kwargs") or {}),
                               catch_up=spec.get("catch_up", "latest"))
    return found


def schedules() -> dict[str, Schedule]:
    """Every schedule: the declared ones, then those of DBWORKER["SCHEDULES"]."""
    return {**_declared, **from_settings()}


def validate(schedule: Schedule, check_task: bool = False) -> str | None:
    """What is wrong with a schedule, as one line naming the fix; None when nothing."""
    where = f"Schedule {schedule.name!r}"
    if (schedule.cron is None) == (schedule.every is None):
        return f"{where}: give either cron=\"...\" or every=<seconds or timedelta>, not both or neither."
    if schedule.every is not None and (not isinstance(schedule.every, timedelta)
                                       or schedule.every.total_seconds() <= 0):
        return f"{where}: every must be a positive number of seconds or a timedelta."
    if schedule.cron is not None:
        from cronsim import CronSim, CronSimError

        try:
            CronSim(str(schedule.cron), datetime.now(UTC))
        except (CronSimError, ValueError) as exc:
            return (f"{where}: cron {schedule.cron!r} is not a cron expression ({exc}); "
                    "e.g. '0 3 * * *' (five fields, or six with seconds first).")
    if schedule.catch_up not in CATCH_UP:
        return f"{where}: catch_up must be one of {', '.join(CATCH_UP)}, got {schedule.catch_up!r}."
    if check_task:
        try:
            task = import_string(schedule.task_path)
        except ImportError as exc:
            return (f"{where}: task {schedule.task_path!r} cannot be imported ({exc}); give "
                    "the dotted path of a @task function.")
        from .tasks.queues import BACKEND, is_database_backend

        backend = getattr(task, "get_backend", None)
        if backend is None:
            return f"{where}: {schedule.task_path!r} is not a task: decorate it with @task()."
        if not is_database_backend(getattr(settings, "TASKS", {}).get(task.backend, {})
                                   .get("BACKEND")):
            return (f"{where}: task {schedule.task_path!r} uses the {task.backend!r} backend, "
                    f"which is not {BACKEND}: schedules enqueue on this app's backend.")
    return None


class Scheduler:
    """A coordinator's part in schedules: enqueue the slots that are due, exactly once."""

    def __init__(self, database: str, lease_seconds: float | None = None) -> None:
        self.database = database
        self.schedules = schedules()
        self._next: datetime | None = None  # when a slot of some schedule is due next
        # A slot's transaction left idle this long (its coordinator frozen or cut off) is
        # ended by the server, where the server can: as long as a claim waits for one.
        self.frozen_after = float(lease_seconds if lease_seconds is not None
                                  else conf.value("LEASE_SECONDS"))

    def __bool__(self) -> bool:
        return bool(self.schedules)

    def due_at(self) -> datetime | None:
        return self._next

    def run(self, now: datetime | None = None) -> int:
        """Enqueue what is due; returns how many slots this coordinator enqueued."""
        from django.db import connections
        from django.db.models import Max

        from .models import ScheduleSlot

        given = now
        if self._next is not None and (given or clock.estimate(self.database)) < self._next:
            return 0
        # A long-lived process: a connection an outage broke is replaced, not reused.
        connections[self.database].close_if_unusable_or_obsolete()
        now = given or clock.now(self.database)
        last = dict(ScheduleSlot.objects.using(self.database)
                    .filter(schedule__in=list(self.schedules)).values_list("schedule")
                    .annotate(last=Max("slot")).values_list("schedule", "last"))
        enqueued, busy = 0, False
        for schedule in self.schedules.values():
            if schedule.name not in last:
                # A new schedule: its history starts at the slot before now (recorded, so
                # that every coordinator agrees, and nothing before it ever runs).
                busy |= self._record(schedule, schedule.previous_slot(now), enqueue=False) is None
                continue
            for slot in schedule.due(last[schedule.name], now):
                done = self._record(schedule, slot, enqueue=True)
                if done is None:  # another coordinator is at it: its slots wait for it
                    busy = True
                    break
                enqueued += done
        self._next = min((s.next_slot(now) for s in self.schedules.values()), default=None)
        if busy:  # look again soon: it commits (or its transaction ends) shortly
            retry = now + BUSY_RETRY
            self._next = retry if self._next is None else min(self._next, retry)
        return enqueued

    def _record(self, schedule: Schedule, slot: datetime, *, enqueue: bool) -> int | None:
        """Insert (schedule, slot) and enqueue its task in one transaction: 1 (0 for a
        history start), or 0 if another coordinator got there first (the unique constraint
        says so), or None if another coordinator is enqueueing this schedule right now.

        The unique constraint alone makes it exactly once. The schedule's lock, taken
        without waiting, is what keeps this loop from waiting on another coordinator's
        uncommitted row: frozen or cut off in its transaction, that one would hold up the
        loop of every coordinator (their leases, their claims) until its session died."""
        from django.db import DatabaseError, connections

        from .vendors import for_connection

        vendor = for_connection(connections[self.database])
        try:
            done = self._insert(vendor, schedule, slot, enqueue)
        except BaseException:
            with contextlib.suppress(DatabaseError):  # (the first error is the one to tell)
                vendor.end_schedule_lock()
            raise
        vendor.end_schedule_lock()
        if done:
            logger.info("Schedule %s: enqueued the %s slot", schedule.name, slot.isoformat())
        return done

    def _insert(self, vendor: Any, schedule: Schedule, slot: datetime, enqueue: bool) -> int | None:
        from django.db import IntegrityError, transaction

        from .models import ScheduleSlot
        from .tasks.compat import TaskResult

        try:
            # Durable: the lock is let go after this commit, never after an outer one's.
            with transaction.atomic(using=self.database, durable=True):
                with vendor.connection.cursor() as cursor:
                    if not vendor.try_schedule_lock(cursor, schedule.name, self.frozen_after):
                        return None
                row = ScheduleSlot.objects.using(self.database).create(
                    schedule=schedule.name, slot=slot, enqueued_at=clock.now(self.database))
                if enqueue:
                    failpoints.reached("scheduler.slot_inserted")
                    result: TaskResult = schedule.task().enqueue(*schedule.args, **schedule.kwargs)
                    row.task_id = result.id
                    row.save(update_fields=["task"])
        except IntegrityError:
            return 0
        return int(enqueue)
