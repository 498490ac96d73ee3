"""Tasks in the admin: their arguments, status, result, errors and attempts; retry, run
again and delete. State changes go through the same Execution transitions as everything
else (``admin_mixins.transition_action``)."""

from __future__ import annotations

import json
from typing import Any

from django.contrib import admin
from django.contrib.admin.options import IncorrectLookupParameters
from django.db.models import CharField, F, Func, OuterRef, QuerySet, Subquery, UUIDField, Value
from django.db.models.functions import Concat
from django.http import HttpRequest
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from .. import conf
from ..api import SourceKeyText
from ..models import Execution, Task
from ..status import ExecutionStatus
from ..templatetags.dbworker import STYLESHEET, status_badge
from .mixins import transition_action


def task_executions(tasks: QuerySet[Task]) -> QuerySet[Execution]:
    """The executions of these tasks (one each, on its queue's worker)."""
    from ..api import source_key
    from ..registration.registry import registry

    database = conf.value("DATABASE")
    pairs = tasks.values_list("pk", "backend", "queue_name")
    by_worker: dict[str, list[str]] = {}
    for pk, backend, queue in pairs:
        name = f"tasks.{backend}.{queue}"
        key = source_key(registry[name], pk) if name in registry else str(pk)
        by_worker.setdefault(name, []).append(key)
    executions = Execution.objects.using(database).none()
    for name, keys in by_worker.items():
        executions = executions | Execution.objects.using(database).filter(
            worker=name, source_id__in=keys)
    return executions


class TaskKey(Func):
    """Execution.source_id as a Task primary key (the SQL the claims use), so that the
    Task table's primary-key index serves a filter by the executions' status."""

    output_field = UUIDField()  # Task.id

    def as_sql(self, compiler: Any, connection: Any, function: str | None = None,
               template: str | None = None, arg_joiner: str | None = None,
               **extra_context: Any) -> Any:
        from ..vendors import for_connection

        sql, params = compiler.compile(self.source_expressions[0])
        return for_connection(connection).key_from_text_sql(Task._meta.pk, sql), params


class TaskStatusFilter(admin.SimpleListFilter):
    """The status of each task's Execution: read from the executions of that status (the
    (worker, status) index), not from every task's."""

    title = "status"
    parameter_name = "status"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(s.value, s.name.title()) for s in ExecutionStatus]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Task]) -> QuerySet[Task]:
        from ..tasks.queues import queue_workers

        value = self.value()
        if value is None:
            return queryset
        if value not in ExecutionStatus:
            raise IncorrectLookupParameters(f"{value!r} is not an execution status")
        keys = (Execution.objects.using(conf.value("DATABASE"))
                .filter(worker__in=[w.name for w in queue_workers()], status=value)
                .values(key=TaskKey(F("source_id"))))
        return queryset.filter(pk__in=keys)


@admin.register(Task)
class TaskAdmin(admin.ModelAdmin):
    list_display = ["short_id", "task_path", "queue_name", "status_badge", "priority",
                    "enqueued_at", "run_after", "attempts", "finished_at"]
    list_filter = [TaskStatusFilter, "queue_name", "backend"]
    search_fields = ["id__exact", "task_path__icontains"]
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER
    actions = ["retry_failed", "run_again", "delete_selected"]
    fields = ("id", "task_path", "backend", "queue_name", "status_badge", "priority",
              "run_after", "flow_key", "unique_key", "arguments", "result", "error_list", "worker_ids",
              "enqueued_at", "started_at", "last_attempted_at", "finished_at")
    readonly_fields = fields

    class Media:
        css = {"all": [STYLESHEET]}

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # tasks are enqueued by code

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return obj is None and super().has_change_permission(request)  # actions only

    def get_queryset(self, request: HttpRequest) -> QuerySet[Task]:
        execution = Execution.objects.filter(
            worker=Concat(Value("tasks."), OuterRef("backend"), Value("."), OuterRef("queue_name"),
                          output_field=CharField()),
            source_id=SourceKeyText(OuterRef("pk")))
        return (super().get_queryset(request).using(conf.value("DATABASE"))
                .annotate(execution_status=Subquery(execution.values("status")[:1]),
                          execution_attempts=Subquery(execution.values("attempts")[:1]))
                .defer("errors", "return_value"))

    @admin.display(description="id")
    def short_id(self, obj: Task) -> str:
        return str(obj.pk)[:8]

    @admin.display(description="status", ordering="execution_status")
    def status_badge(self, obj: Task) -> SafeString:
        return status_badge(getattr(obj, "execution_status", None))

    @admin.display(description="attempts")
    def attempts(self, obj: Task) -> int:
        return getattr(obj, "execution_attempts", None) or 0

    @admin.display(description="unique key")
    def unique_key(self, obj: Task) -> str:
        """The @unique key this task holds (empty: none, or it passed to a later task)."""
        from ..models import TaskUniqueKey

        key = (TaskUniqueKey.objects.using(conf.value("DATABASE")).filter(task_id=obj.pk)
               .values_list("key", flat=True).first())
        return key or ""

    @admin.display(description="arguments")
    def arguments(self, obj: Task) -> SafeString:
        return format_html('<pre class="dbworker-traceback">{}</pre>',
                           json.dumps({"args": obj.args, "kwargs": obj.kwargs}, indent=2))

    @admin.display(description="return value")
    def result(self, obj: Task) -> SafeString | str:
        if obj.finished_at is None or obj.return_value is None:
            return ""
        return format_html('<pre class="dbworker-traceback">{}</pre>',
                           json.dumps(obj.return_value, indent=2))

    @admin.display(description="errors")
    def error_list(self, obj: Task) -> SafeString | str:
        from ..tasks.results import errors_of

        execution = task_executions(Task.objects.filter(pk=obj.pk)).first()
        errors = errors_of(obj, execution)
        if not errors:
            return ""
        return format_html_join(
            "", '<p>Attempt {}: <code>{}</code></p><pre class="dbworker-traceback">{}</pre>',
            ((e.get("attempt", "?"), e["exception_class_path"], e.get("traceback", ""))
             for e in errors))

    @admin.action(description="Retry failed tasks", permissions=["change"])
    def retry_failed(self, request: HttpRequest, queryset: QuerySet[Task]) -> None:
        transition_action(self, request, queryset.count(), task_executions(queryset),
                          "reset_failed", logged="Retried failed task.",
                          done="Retried failed tasks", why_skipped="not failed")

    @admin.action(description="Run finished tasks again", permissions=["change"])
    def run_again(self, request: HttpRequest, queryset: QuerySet[Task]) -> None:
        transition_action(self, request, queryset.count(), task_executions(queryset),
                          "run_again", logged="Queued finished task to run again.",
                          done="Queued finished tasks to run again", why_skipped="not finished")
