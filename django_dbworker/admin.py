"""The operator's view of the work: Execution pages, reset, and a dashboard.

State is read-only here. Changes go through ``ExecutionQuerySet`` methods (the same code
the API uses), only as actions or the reset button, only with the change permission.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, cast

from django.contrib import admin, messages
from django.contrib.admin.utils import quote, unquote
from django.contrib.admin.views.main import ChangeList
from django.core.exceptions import PermissionDenied
from django.db import connections
from django.db.models import Count, Min, QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.test.utils import CaptureQueriesContext
from django.urls import NoReverseMatch, URLPattern, path, reverse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.text import Truncator

from . import conf
from .admin_mixins import DBWorkerStatusMixin, report_counts
from .models import CoordinatorHeartbeat, Execution, ExecutionQuerySet
from .registry import registry
from .status import ExecutionStatus
from .templatetags.dbworker import STYLESHEET, status_badge

__all__ = ["DBWorkerStatusMixin", "ExecutionAdmin"]

ERROR_SUMMARY_LENGTH = 120
MAX_COORDINATORS_SHOWN = 50
# FINISHED rows are the history and grow without bound; the dashboard counts them up to
# this many per worker (then shows "N+"), so a page view never reads the whole history.
FINISHED_COUNT_LIMIT = 10_000
BACKLOG = [s for s in ExecutionStatus if s != ExecutionStatus.FINISHED]


def _database() -> str:
    return conf.value("DATABASE")


def live_window() -> timedelta:
    """How recent a heartbeat must be for its coordinator to count as live.

    Coordinators beat every LEASE_SECONDS / 3 (with their lease renewals); three missed
    beats is the point at which their claims expire too, so it is the same verdict.
    """
    return timedelta(seconds=float(conf.value("LEASE_SECONDS")))


def run_again(queryset: QuerySet[Execution]) -> int:
    """FINISHED -> UNFINISHED: claimable again when eligible, from a clean slate.

    Belongs on ExecutionQuerySet beside reset_failed(); see the proposed change in the
    admin issue. Kept to one UPDATE guarded by status so a concurrent claim cannot race it.
    """
    return queryset.filter(status=ExecutionStatus.FINISHED).update(
        status=ExecutionStatus.UNFINISHED, claim_token=None, lease_expires_at=None,
        next_attempt_at=None, attempts=0, error_type=None, error_message=None,
        error_traceback=None, finished_at=None, updated_at=timezone.now(),
    )


def format_age(age: timedelta) -> str:
    """Two units are enough at a glance: "3d 4h", "12m 5s", "8s"."""
    seconds = int(age.total_seconds())
    parts = [(seconds // 86400, "d"), (seconds // 3600 % 24, "h"), (seconds // 60 % 60, "m"),
             (seconds % 60, "s")]
    while len(parts) > 1 and parts[0][0] == 0:
        parts.pop(0)
    return " ".join(f"{n}{unit}" for n, unit in parts[:2])


class WorkerFilter(admin.SimpleListFilter):
    """Choices from the registry: the default filter would SELECT DISTINCT the whole table."""

    title = "worker"
    parameter_name = "worker"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(name, name) for name in sorted(registry)]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        return queryset if value is None else queryset.filter(worker=value)


class ExecutionChangeList(ChangeList):
    def get_queryset(self, request: HttpRequest, exclude_parameters: Any = None) -> QuerySet[Any]:
        # A page of 100 tracebacks can weigh megabytes; the list shows the first line only.
        return super().get_queryset(request, exclude_parameters).defer("error_traceback")


@admin.register(Execution)
class ExecutionAdmin(admin.ModelAdmin):
    list_display = ["id", "worker", "source_link", "status_badge", "attempts",
                    "lease_expires_at", "claimed_by", "updated_at", "error_summary"]
    list_filter = [WorkerFilter, "status"]
    search_fields = ["source_id__exact", "error_type__icontains", "error_message__icontains"]
    search_help_text = "Exact source key, or part of the error type or message."
    # A second COUNT(*) of the whole table on every filtered page is not worth it.
    show_full_result_count = False
    # Facets run a COUNT per filter choice on every page view; the dashboard has the counts.
    show_facets = admin.ShowFacets.NEVER
    actions = ["reset_failed", "run_again"]
    readonly_fields = ["source_link", "status_badge", "traceback"]
    fieldsets = [
        (None, {"fields": ["worker", "source_link", "status_badge", "attempts",
                           "next_attempt_at"]}),
        ("Claim", {"fields": ["claimed_by", "lease_expires_at"]}),
        ("Timeline", {"fields": ["created_at", "started_at", "finished_at", "updated_at"]}),
        ("Error", {"fields": ["error_type", "error_message", "traceback"]}),
    ]

    class Media:
        css = {"all": [STYLESHEET]}

    # -- permissions: read-only rows, changes only through actions ---------------------
    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # triggers write these rows

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # a deleted row would silently never be worked on again

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # Without an object this is the permission actions and the reset button check; for
        # one object it is whether its form may be saved, which would overwrite live state.
        return obj is None and super().has_change_permission(request)

    def get_queryset(self, request: HttpRequest) -> ExecutionQuerySet:
        # Execution's default manager is ExecutionQuerySet.as_manager(); the unparameterised
        # ModelAdmin stub only knows it as a QuerySet.
        return cast(ExecutionQuerySet, super().get_queryset(request).using(_database()))

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return ExecutionChangeList

    # -- columns -----------------------------------------------------------------------
    def source_url(self, obj: Execution) -> str | None:
        w = registry.get(obj.worker)
        if w is None or not self.admin_site.is_registered(w.source):
            return None
        opts = w.source._meta
        try:
            return reverse(f"{self.admin_site.name}:{opts.app_label}_{opts.model_name}_change",
                           args=[quote(obj.source_id)])
        except NoReverseMatch:
            return None

    @admin.display(description="source")
    def source_link(self, obj: Execution) -> str:
        w = registry.get(obj.worker)
        label = f"{w.source._meta.verbose_name} {obj.source_id}" if w else obj.source_id
        url = self.source_url(obj)
        return format_html('<a href="{}">{}</a>', url, label) if url else label

    @admin.display(description="status", ordering="status")
    def status_badge(self, obj: Execution) -> SafeString:
        return status_badge(obj.status)

    @admin.display(description="error")
    def error_summary(self, obj: Execution) -> str:
        if not obj.error_type:
            return ""
        lines = (obj.error_message or "").strip().splitlines()
        text = f"{obj.error_type}: {lines[0]}" if lines else obj.error_type
        return Truncator(text).chars(ERROR_SUMMARY_LENGTH)

    @admin.display(description="traceback")
    def traceback(self, obj: Execution) -> SafeString | str:
        if not obj.error_traceback:
            return ""
        return format_html('<pre class="dbworker-traceback">{}</pre>', obj.error_traceback)

    # -- actions -------------------------------------------------------------------------
    @admin.action(description="Reset failed executions (claimable again)", permissions=["change"])
    def reset_failed(self, request: HttpRequest, queryset: ExecutionQuerySet) -> None:
        selected = queryset.count()
        changed = queryset.reset_failed()
        report_counts(self, request, changed=changed, skipped=selected - changed,
                      done="Reset failed executions", why_skipped="not failed")

    @admin.action(description="Run finished executions again", permissions=["change"])
    def run_again(self, request: HttpRequest, queryset: ExecutionQuerySet) -> None:
        selected = queryset.count()
        changed = queryset.run_again()
        report_counts(self, request, changed=changed, skipped=selected - changed,
                      done="Queued finished executions to run again",
                      why_skipped="not finished")

    # -- extra views ---------------------------------------------------------------------
    def get_urls(self) -> list[URLPattern]:
        wrap = self.admin_site.admin_view
        info = f"{self.opts.app_label}_{self.opts.model_name}"
        return [
            path("dashboard/", wrap(self.dashboard_view), name="django_dbworker_dashboard"),
            path("<path:object_id>/reset/", wrap(self.reset_view), name=f"{info}_reset"),
            *super().get_urls(),
        ]

    def change_view(self, request: HttpRequest, object_id: str, form_url: str = "",
                    extra_context: dict[str, Any] | None = None) -> HttpResponse:
        extra = {"can_reset": self.has_change_permission(request), **(extra_context or {})}
        return super().change_view(request, object_id, form_url, extra)

    def reset_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """GET asks for confirmation, POST resets; both only with the change permission."""
        if not self.has_change_permission(request):
            raise PermissionDenied
        obj = self.get_object(request, unquote(object_id))
        if obj is None:
            # Django's own "does not exist" message and redirect; private, so not in django-stubs.
            return self._get_obj_does_not_exist_redirect(  # type: ignore[attr-defined]
                request, self.opts, object_id)
        back = reverse(f"{self.admin_site.name}:{self.opts.app_label}_{self.opts.model_name}"
                       "_change", args=[quote(obj.pk)])
        if obj.status != ExecutionStatus.FAILED:
            self.message_user(request, f"{obj} has not failed: nothing to reset.",
                              messages.WARNING)
            return HttpResponseRedirect(back)
        if request.method == "POST":
            changed = self.get_queryset(request).filter(pk=obj.pk).reset_failed()
            if changed:
                self.log_change(request, obj, "Reset failed execution.")
                self.message_user(request, f"Reset {obj.worker} #{obj.source_id}: it is "
                                  "claimable again.", messages.SUCCESS)
            else:  # a worker or another operator got there between the GET and the POST
                self.message_user(request, "It had changed meanwhile: nothing to reset.",
                                  messages.WARNING)
            return HttpResponseRedirect(back)
        context = {
            **self.admin_site.each_context(request),
            "title": "Reset this execution?",
            "subtitle": None,
            "object": obj,
            "opts": self.opts,
            "app_label": self.opts.app_label,
            "back_url": back,
            "media": self.media,
        }
        return TemplateResponse(request, "admin/django_dbworker/execution/reset_confirmation.html",
                                context)

    def dashboard_view(self, request: HttpRequest) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        database = _database()
        started = time.perf_counter()
        with CaptureQueriesContext(connections[database]) as queries:
            dashboard = Dashboard.collect(database, timezone.now())
        elapsed_ms = (time.perf_counter() - started) * 1000
        context = {
            **self.admin_site.each_context(request),
            "title": "Background work dashboard",
            "subtitle": None,
            "opts": self.opts,
            "app_label": self.opts.app_label,
            "dashboard": dashboard,
            "statuses": list(ExecutionStatus),
            "query_count": len(queries),
            "query_ms": elapsed_ms,
            "finished_limit": FINISHED_COUNT_LIMIT,
            "media": self.media,
        }
        return TemplateResponse(request, "admin/django_dbworker/dashboard.html", context)


@dataclass
class WorkerSummary:
    name: str
    registered: bool
    counts: dict[str, int] = field(default_factory=dict)
    finished_capped: bool = False  # more FINISHED rows than FINISHED_COUNT_LIMIT
    oldest_waiting: timedelta | None = None
    failed_last_hour: int = 0
    expired_leases: int = 0

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


@dataclass
class CoordinatorRow:
    host: str
    pid: int
    workers: list[str]
    started_at: datetime
    heartbeat_at: datetime
    live: bool


@dataclass
class Dashboard:
    """Bounded queries, whatever the history size (each says which index serves it): five,
    plus one per worker for its capped FINISHED count."""

    workers: list[WorkerSummary]
    coordinators: list[CoordinatorRow]
    live_window: timedelta

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
        # The claimable index holds only waiting rows: the lowest id per worker is the one
        # waiting longest (ids follow creation), fetched by primary key.
        first_ids = (executions.filter(claimable_worker__isnull=False)
                     .values("claimable_worker").annotate(first=Min("id")).values("first"))
        for worker, created_at in executions.filter(id__in=first_ids).values_list(
                "worker", "created_at"):
            summary(worker).oldest_waiting = max(now - created_at, timedelta(0))
        # (status, lease_expires_at) index: reads failed rows only, not the history.
        for worker, n in (executions.failed().filter(finished_at__gte=now - timedelta(hours=1))
                          .values_list("worker").annotate(n=Count("*"))):
            summary(worker).failed_last_hour = n
        # Same index, a range of it: claims whose holder stopped renewing them.
        for worker, n in (executions.working().filter(lease_expires_at__lt=now)
                          .values_list("worker").annotate(n=Count("*"))):
            summary(worker).expired_leases = n

        window = live_window()
        coordinators = [
            CoordinatorRow(c.host, c.pid, [w for w in c.workers.split(",") if w],
                           c.started_at, c.heartbeat_at, c.heartbeat_at >= now - window)
            for c in CoordinatorHeartbeat.objects.using(database)
            .order_by("-heartbeat_at")[:MAX_COORDINATORS_SHOWN]
        ]
        return cls(sorted(summaries.values(), key=lambda s: (not s.registered, s.name)),
                   coordinators, window)

