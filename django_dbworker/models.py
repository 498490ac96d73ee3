"""Where work state lives: one ``Execution`` row per (worker, source row)."""

from __future__ import annotations

from typing import Any

from django.db import models
from django.db.models import Case, F, Value, When
from django.utils import timezone

from .status import CLAIMABLE, ExecutionStatus


class ExecutionQuerySet(models.QuerySet["Execution"]):
    def for_worker(self, name: str) -> ExecutionQuerySet:
        return self.filter(worker=name)

    def claimable(self) -> ExecutionQuerySet:
        return self.filter(status__in=CLAIMABLE)

    def working(self) -> ExecutionQuerySet:
        return self.filter(status=ExecutionStatus.WORKING)

    def failed(self) -> ExecutionQuerySet:
        return self.filter(status=ExecutionStatus.FAILED)

    def finished(self) -> ExecutionQuerySet:
        return self.filter(status=ExecutionStatus.FINISHED)

    def reset_failed(self) -> int:
        """FAILED -> UNFINISHED (claimable again), error and claim cleared. Returns how
        many rows changed. The one code path for every reset: API, admin, mixin."""
        return self.failed().update(
            status=ExecutionStatus.UNFINISHED,
            claim_token=None,
            lease_expires_at=None,
            next_attempt_at=None,
            attempts=0,
            error_type=None,
            error_message=None,
            error_traceback=None,
            finished_at=None,
            updated_at=timezone.now(),
        )

    def run_again(self) -> int:
        """FINISHED -> UNFINISHED: claimable again when eligible, from a clean slate.
        Returns how many rows changed; other statuses are left alone."""
        return self.finished().update(
            status=ExecutionStatus.UNFINISHED, claim_token=None, lease_expires_at=None,
            next_attempt_at=None, attempts=0, error_type=None, error_message=None,
            error_traceback=None, finished_at=None, updated_at=timezone.now(),
        )

    def held_by(self, execution_id: int, token: str) -> ExecutionQuerySet:
        """The row, only while this claim still holds it: the guard of every outcome write."""
        return self.filter(id=execution_id, claim_token=token, status=ExecutionStatus.WORKING)


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
    # The worker name while the row is claimable, NULL otherwise. Claims read an index on
    # (claimable_worker, id) that holds only claimable rows, whatever the history size.
    # A generated column because MySQL/MariaDB have no partial indexes.
    claimable_worker = models.GeneratedField(
        expression=Case(
            When(status__in=[s.value for s in CLAIMABLE], then=F("worker")),
            default=Value(None),
        ),
        output_field=models.CharField(max_length=100, null=True),
        db_persist=True,
        editable=False,
    )
    claim_token = models.CharField(max_length=32, null=True, blank=True, editable=False)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    attempts = models.PositiveIntegerField(default=0)
    # Set while a failed attempt waits for its retry (max_attempts); claims skip the row
    # until then.
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    error_type = models.CharField(max_length=255, null=True, blank=True)
    error_message = models.TextField(null=True, blank=True)
    error_traceback = models.TextField(null=True, blank=True)
    claimed_by = models.CharField(max_length=255, null=True, blank=True)  # "host:pid"
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
        ]
        verbose_name = "execution"
        ordering = ["-id"]

    def __str__(self) -> str:
        return f"{self.worker} #{self.source_id}: {self.status}"

    @property
    def execution_status(self) -> ExecutionStatus:
        return ExecutionStatus(self.status)

    @property
    def error(self) -> dict[str, Any] | None:
        if self.error_type is None:
            return None
        return {
            "type": self.error_type,
            "message": self.error_message or "",
            "traceback": self.error_traceback or "",
        }


class CoordinatorHeartbeat(models.Model):
    """A live (or lately live) coordinator process, refreshed while it runs."""

    host = models.CharField(max_length=255)
    pid = models.PositiveIntegerField()
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
