"""The figures of the admin dashboard and of ``manage.py dbworker_status``: a fixed
handful of queries, each on an index, whatever the size of the history."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db.models import Count, Max, Min, QuerySet, Sum
from django.db.models.functions import TruncMinute
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from .. import conf
from ..models import CoordinatorHeartbeat, Execution, ScheduleSlot, WorkerPause
from ..registration.registry import registry
from ..status import ExecutionStatus

MAX_COORDINATORS_SHOWN = 50
# FINISHED rows are the history and grow without bound; the dashboard counts them up to
# this many per worker (then shows "N+"), so a page view never reads the whole history.
FINISHED_COUNT_LIMIT = 10_000
BACKLOG = [s for s in ExecutionStatus if s != ExecutionStatus.FINISHED]
ACTIVITY_MINUTES = 60


def live_window() -> timedelta:
    """How recent a heartbeat must be for its coordinator to count as live.

    Coordinators beat every LEASE_SECONDS / 3 (with their lease renewals); three missed
    beats is the point at which their claims expire too, so it is the same verdict.
    """
    return timedelta(seconds=float(conf.value("LEASE_SECONDS")))


def format_age(age: timedelta) -> str:
    """Two units are enough at a glance: "3d 4h", "12m 5s", "8s"."""
    seconds = int(age.total_seconds())
    parts = [(seconds // 86400, "d"), (seconds // 3600 % 24, "h"), (seconds // 60 % 60, "m"),
             (seconds % 60, "s")]
    while len(parts) > 1 and parts[0][0] == 0:
        parts.pop(0)
    return " ".join(f"{n}{unit}" for n, unit in parts[:2])


@dataclass
class WorkerSummary:
    name: str
    registered: bool
    counts: dict[str, int] = field(default_factory=dict)
    finished_capped: bool = False  # more FINISHED rows than FINISHED_COUNT_LIMIT
    oldest_waiting: timedelta | None = None
    failed_last_hour: int = 0
    expired_leases: int = 0
    pause: WorkerPause | None = None
    # Flow control: each limit's state now ("total: 3 of 3 running, 40 rows held"); empty
    # for a worker without limits.
    limits: list[str] = field(default_factory=list)
    # minute (0 = an hour ago) -> (finished, failed) in that minute
    activity: dict[int, list[int]] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def oldest_waiting_display(self) -> str:
        return "" if self.oldest_waiting is None else format_age(self.oldest_waiting)

    def cells(self) -> list[tuple[str, int, bool]]:
        """(status, count, whether the count is a lower bound) per status, in order."""
        return [(s.value, self.counts.get(s.value, 0),
                 self.finished_capped and s == ExecutionStatus.FINISHED)
                for s in ExecutionStatus]

    def chart(self) -> SafeString:
        return activity_svg(self.activity)


@dataclass
class CoordinatorRow:
    host: str
    pid: int
    workers: list[str]
    started_at: datetime
    heartbeat_at: datetime
    live: bool


@dataclass
class ScheduleRow:
    name: str
    describe: str
    last_slot: datetime | None
    last_status: str | None
    next_slot: datetime | None


@dataclass
class Dashboard:
    """Bounded queries, whatever the history size (each says which index serves it):
    eight, plus one per worker for its capped FINISHED count and one per flow-control
    limit of a limited worker."""

    workers: list[WorkerSummary]
    coordinators: list[CoordinatorRow]
    live_window: timedelta
    schedules: list[ScheduleRow] = field(default_factory=list)

    @property
    def live_coordinators(self) -> int:
        return sum(c.live for c in self.coordinators)

    @property
    def totals(self) -> list[tuple[str, int, bool]]:
        capped = any(w.finished_capped for w in self.workers)
        return [(s.value, sum(w.counts.get(s.value, 0) for w in self.workers),
                 capped and s == ExecutionStatus.FINISHED)
                for s in ExecutionStatus]

    @classmethod
    def collect(cls, database: str, now: datetime) -> Dashboard:
        executions = Execution.objects.using(database).order_by()
        summaries = {name: WorkerSummary(name, True) for name in sorted(registry)}

        def summary(name: str) -> WorkerSummary:
            return summaries.setdefault(name, WorkerSummary(name, False))

        # The backlog (everything but FINISHED): a range of the (status, ...) index, so the
        # cost follows the work waiting or failed, not the history.
        for worker, status, n in (executions.filter(status__in=BACKLOG)
                                  .values_list("worker", "status").annotate(n=Count("*"))):
            summary(worker).counts[status] = n
        # The history, counted up to a limit per worker on the (worker, status) index.
        for s in list(summaries.values()):
            n = (executions.filter(worker=s.name, status=ExecutionStatus.FINISHED)
                 .values("id")[:FINISHED_COUNT_LIMIT + 1].count())
            if n:
                s.counts[ExecutionStatus.FINISHED.value] = min(n, FINISHED_COUNT_LIMIT)
                s.finished_capped = n > FINISHED_COUNT_LIMIT
        # The claimable index holds only claimable rows: the lowest id per worker is the
        # one pending longest (ids follow creation), fetched by primary key.
        first_ids = (executions.filter(claimable_worker__isnull=False)
                     .values("claimable_worker").annotate(first=Min("id")).values("first"))
        for worker, created_at in executions.filter(id__in=first_ids).values_list(
                "worker", "created_at"):
            summary(worker).oldest_waiting = max(now - created_at, timedelta(0))
        # (status, finished_at) index: the last hour's failures, and the last hour's ends
        # per minute for the chart: a range of it, never the history.
        hour_ago = now - timedelta(minutes=ACTIVITY_MINUTES)
        for worker, status, minute, n in chart_query(executions, hour_ago):
            s = summary(worker)
            slot = s.activity.setdefault(int((minute - hour_ago).total_seconds() // 60), [0, 0])
            slot[status == ExecutionStatus.FAILED] += n
            if status == ExecutionStatus.FAILED:
                s.failed_last_hour += n
        # (status, lease_expires_at) index, a range of it: claims whose holder stopped
        # renewing them.
        for worker, n in (executions.working().filter(lease_expires_at__lt=now)
                          .values_list("worker").annotate(n=Count("*"))):
            summary(worker).expired_leases = n
        for pause in WorkerPause.objects.using(database):
            summary(pause.worker).pause = pause
        for s in summaries.values():
            if s.registered and registry[s.name].limited:
                s.limits = _limits(registry[s.name], executions, s, now)

        window = live_window()
        coordinators = [
            CoordinatorRow(c.host, c.pid, [w for w in c.workers.split(",") if w],
                           c.started_at, c.heartbeat_at, c.heartbeat_at >= now - window)
            for c in CoordinatorHeartbeat.objects.using(database)
            .order_by("-heartbeat_at")[:MAX_COORDINATORS_SHOWN]
        ]
        return cls(sorted(summaries.values(), key=lambda s: (not s.registered, s.name)),
                   coordinators, window, _schedules(database, now))


def _limits(w: Any, executions: QuerySet[Execution], s: WorkerSummary, now: datetime) -> list[str]:
    """Each flow-control limit's state: how full it is, and the claimable rows it holds
    back when it is full (a worker-wide limit holds them all). A per-key limit says how
    many keys are full: which claimable rows those hold would take a read of every
    one's source row. One query per limit, on the (worker, flow_key, status) index or the
    rate log's (worker, at)."""
    from ..models import RateLog

    claimable = s.counts.get(ExecutionStatus.PENDING.value, 0) + s.counts.get(
        ExecutionStatus.UNFINISHED.value, 0)
    running = s.counts.get(ExecutionStatus.WORKING.value, 0)
    lines = []

    def held(full: bool) -> str:
        return f", {claimable} held back" if full and claimable else ""

    if w.per_key is not None:
        full = (executions.filter(worker=w.name, status=ExecutionStatus.WORKING,
                                  flow_key__isnull=False)
                .values("flow_key").annotate(n=Count("*")).filter(n__gte=w.per_key).count())
        lines.append(f"per {w.key}: {full} key{'s' if full != 1 else ''} at {w.per_key} running")
    if w.total is not None:
        lines.append(f"total: {running} of {w.total} running{held(running >= w.total)}")
    rate = w.rate_limit
    if rate is not None:
        window = RateLog.objects.using(executions.db).filter(
            worker=w.name, at__gt=now - timedelta(seconds=rate.seconds))
        if w.rate_per_key:
            full = (window.values("key").annotate(n=Sum("claimed"))
                    .filter(n__gte=rate.limit).count())
            lines.append(f"rate {rate} per {w.key}: {full} key{'s' if full != 1 else ''} at "
                         "their rate")
        else:
            used = window.aggregate(n=Sum("claimed"))["n"] or 0
            lines.append(f"rate {rate}: {used} claimed in the last {rate.seconds:g} s"
                         f"{held(used >= rate.limit)}")
    return lines


def _schedules(database: str, now: datetime) -> list[ScheduleRow]:
    from ..schedules import schedules

    declared = schedules()
    if not declared:
        return []
    # The (schedule, slot) unique index: the latest slot of each schedule.
    latest = dict(ScheduleSlot.objects.using(database).filter(schedule__in=list(declared))
                  .values_list("schedule").annotate(last=Max("slot")).values_list("schedule", "last"))
    statuses: dict[str, str | None] = {}
    for slot in ScheduleSlot.objects.using(database).filter(
            schedule__in=list(latest), slot__in=list(latest.values())).select_related("task"):
        if latest.get(slot.schedule) == slot.slot:
            statuses[slot.schedule] = _task_status(database, slot.task_id)
    rows = []
    for name, schedule in sorted(declared.items()):
        try:
            upcoming: datetime | None = schedule.next_slot(now)
        except Exception:  # noqa: BLE001 - a bad schedule: the system checks report it
            upcoming = None
        rows.append(ScheduleRow(name, schedule.describe(), latest.get(name),
                                statuses.get(name), upcoming))
    return rows


def _task_status(database: str, task_id: Any) -> str | None:
    if task_id is None:
        return None
    from ..models import Task

    task = Task.objects.using(database).filter(pk=task_id).only("backend", "queue_name").first()
    if task is None:
        return "pruned"
    from ..api import source_key

    worker = registry.get(task.worker_name)
    key = source_key(worker, task.pk) if worker else str(task.pk)
    return (Execution.objects.using(database).filter(worker=task.worker_name, source_id=key)
            .values_list("status", flat=True).first())


def chart_query(executions: QuerySet[Execution], since: datetime) -> QuerySet[Any]:
    """(worker, status, minute, count) of the executions that ended since ``since``.

    The range is read off the (status, finished_at) index in a subquery: grouped by worker
    in one query, SQLite's planner would rather walk the (worker, status) index, that is
    the whole history, than sort the last hour's rows."""
    ended = (executions.filter(status__in=[ExecutionStatus.FINISHED, ExecutionStatus.FAILED],
                               finished_at__gte=since).order_by().values("id"))
    # In UTC: the minutes of an hour are the same everywhere, and MySQL then needs no time
    # zone tables.
    return (executions.filter(id__in=ended).annotate(minute=TruncMinute("finished_at", tzinfo=UTC))
            .values_list("worker", "status", "minute").annotate(n=Count("*")).order_by())


def activity_svg(activity: dict[int, list[int]], width: int = 240, height: int = 36) -> SafeString:
    """Finished (green) and failed (red) per minute over the last hour, as a small inline
    SVG bar chart drawn on the server."""
    peak = max((f + x for f, x in activity.values()), default=0)
    bar = width / ACTIVITY_MINUTES
    rects = []
    for minute, (finished, failed) in sorted(activity.items()):
        if not 0 <= minute < ACTIVITY_MINUTES or not peak:
            continue
        x = minute * bar
        done_h = height * finished / peak
        fail_h = height * failed / peak
        rects.append((f"{x:.1f}", f"{height - done_h:.1f}", f"{bar * 0.8:.1f}", f"{done_h:.1f}",
                      "dbworker-bar-finished", f"{finished} finished"))
        rects.append((f"{x:.1f}", f"{height - done_h - fail_h:.1f}", f"{bar * 0.8:.1f}",
                      f"{fail_h:.1f}", "dbworker-bar-failed", f"{failed} failed"))
    return format_html(
        '<svg class="dbworker-chart" width="{}" height="{}" viewBox="0 0 {} {}" role="img" '
        'aria-label="finished and failed per minute, last hour">{}</svg>', width, height,
        width, height,
        format_html_join("", '<rect x="{}" y="{}" width="{}" height="{}" class="{}">'
                             '<title>{}</title></rect>', rects))
