"""Where work state lives: one ``Execution`` row per (worker, source row)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from typing import Any

from django.db import models
from django.db.models import Case, F, Q, Value, When
from django.utils import timezone

from .status import CLAIMABLE, WAITING, ExecutionStatus


class ExecutionQuerySet(models.QuerySet["Execution"]):
    def for_worker(self, name: str) -> ExecutionQuerySet:
        return self.filter(worker=name)

    def claimable(self) -> ExecutionQuerySet:
        """Claimable now (pending or unfinished, and not waiting for a due time)."""
        return self.filter(claimable_worker__isnull=False)

    def working(self) -> ExecutionQuerySet:
        return self.filter(status=ExecutionStatus.WORKING)

    def failed(self) -> ExecutionQuerySet:
        return self.filter(status=ExecutionStatus.FAILED)

    def finished(self) -> ExecutionQuerySet:
        return self.filter(status=ExecutionStatus.FINISHED)

    def reset_failed(self) -> int:
        """FAILED -> UNFINISHED (claimable again), error and claim cleared. Returns how
        many rows changed. The one code path for every reset: API, admin, mixin."""
        from .store.transitions import reset

        return self._transition(reset, self.failed())

    def run_again(self) -> int:
        """FINISHED -> UNFINISHED: claimable again when eligible, from a clean slate.
        Returns how many rows changed; other statuses are left alone."""
        from .store.transitions import run_again

        return self._transition(run_again, self.finished())

    def _transition(self, transition: Any, rows: ExecutionQuerySet) -> int:
        # The store's transition on these rows' ids, in one transaction; it re-checks
        # each row's status as it changes it.
        from django.db import transaction

        from .store.session import OnDjango

        with transaction.atomic(using=self.db):
            ids = list(rows.values_list("pk", flat=True))
            return int(transition(OnDjango(self.db), ids)) if ids else 0

    def held_by_any(self, claims: Iterable[Any]) -> ExecutionQuerySet:
        """The rows these claims (each with execution_id and token) still hold."""
        by_token: dict[str, list[int]] = {}
        for claim in claims:
            by_token.setdefault(claim.token, []).append(claim.execution_id)
        held = Q()
        for token, ids in by_token.items():
            held |= Q(id__in=ids, claim_token=token)
        return self.filter(held, status=ExecutionStatus.WORKING)

    def held_by(self, execution_id: int, token: str) -> ExecutionQuerySet:
        """The row, only while this claim still holds it: the guard of every outcome write."""
        return self.filter(id=execution_id, claim_token=token, status=ExecutionStatus.WORKING)


def _worker_while(statuses: Iterable[ExecutionStatus], *, waits_for_time: bool) -> Any:
    """A stored generated column: the worker name while the row has one of ``statuses``
    and (does or does not) wait for ``next_attempt_at``; NULL otherwise. Indexed, it holds
    only the rows in that state, whatever the history size."""
    return models.GeneratedField(
        expression=Case(
            When(Q(status__in=[s.value for s in statuses])
                 & Q(next_attempt_at__isnull=not waits_for_time), then=F("worker")),
            default=Value(None),
        ),
        output_field=models.CharField(max_length=100, null=True),
        db_persist=True,
        editable=False,
    )


class Execution(models.Model):
    """The work state of one source row for one worker.

    Rows are written by database triggers the moment a source row is inserted (status
    PENDING), so claims read an index of claimable rows and never anti-join history.
    """

    worker = models.CharField(max_length=100)
    # Text, so that int, UUID and string primary keys all fit; it holds the database's
    # own text form of the key (what CAST(pk AS text) gives), see api.source_key().
    source_id = models.CharField(max_length=255)
    status = models.CharField(
        max_length=16,
        choices=[(s.value, s.name.title()) for s in ExecutionStatus],
        default=ExecutionStatus.PENDING,
    )
    # The worker name while the row is claimable now, NULL otherwise. Claims read an
    # index on (claimable_worker, id) that holds only these rows, whatever the history
    # size. A generated column because MySQL/MariaDB have no partial indexes.
    claimable_worker = _worker_while(CLAIMABLE, waits_for_time=False)
    # The worker name while the row waits for next_attempt_at (a retry's back-off, a
    # task's run_after, a finished row's rerun_every), NULL otherwise. Its index on
    # (waiting_worker, next_attempt_at) gives the next due time and the rows that are due,
    # which the coordinator then makes claimable (see Bridge.promote_due).
    waiting_worker = _worker_while(WAITING, waits_for_time=True)
    # Higher runs first: tasks' priority (-100..100); 0 for every row worker.
    priority = models.SmallIntegerField(default=0)
    claim_token = models.CharField(max_length=32, null=True, blank=True, editable=False)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    attempts = models.PositiveIntegerField(default=0)
    # Times in a row the row's process died while its handler ran (a child killed by a
    # signal, an os._exit): at max_crashes it ends FAILED, so a row that kills its child
    # every time is quarantined instead of retried at the head of the line. Any outcome a
    # handler commits sets it back to 0.
    crashes = models.PositiveIntegerField(default=0, db_default=0)
    # Set while a failed attempt waits for its retry (max_attempts); claims skip the row
    # until then.
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    error_type = models.CharField(max_length=255, null=True, blank=True)
    error_message = models.TextField(null=True, blank=True)
    error_traceback = models.TextField(null=True, blank=True)
    claimed_by = models.CharField(max_length=255, null=True, blank=True)  # "host:pid"
    # The flow-control key (a worker's key=): the source row's value as text, written by
    # the claim that made the row WORKING, so a limit counts the key the row ran with
    # (docs/flow-control.md).
    flow_key = models.CharField(max_length=255, null=True, blank=True, editable=False)
    # rerun_on: a listed column changed while a handler ran; the row runs again after
    # that run commits. rerun_reason says why a finished row came back ("changed: file",
    # "stale" for rerun_every).
    rerun_requested = models.BooleanField(default=False)
    rerun_reason = models.CharField(max_length=255, null=True, blank=True)
    # When the row last became claimable (inserted, due, continued, reset): pickup
    # latency is measured from here.
    ready_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(default=timezone.now)

    objects = ExecutionQuerySet.as_manager()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["worker", "source_id"], name="dbworker_worker_source"),
        ]
        indexes = [
            # The claim index on (claimable_worker, id) is created by migration 0002, per
            # database: partial where the database has partial indexes.
            # Finding WORKING rows whose lease expired; also the admin's status filter.
            models.Index(fields=["status", "lease_expires_at"], name="dbworker_status_lease"),
            models.Index(fields=["worker", "status"], name="dbworker_worker_status"),
            # Recent failures and the dashboard's last hour: a range of the ends, by status.
            models.Index(fields=["status", "finished_at"], name="dbworker_status_finished"),
            # A key's running rows (per_key), counted by the claim: one index range.
            models.Index(fields=["worker", "flow_key", "status"], name="dbworker_working_key"),
        ]
        verbose_name = "execution"
        ordering = ["-id"]

    def __str__(self) -> str:
        return f"{self.worker} #{self.source_id}: {self.status}"

    @property
    def execution_status(self) -> ExecutionStatus | None:
        """The status, or None when the stored value is no status this version knows."""
        try:
            return ExecutionStatus(self.status)
        except ValueError:
            return None

    @property
    def error(self) -> dict[str, Any] | None:
        if self.error_type is None:
            return None
        return {
            "type": self.error_type,
            "message": self.error_message or "",
            "traceback": self.error_traceback or "",
        }


class FlowLock(models.Model):
    """What a claim locks before it counts running rows against a limit: one row per
    worker and key (key "" for the worker's total). Claims of one key, on every host,
    take turns on its row, so the count each reads includes the claims before it.
    Claims create these rows as they need them; they hold no state of their own."""

    worker = models.CharField(max_length=100)
    key = models.CharField(max_length=255)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["worker", "key"], name="dbworker_flowlock_key"),
        ]
        verbose_name = "flow lock"


class RateLog(models.Model):
    """Claims of a rate-limited worker (``rate=``), one row per claim (and key, for a rate
    per key) with how many rows it took, at the database's time. A claim counts the rows of the last period under the
    worker's FlowLock row and deletes older ones, so the table holds one period's claims."""

    worker = models.CharField(max_length=100)
    # The key the rows had, for a rate per key (rate_per_key); NULL for a worker's rate.
    key = models.CharField(max_length=255, null=True, blank=True)
    at = models.DateTimeField()
    claimed = models.PositiveIntegerField()

    class Meta:
        indexes = [models.Index(fields=["worker", "at"], name="dbworker_ratelog_at"),
                   models.Index(fields=["worker", "key"], name="dbworker_ratelog_key")]
        verbose_name = "rate log entry"
        verbose_name_plural = "rate log"


class CoordinatorHeartbeat(models.Model):
    """A live (or lately live) coordinator process, refreshed while it runs."""

    host = models.CharField(max_length=255)
    pid = models.PositiveIntegerField()
    # Boot id and PID namespace of its machine: a pid means something only there, so
    # only a coordinator with the same namespace may judge it dead by its pid.
    namespace = models.CharField(max_length=255, default="", blank=True)
    workers = models.TextField(help_text="Comma-separated worker names it hosts.")
    started_at = models.DateTimeField(default=timezone.now)
    heartbeat_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["host", "pid", "started_at"], name="dbworker_coordinator"),
        ]
        verbose_name = "coordinator"

    def __str__(self) -> str:
        return f"{self.host}:{self.pid}"


class InstalledTrigger(models.Model):
    """A trigger this app created (migrate). The app drops only triggers listed here, so
    a trigger of yours is never touched, whatever its name."""

    name = models.CharField(max_length=64, primary_key=True)
    table = models.CharField(max_length=255)
    worker = models.CharField(max_length=100)
    installed_at = models.DateTimeField(default=timezone.now)

    class Meta:
        verbose_name = "installed trigger"

    def __str__(self) -> str:
        return f"{self.name} on {self.table}"


class JSONText(models.TextField):
    """JSON kept as text. A JSONField would have Django's system checks connect to the
    database (to ask whether it supports JSON) before runworkers could wait for it; the
    values here are only ever read whole."""

    def from_db_value(self, value: Any, expression: Any, connection: Any) -> Any:
        return None if value is None else json.loads(value)

    def to_python(self, value: Any) -> Any:
        return json.loads(value) if isinstance(value, str) else value

    def get_prep_value(self, value: Any) -> Any:
        return None if value is None else json.dumps(value)


class Task(models.Model):
    """A task enqueued through ``django_dbworker.tasks.DatabaseBackend``: a source row
    like any other. Its Execution (worker ``tasks.<backend>.<queue>``) holds its state;
    this row holds what only tasks have."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    backend = models.CharField(max_length=32)  # the TASKS alias
    queue_name = models.CharField(max_length=32)
    task_path = models.CharField(max_length=255)
    priority = models.SmallIntegerField(default=0)
    run_after = models.DateTimeField(null=True, blank=True)
    args = JSONText(default=list, blank=True)
    kwargs = JSONText(default=dict, blank=True)
    enqueued_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    last_attempted_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    return_value = JSONText(null=True, blank=True)
    # One entry per attempt that ended with an error of its own (class path, traceback,
    # attempt number); worker_ids, the coordinator of each attempt.
    errors = JSONText(default=list, blank=True)
    worker_ids = JSONText(default=list, blank=True)
    # The flow-control key its @flow_key declaration computed at enqueue: a queue with
    # PER_KEY runs at most that many tasks of one key at once (docs/flow-control.md).
    flow_key = models.CharField(max_length=255, null=True, blank=True)

    class Meta:
        verbose_name = "task"
        indexes = [models.Index(fields=["finished_at"], name="dbworker_task_finished")]

    def __str__(self) -> str:
        return f"{self.task_path} ({self.pk})"

    @property
    def worker_name(self) -> str:
        return f"tasks.{self.backend}.{self.queue_name}"


class TaskUniqueKey(models.Model):
    """The one row per unique key of a ``@unique`` task (docs/tasks.md): which task holds
    the key now. An enqueue of the key locks this row, so concurrent enqueues take turns
    on it, and each decides from the held task's state whether to add a task or return
    the held one. Enqueues create these rows; ``dbworker_cleanup`` deletes those whose
    task is gone."""

    backend = models.CharField(max_length=32)  # the TASKS alias
    task_path = models.CharField(max_length=255)
    key = models.CharField(max_length=255)
    # The task that holds the key (no foreign key: a task's deletion leaves the row, which
    # then holds nothing).
    task_id = models.UUIDField(null=True, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["backend", "task_path", "key"],
                                               name="dbworker_task_unique_key")]
        verbose_name = "task unique key"

    def __str__(self) -> str:
        return f"{self.task_path}[{self.key}]"


class ScheduleSlot(models.Model):
    """One slot of one schedule, enqueued (or, for a schedule's first sight, the point its
    history starts). Unique on (schedule, slot): whoever inserts it first enqueues it, in
    the same transaction; every other coordinator's insert fails and enqueues nothing."""

    schedule = models.CharField(max_length=200)
    slot = models.DateTimeField()
    task = models.ForeignKey(Task, null=True, blank=True, on_delete=models.SET_NULL,
                             db_constraint=False, related_name="+")
    enqueued_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["schedule", "slot"], name="dbworker_schedule_slot")]
        verbose_name = "schedule slot"
        ordering = ["-slot"]

    def __str__(self) -> str:
        return f"{self.schedule} @ {self.slot.isoformat()}"


class WorkerPause(models.Model):
    """A paused worker: coordinators claim none of its rows until the row is deleted."""

    worker = models.CharField(max_length=100, primary_key=True)
    paused_at = models.DateTimeField(default=timezone.now)
    paused_by = models.CharField(max_length=255, blank=True, default="")
    reason = models.TextField(blank=True, default="")

    class Meta:
        verbose_name = "paused worker"

    def __str__(self) -> str:
        return f"{self.worker} (paused)"
