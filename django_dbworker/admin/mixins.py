"""``DBWorkerStatusMixin``: execution status, a filter and a reset action in your own admin.

    @admin.register(Document)
    class DocumentAdmin(DBWorkerStatusMixin, admin.ModelAdmin):
        dbworker_workers = ["ocr"]

adds an "ocr status" column (read from ``annotate_execution_status``: no query per row), an
"ocr status" list filter and a "Reset failed ocr work" action on the selected objects.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cache
from typing import TYPE_CHECKING, Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.options import IncorrectLookupParameters
from django.contrib.admin.utils import quote
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils.html import format_html
from django.utils.safestring import SafeString

from .. import conf
from ..api import annotate_execution_status, has_execution_status, source_key
from ..models import Execution
from ..registration.registry import registry
from ..status import ExecutionStatus
from ..templatetags.dbworker import STYLESHEET, status_badge, status_of

if TYPE_CHECKING:
    _Base = admin.ModelAdmin
else:
    _Base = object

RESET_PERMISSION = "django_dbworker.change_execution"
# Keys per UPDATE: below SQLite's and Oracle-era parameter limits, big enough to be quick.
BATCH = 500
NO_RECORD = "none"


def report_counts(modeladmin: admin.ModelAdmin, request: HttpRequest, *, changed: int,
                  skipped: int, done: str, why_skipped: str) -> None:
    """The message every state-changing action ends with: how many changed, how many not."""
    text = f"{done}: {changed} changed"
    if skipped:
        text += f", {skipped} skipped ({why_skipped})"
    modeladmin.message_user(request, text + ".", messages.SUCCESS if changed else messages.WARNING)


def transition_action(modeladmin: admin.ModelAdmin, request: HttpRequest, selected: int,
                      executions: QuerySet[Execution], transition: str, *, logged: str,
                      done: str, why_skipped: str) -> None:
    """The body of an admin action that applies ``transition``: change, log, report."""
    changed = len(change_and_log(request, executions, transition, logged))
    report_counts(modeladmin, request, changed=changed, skipped=selected - changed, done=done,
                  why_skipped=why_skipped)


# The transitions a person makes from the admin: (ExecutionQuerySet method, the status it
# applies to).
TRANSITIONS = {"reset_failed": ExecutionStatus.FAILED, "run_again": ExecutionStatus.FINISHED}


def change_and_log(request: HttpRequest, executions: QuerySet[Execution], transition: str,
                   message: str) -> list[Execution]:
    """Apply ``transition`` to the executions it fits, in batches, each row locked first
    so that exactly the rows changed are the ones logged; returns them. The admin history
    (LogEntry) of each changed execution records who did it."""
    from django.contrib.admin.models import CHANGE, LogEntry
    from django.db import transaction

    database = conf.value("DATABASE")
    changed: list[Execution] = []
    ids = list(executions.filter(status=TRANSITIONS[transition]).order_by()
               .values_list("pk", flat=True))
    for i in range(0, len(ids), BATCH):
        with transaction.atomic(using=database):
            batch = Execution.objects.using(database).filter(
                pk__in=ids[i:i + BATCH], status=TRANSITIONS[transition])
            rows = list(batch.select_for_update().only("pk", "worker", "source_id", "status"))
            getattr(Execution.objects.using(database).filter(pk__in=[r.pk for r in rows]),
                    transition)()
            changed.extend(rows)
    if changed:
        LogEntry.objects.log_actions(
            user_id=_user_id(request),
            queryset=Execution.objects.using(database).filter(pk__in=[r.pk for r in changed]),
            action_flag=CHANGE, change_message=message)
    return changed


def _user_id(request: HttpRequest) -> Any:
    return request.user.pk  # admin actions run for a logged-in staff user


@cache  # one function per worker: the admin compares list_display entries between calls
def status_column(worker: str, site: str = "admin") -> Callable[[Any], SafeString]:
    """The status badge of ``worker`` for each row, linked to its "why not running?" page
    (one function per worker and admin site, so that the column stays sortable)."""
    attr = f"{worker}_execution_status"

    @admin.display(description=f"{worker} status", ordering=attr)
    def column(obj: Any) -> SafeString:
        from django.urls import NoReverseMatch, reverse

        badge = status_badge(status_of(obj, worker))
        try:
            url = reverse(f"{site}:django_dbworker_why",
                          args=[worker, quote(source_key(registry[worker], obj.pk))])
        except NoReverseMatch:  # Execution is not in this admin site
            return badge
        return format_html('<a href="{}" title="Why is it (not) running?">{}</a>', url, badge)

    column.__name__ = f"dbworker_{worker}_status"
    return column


@cache  # one class per worker: the changelist compares filter classes between requests
def status_filter(worker: str) -> type[admin.SimpleListFilter]:
    class StatusFilter(admin.SimpleListFilter):
        title = f"{worker} status"
        parameter_name = f"{worker}_status"

        def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
            return [(s.value, s.name.title()) for s in ExecutionStatus] + [(NO_RECORD, "No record")]

        def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
            value = self.value()
            if value is None:
                return queryset
            if value == NO_RECORD:
                return queryset.exclude(has_execution_status(worker, list(ExecutionStatus)))
            if value not in ExecutionStatus:
                raise IncorrectLookupParameters(f"{value!r} is not an execution status")
            return queryset.filter(has_execution_status(worker, value))

    StatusFilter.__name__ = f"{worker.title().replace('_', '')}StatusFilter"
    return StatusFilter


def reset_action(worker: str) -> Callable[[Any, HttpRequest, QuerySet[Any]], None]:
    def action(modeladmin: admin.ModelAdmin, request: HttpRequest,
               queryset: QuerySet[Any]) -> None:
        from django.contrib.admin.models import CHANGE, LogEntry

        w = registry[worker]
        # Keys are read first rather than joined in SQL: the selection may itself filter
        # on Execution, and MySQL refuses an UPDATE whose subquery reads the same table.
        pks = {source_key(w, pk): pk for pk in queryset.values_list("pk", flat=True)}
        executions = Execution.objects.using(conf.value("DATABASE")).for_worker(w.name)
        changed = []
        keys = list(pks)
        for i in range(0, len(keys), BATCH):
            changed += change_and_log(request, executions.filter(source_id__in=keys[i:i + BATCH]),
                                      "reset_failed", f"Reset failed {worker} work.")
        if changed:  # and in the history of the objects the person selected
            LogEntry.objects.log_actions(
                user_id=_user_id(request),
                queryset=queryset.model._default_manager.filter(
                    pk__in=[pks[e.source_id] for e in changed]),
                action_flag=CHANGE, change_message=f"Reset failed {worker} work.")
        report_counts(modeladmin, request, changed=len(changed),
                      skipped=len(keys) - len(changed), done=f"Reset failed {worker} work",
                      why_skipped=f"their {worker} work had not failed")

    action.__name__ = f"reset_failed_{worker}"
    return admin.action(permissions=["dbworker_reset"],
                        description=f"Reset failed {worker} work of selected "
                                    "%(verbose_name_plural)s")(action)


class DBWorkerStatusMixin(_Base):
    """Mix into a ``ModelAdmin`` whose model is the source of the named workers."""

    dbworker_workers: Sequence[str] = ()

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        return annotate_execution_status(super().get_queryset(request), *self.dbworker_workers)

    def get_list_display(self, request: HttpRequest) -> list[Any]:
        columns = [status_column(w, self.admin_site.name) for w in self.dbworker_workers]
        return [*super().get_list_display(request), *columns]

    def get_list_filter(self, request: HttpRequest) -> list[Any]:
        return [*super().get_list_filter(request), *map(status_filter, self.dbworker_workers)]

    def has_dbworker_reset_permission(self, request: HttpRequest) -> bool:
        # Resetting changes Execution rows, not the source objects: the same permission as
        # the Execution admin's own "Reset failed" action.
        return request.user.has_perm(RESET_PERMISSION)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Added as ordinary actions (not via get_actions) so that the admin's own permission
        # filtering and action lookup work unchanged on every supported Django version.
        if self.actions is not None:
            self.actions = [*self.actions, *map(reset_action, self.dbworker_workers)]

    @property
    def media(self) -> forms.Media:
        return super().media + forms.Media(css={"all": [STYLESHEET]})
