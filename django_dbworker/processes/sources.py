"""Loading the source rows handlers get: a group's with one query, a lone row's by key.

For a lone row, ``Model._default_manager.get(pk=...)`` builds and compiles the same SELECT
each time. In the pickup of one row into an idle PostgreSQL worker that took longer than the
database's answer (0.6 of 1.1 ms on our 2-core VM: an idle machine's CPU caches are cold).
So when the default manager's queryset is plain, its SELECT is compiled once per model and
database and run as a raw queryset, which builds the instance with the same converters and
``from_db()``. Anything else (a filter, an annotation, select_related, prefetching,
extra(), defer()/only(), distinct, an overridden ``get()`` or fetching method, a custom
iterable or fetch mode) is asked with ``.get(pk=...)`` each time, as before: its SQL may
change from one call to the next (a filter on the current time, say).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.db import connections
from django.db.models import QuerySet
from django.db.models.query import ModelIterable

from .protocol import Delivery

_UNSEEN = object()
# The QuerySet methods between get(pk=...) and its rows: a subclass that overrides one
# (a soft-delete scope applied in _fetch_all, say) is asked with .get() each time.
FETCHING = ("get", "filter", "_filter_or_exclude", "_filter_or_exclude_inplace", "_chain",
            "_clone", "_fetch_all", "iterator", "_iterator", "__iter__", "__len__", "all",
            "using", "order_by")
_compiled: dict[tuple[type, str], str | None] = {}  # (model, alias) -> SQL with one %s


def load_many(model: type, pk_field: Any, alias: str, rows: Sequence[Delivery]) -> dict[int, Any]:
    """The source row of each delivery of a group, with one query, by delivery seq;
    missing ones (deleted) are left out."""
    keys = {r.seq: pk_field.to_python(r.source_id) for r in rows}
    found = model._default_manager.using(alias).in_bulk(set(keys.values()))  # type: ignore[attr-defined]
    return {seq: found[key] for seq, key in keys.items() if key in found}


def load(model: type, alias: str, pk: Any) -> Any:
    """``model``'s row with primary key ``pk`` on ``alias``, as its default manager's
    ``.get(pk=pk)`` returns it (``model.DoesNotExist`` if there is none)."""
    manager = model._default_manager  # type: ignore[attr-defined]
    sql = _compiled.get((model, alias), _UNSEEN)
    if sql is _UNSEEN:
        sql = _compiled[model, alias] = compile_get(manager.using(alias), alias, pk)
    if sql is None:
        return manager.using(alias).get(pk=pk)
    found = list(manager.raw(sql, [_db_value(model, alias, pk)]).using(alias))
    if not found:
        raise model.DoesNotExist(  # type: ignore[attr-defined]
            f"{model._meta.object_name} matching query does not exist.")  # type: ignore[attr-defined]
    return found[0]


def compile_get(queryset: QuerySet[Any], alias: str, pk: Any) -> str | None:
    """The SQL of ``queryset.get(pk=...)``, its one parameter the key, if ``queryset``
    is plain (see the module's docstring); else None."""
    query = queryset.query
    plain = (
        # (a QuerySet subclass may add methods, but not change how rows are fetched)
        all(getattr(type(queryset), name, None) is getattr(QuerySet, name, None)
            for name in FETCHING)
        and queryset._iterable_class is ModelIterable
        and not getattr(queryset, "_prefetch_related_lookups", ())
        and getattr(queryset, "_fetch_mode", None) == getattr(QuerySet(queryset.model), "_fetch_mode", None)
        and not query.where and not query.annotations and not query.extra
        and query.select_related is False and not query.distinct
        and query.deferred_loading == (frozenset(), True) and query.combinator is None
        and not query.low_mark and query.high_mark is None
    )
    if not plain:
        return None
    sql, params = queryset.filter(pk=pk).order_by().query.get_compiler(using=alias).as_sql()
    if list(params) != [_db_value(queryset.model, alias, pk)]:
        return None  # (a key of several columns, say)
    return str(sql)


def _db_value(model: type, alias: str, pk: Any) -> Any:
    """``pk`` as the ORM passes it to the database in ``filter(pk=pk)``."""
    field = model._meta.pk  # type: ignore[attr-defined]
    return field.get_db_prep_value(field.get_prep_value(pk), connections[alias], prepared=True)
