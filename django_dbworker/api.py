"""Reading and repairing work state from Django code: views, templates, the admin."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from django.db import connections, models
from django.db.models import CharField, Exists, Func, OuterRef, Subquery
from django.db.models.expressions import Combinable

from . import conf
from .models import Execution, ExecutionQuerySet
from .registration.registry import Worker, registry
from .status import ExecutionStatus
from .vendors import for_connection

if TYPE_CHECKING:  # _AsSqlType exists in django-stubs only
    from django.db.backends.base.base import BaseDatabaseWrapper
    from django.db.models.sql.compiler import SQLCompiler, _AsSqlType


class SourceKeyText(Func):
    """A source key as the text Execution.source_id holds: the same SQL the triggers use."""

    output_field = CharField()

    def as_sql(self, compiler: SQLCompiler, connection: BaseDatabaseWrapper,
               function: str | None = None, template: str | None = None,
               arg_joiner: str | None = None, **extra_context: Any) -> _AsSqlType:
        sql, params = compiler.compile(self.source_expressions[0])
        return for_connection(connection).text_key_sql(sql), params


def _database() -> str:
    return conf.value("DATABASE")


def source_key(w: Worker, source: Any) -> str:
    """The text an Execution stores for ``source`` (an instance or a primary key): the
    database's own text form of the key, the same the triggers write."""
    if isinstance(source, models.Model):
        if source._meta.concrete_model is not w.source._meta.concrete_model:
            raise TypeError(
                f"Worker {w.name!r} works on {w.source.__name__}, not "
                f"{type(source).__name__}: pass a {w.source.__name__} or its primary key."
            )
        source = source.pk
    field = w.pk_field
    value = field.get_db_prep_value(field.to_python(source), connections[_database()],
                                    prepared=False)
    return str(value)


def _executions(worker: str, source: Any) -> ExecutionQuerySet:
    w = registry[worker]
    return Execution.objects.using(_database()).filter(worker=w.name,
                                                       source_id=source_key(w, source))


def execution_status(worker: str, source: Any) -> ExecutionStatus | None:
    """The status of ``source`` (instance or pk) for ``worker``; None without a record.

    A stored value that is no status (written by hand, or by a newer version) raises
    ValueError: None would read as "no record", and a guess as a state the row is not in.
    ``{% dbworker_status %}`` shows such a value as "Unknown (value)" instead."""
    status = _executions(worker, source).values_list("status", flat=True).first()
    if status is None:
        return None
    try:
        return ExecutionStatus(status)
    except ValueError:
        raise ValueError(
            f"The execution of {source!r} for worker {worker!r} has status {status!r}, which "
            "this version of django-dbworker does not know (written by hand, or by a newer "
            "version)."
        ) from None


def _status_values(statuses: Any) -> list[str]:
    if isinstance(statuses, str):
        statuses = [statuses]
    values = []
    for s in statuses:
        try:
            values.append(ExecutionStatus(s).value)
        except ValueError:
            raise ValueError(
                f"{s!r} is not an execution status; use one of "
                f"{', '.join(x.value for x in ExecutionStatus)} (or ExecutionStatus members)."
            ) from None
    return values


def _key_expression(w: Worker, source: Any) -> Any:
    if isinstance(source, Combinable | OuterRef):
        # The cast sits on the source side; the (worker, source_id) unique index serves
        # the lookup of each outer row.
        return SourceKeyText(source)
    return source_key(w, source)


def has_execution_status(worker: str, statuses: ExecutionStatus | str | Iterable[Any],
                         source: Any = None) -> Exists:
    """An ``Exists`` expression, true where the row's execution has one of ``statuses``.

    Use in ``.filter()``, ``.exclude()``, ``Q`` or annotations, including inside another
    worker's ``eligible`` (a dependent worker). Builds SQL only; runs no query.
    """
    w = registry[worker]
    key = _key_expression(w, OuterRef("pk") if source is None else source)
    return Exists(
        Execution.objects.filter(worker=w.name, source_id=key,
                                 status__in=_status_values(statuses))
    )


def annotate_execution_status(queryset: models.QuerySet[Any], *workers: str) -> models.QuerySet[Any]:
    """Add ``<worker>_execution_status`` to each object, in the same query."""
    annotations = {}
    for name in workers:
        w = registry[name]
        annotations[f"{w.name}_execution_status"] = Subquery(
            Execution.objects.filter(worker=w.name, source_id=_key_expression(w, OuterRef("pk")))
            .values("status")[:1]
        )
    return queryset.annotate(**annotations)


STATE_FIELDS = ("worker", "source_id", "attempts", "claimed_by", "lease_expires_at",
                "next_attempt_at", "created_at", "started_at", "finished_at", "updated_at")


def state(worker: str, source: Any) -> Mapping[str, Any] | None:
    """A read-only snapshot of the execution record, or None when there is none."""
    execution = _executions(worker, source).first()
    if execution is None:
        return None
    data = {name: getattr(execution, name) for name in STATE_FIELDS}
    data["execution_status"] = execution.execution_status
    data["error"] = MappingProxyType(execution.error) if execution.error else None
    return MappingProxyType(data)


def reset_failed(worker: str, source: Any) -> bool:
    """FAILED -> UNFINISHED, claimable again; True if something was reset."""
    return _executions(worker, source).reset_failed() > 0
