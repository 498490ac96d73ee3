"""The operator's view of the work: Execution pages, reset, and a dashboard.

State is read-only here. Changes go through ``ExecutionQuerySet`` methods (the same code
the API uses), only as actions or the reset button, only with the change permission.
"""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any, cast

from django.contrib import admin, messages
from django.contrib.admin.utils import display_for_value, quote, unquote
from django.contrib.admin.views.main import ChangeList
from django.core.exceptions import PermissionDenied
from django.db import connections
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.test.utils import CaptureQueriesContext
from django.urls import NoReverseMatch, URLPattern, path, reverse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.text import Truncator

from .. import conf
from ..models import Execution, ExecutionQuerySet
from ..registration.registry import registry
from ..status import ExecutionStatus
from ..store import clock
from ..templatetags.dbworker import STYLESHEET, status_badge
from .dashboard import FINISHED_COUNT_LIMIT, Dashboard, format_age
from .mixins import DBWorkerStatusMixin, transition_action

__all__ = ["DBWorkerStatusMixin", "ExecutionAdmin", "TaskAdmin", "format_age"]

ERROR_SUMMARY_LENGTH = 120


def _database() -> str:
    return conf.value("DATABASE")


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


def rerun_note(obj: Execution) -> str:
    """Why a done row is pending again (rerun_on, rerun_every), in words; "" otherwise."""
    reason = obj.rerun_reason or ""
    if reason.startswith("changed: "):
        return f"re-run because {reason.removeprefix('changed: ')} changed"
    if reason == "stale":
        w = registry.get(obj.worker)
        if w is not None and w.rerun_every is not None and obj.finished_at is not None:
            since = timezone.localtime(obj.finished_at + w.rerun_every)
            return f"stale since {since:%Y-%m-%d %H:%M}"
        return "stale"
    return ""


def short_time(moment: datetime) -> str:
    """The time of day for today's moments, the date for older (or later) ones."""
    local = timezone.localtime(moment)
    return f"{local:%H:%M:%S}" if local.date() == timezone.localdate() else f"{local:%Y-%m-%d}"


@admin.register(Execution)
class ExecutionAdmin(admin.ModelAdmin):
    # Fits a 1300 px screen beside the admin's sidebar and the filters (about 650 px):
    # the claim and its lease in one column, times in short with the full one on hover,
    # the error's first line cut to the column (dbworker.css).
    list_display = ["id", "worker", "source_link", "status_badge", "attempts",
                    "claim", "updated", "error_summary"]
    list_filter = [WorkerFilter, "status"]
    search_fields = ["source_id__exact", "error_type__icontains", "error_message__icontains"]
    search_help_text = "Exact source key, or part of the error type or message."
    # A second COUNT(*) of the whole table on every filtered page is not worth it.
    show_full_result_count = False
    # Facets run a COUNT per filter choice on every page view; the dashboard has the counts.
    show_facets = admin.ShowFacets.NEVER
    actions = ["reset_failed", "run_again"]
    readonly_fields = ["source_link", "status_badge", "traceback", "flow_key"]
    fieldsets = [
        (None, {"fields": ["worker", "source_link", "status_badge", "attempts", "crashes",
                           "next_attempt_at"]}),
        ("Claim", {"fields": ["claimed_by", "lease_expires_at", "flow_key"]}),
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
        why = rerun_note(obj)
        if why:
            return format_html('{}<br><small class="dbworker-rerun">{}</small>',
                               status_badge(obj.status), why)
        return status_badge(obj.status)

    @admin.display(description="claimed by", ordering="claimed_by")
    def claim(self, obj: Execution) -> SafeString | str:
        if not obj.claimed_by:
            return "-"
        if obj.lease_expires_at is None:
            return obj.claimed_by
        return format_html('<span title="lease until {}">{} · {}</span>',
                           display_for_value(obj.lease_expires_at, "-"), obj.claimed_by,
                           short_time(obj.lease_expires_at))

    @admin.display(description="updated", ordering="updated_at")
    def updated(self, obj: Execution) -> SafeString:
        return format_html('<span title="{}">{}</span>', display_for_value(obj.updated_at, "-"),
                           short_time(obj.updated_at))

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
        transition_action(self, request, queryset.count(), queryset, "reset_failed",
                          logged="Reset failed execution.", done="Reset failed executions",
                          why_skipped="not failed")

    @admin.action(description="Run finished executions again", permissions=["change"])
    def run_again(self, request: HttpRequest, queryset: ExecutionQuerySet) -> None:
        transition_action(self, request, queryset.count(), queryset, "run_again",
                          logged="Queued finished execution to run again.",
                          done="Queued finished executions to run again",
                          why_skipped="not finished")

    # -- extra views ---------------------------------------------------------------------
    def get_urls(self) -> list[URLPattern]:
        wrap = self.admin_site.admin_view
        info = f"{self.opts.app_label}_{self.opts.model_name}"
        return [
            path("dashboard/", wrap(self.dashboard_view), name="django_dbworker_dashboard"),
            path("dashboard/pause/<str:worker>/", wrap(self.pause_view),
                 name="django_dbworker_pause"),
            path("why/<str:worker>/<path:source_id>/", wrap(self.why_view),
                 name="django_dbworker_why"),
            path("<path:object_id>/reset/", wrap(self.reset_view), name=f"{info}_reset"),
            *super().get_urls(),
        ]

    def pause_view(self, request: HttpRequest, worker: str) -> HttpResponse:
        """POST pauses or resumes (``action``) a worker; change permission only, and in
        the admin history (the WorkerPause row: added on pause, deleted on resume)."""
        from django.contrib.admin.models import ADDITION, DELETION, LogEntry

        from ..models import WorkerPause
        from ..pauses import pause, resume

        if request.method != "POST" or not self.has_change_permission(request):
            raise PermissionDenied
        if worker not in registry:
            raise PermissionDenied
        back = reverse("admin:django_dbworker_dashboard")
        if request.POST.get("action") == "resume":
            record = WorkerPause.objects.using(_database()).filter(worker=worker).first()
            if resume(worker) and record is not None:
                LogEntry.objects.log_actions(user_id=request.user.pk,  # type: ignore[call-overload]
                                             queryset=[record],
                                             action_flag=DELETION, change_message="Resumed.",
                                             single_object=True)
                self.message_user(request, f"Worker {worker} resumed.", messages.SUCCESS)
            return HttpResponseRedirect(back)
        who = request.user.get_username()
        if pause(worker, by=who, reason=request.POST.get("reason", "")):
            record = WorkerPause.objects.using(_database()).get(worker=worker)
            LogEntry.objects.log_actions(user_id=request.user.pk,  # type: ignore[call-overload]
                                             queryset=[record],
                                         action_flag=ADDITION, change_message="Paused.",
                                         single_object=True)
            self.message_user(request, f"Worker {worker} paused: coordinators claim none of "
                              "its rows (running handlers finish).", messages.SUCCESS)
        else:
            self.message_user(request, f"Worker {worker} was paused already.", messages.WARNING)
        return HttpResponseRedirect(back)

    def why_view(self, request: HttpRequest, worker: str, source_id: str) -> HttpResponse:
        """Why is this row not running? One finding per part that decides it.

        The findings tell whether the source row exists and what is in it (which of the
        worker's eligible() conditions it meets), so besides the view permission on
        executions this page needs what the source model's own admin pages need: its view
        (or change) permission, asked of its ModelAdmin when this site registers one. A
        key that no source row can have is a 404."""
        from django.contrib.auth import get_permission_codename
        from django.http import Http404

        from ..api import source_key
        from .diagnosis import InvalidKey, diagnose, parse_key

        if not self.has_view_permission(request):
            raise PermissionDenied
        if worker not in registry:
            return HttpResponseRedirect(reverse("admin:django_dbworker_dashboard"))
        w = registry[worker]
        opts = w.source._meta
        if self.admin_site.is_registered(w.source):
            may_view = self.admin_site.get_model_admin(w.source).has_view_or_change_permission(
                request)
        else:
            may_view = any(request.user.has_perm(
                f"{opts.app_label}.{get_permission_codename(action, opts)}")
                for action in ("view", "change"))
        if not may_view:
            raise PermissionDenied
        try:
            pk = parse_key(w, unquote(source_id))
        except InvalidKey as e:
            raise Http404(str(e)) from None
        key = source_key(w, pk)
        findings = diagnose(worker, pk)
        execution = Execution.objects.using(_database()).filter(
            worker=worker, source_id=key).first()
        context = {
            **self.admin_site.each_context(request),
            "title": f"Why is {opts.verbose_name} {key} not running ({worker})?",
            "subtitle": None, "opts": self.opts, "app_label": self.opts.app_label,
            "findings": findings, "blocking": [f for f in findings if f.blocking],
            "execution": execution, "media": self.media,
        }
        return TemplateResponse(request, "admin/django_dbworker/why.html", context)

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
        now = clock.now(database)  # (a query once a minute: not the page's to count)
        with CaptureQueriesContext(connections[database]) as queries:
            dashboard = Dashboard.collect(database, now)
        elapsed_ms = (time.perf_counter() - started) * 1000
        context = {
            **self.admin_site.each_context(request),
            "can_pause": self.has_change_permission(request),
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
        # ?fragment: just the figures, which the page fetches again every few seconds.
        template = ("admin/django_dbworker/dashboard_figures.html" if "fragment" in request.GET
                    else "admin/django_dbworker/dashboard.html")
        return TemplateResponse(request, template, context)


from .tasks import TaskAdmin  # noqa: E402  (registers the Task admin)
