"""The private (undocumented, underscored or internal) APIs of Django, SQLAlchemy and
CPython that django-dbworker relies on, one small test each.

An upgrade may change any of them without a deprecation period. When it does, the test
of that API fails and its message names the API and the module of ours that relies on
it, instead of a claim, a lone row's load or an admin page failing somewhere far from
the cause. Each test checks that the API is there and still means what we read it as:
a shape alone (``hasattr``) would pass while the meaning drifted.

Tests that need no database run without one; the vendor attributes are checked on their
own database only (DBWORKER_TEST_DB).
"""

from __future__ import annotations

import inspect
import sqlite3
import sys
import threading
import uuid

import pytest
import sqlalchemy as sa
from django.contrib.admin import ModelAdmin
from django.contrib.admin.views.main import ChangeList
from django.db import DatabaseError, connection, connections, transaction
from django.db.models import Count, Exists, F, Func, OrderBy, QuerySet
from django.db.models.functions import Lower
from django.db.models.query import ModelIterable
from django.db.models.sql.where import AND, WhereNode
from django.urls import reverse
from sqlalchemy.dialects.postgresql import psycopg as pg_psycopg
from sqlalchemy.dialects.sqlite import pysqlite

from django_dbworker.api import has_execution_status
from django_dbworker.models import Execution
from django_dbworker.processes import sources
from django_dbworker.status import ExecutionStatus
from django_dbworker.store import engine as engines
from django_dbworker.store.claims import TOKEN, ordering_terms
from django_dbworker.store.tables import execution_table
from django_dbworker.vendors import claiming
from tests.testapp.models import Author, Document, Tag, UuidItem


# -- django_dbworker/processes/sources.py (compile_get, FETCHING) ---------------------------
def test_queryset_iterable_class_says_model_instances():
    """compile_get() takes a queryset as plain only while ``_iterable_class`` is
    ModelIterable: values()/values_list() querysets yield no model instances."""
    qs = Document.objects.all()
    assert hasattr(qs, "_iterable_class"), (
        "Django's private QuerySet._iterable_class is gone: "
        "django_dbworker/processes/sources.py (compile_get) relies on it")
    assert qs._iterable_class is ModelIterable, (
        "Django's private QuerySet._iterable_class of a plain queryset is no longer "
        "django.db.models.query.ModelIterable: django_dbworker/processes/sources.py "
        "(compile_get) compares the two")
    for other in (Document.objects.values(), Document.objects.values_list("pk"),
                  Document.objects.values_list("pk", flat=True)):
        assert other._iterable_class is not ModelIterable, (
            "Django's private QuerySet._iterable_class no longer tells values() from model "
            "instances: django_dbworker/processes/sources.py (compile_get) relies on it")


def test_queryset_prefetch_related_lookups_lists_prefetching():
    """compile_get() reads ``_prefetch_related_lookups`` with a default of (): renamed,
    a prefetching queryset would silently pass as plain and lose its prefetch."""
    plain = Document.objects.all()
    assert hasattr(plain, "_prefetch_related_lookups"), (
        "Django's private QuerySet._prefetch_related_lookups is gone: "
        "django_dbworker/processes/sources.py (compile_get) reads it with a default, so a "
        "prefetching default manager would now be taken as plain")
    assert not plain._prefetch_related_lookups
    assert "author" in Document.objects.prefetch_related("author")._prefetch_related_lookups, (
        "Django's private QuerySet._prefetch_related_lookups no longer lists prefetch_related(): "
        "django_dbworker/processes/sources.py (compile_get) relies on it")


def test_queryset_fetch_mode_differs_only_when_fetch_mode_was_changed():
    """compile_get() compares ``getattr(qs, "_fetch_mode", None)`` with a fresh
    QuerySet's: equal must mean "the default fetch mode". Before Django 6.1 there are no
    fetch modes and both sides are None; from 6.1 the private attribute must exist,
    or a default manager with another fetch mode would pass as plain."""
    fresh = QuerySet(Document)
    if not hasattr(QuerySet, "fetch_mode"):  # no fetch modes in this Django
        assert not hasattr(fresh, "_fetch_mode"), (
            "Django has a private QuerySet._fetch_mode but no QuerySet.fetch_mode(): "
            "django_dbworker/processes/sources.py (compile_get) assumes both or neither")
        return
    from django.db.models import FETCH_PEERS

    plain = Document.objects.all()
    assert hasattr(plain, "_fetch_mode"), (
        "Django's private QuerySet._fetch_mode is gone (QuerySet.fetch_mode() is still "
        "there): django_dbworker/processes/sources.py (compile_get) reads it with a default, "
        "so a queryset with another fetch mode would now be taken as plain")
    assert plain._fetch_mode == fresh._fetch_mode, (
        "Django's private QuerySet._fetch_mode of the default manager's queryset differs from "
        "a fresh QuerySet's: django_dbworker/processes/sources.py (compile_get) takes that as "
        "not plain")
    changed = Document.objects.fetch_mode(FETCH_PEERS)
    assert changed._fetch_mode != fresh._fetch_mode, (
        "Django's private QuerySet._fetch_mode no longer records fetch_mode(): "
        "django_dbworker/processes/sources.py (compile_get) relies on it")


@pytest.mark.parametrize("name", sources.FETCHING)
def test_fetching_method_exists_on_queryset(name):
    """compile_get() compares each method of FETCHING on the queryset's class with
    QuerySet's own; a name QuerySet no longer has compares None with None, and a
    subclass overriding it would pass unnoticed."""
    assert callable(getattr(QuerySet, name, None)), (
        f"Django's QuerySet.{name} is gone: it is in FETCHING of "
        f"django_dbworker/processes/sources.py (compile_get), which no longer notices a "
        f"subclass that changes how rows are fetched")


def recording_queryset(calls: list[str]) -> type[QuerySet]:
    """A QuerySet subclass whose every method (of QuerySet's own) records its name."""
    ignored = {"__init__", "__repr__", "__getstate__", "__setstate__", "__deepcopy__"}
    namespace = {}
    for klass in reversed(QuerySet.__mro__):
        for name, value in vars(klass).items():
            if inspect.isfunction(value) and name not in ignored:
                def recorded(self, *args, _name=name, _method=value, **kwargs):
                    calls.append(_name)
                    return _method(self, *args, **kwargs)
                namespace[name] = recorded
    return type("RecordingQuerySet", (QuerySet,), namespace)


def test_fetching_lists_every_method_between_get_and_its_rows(db):
    """FETCHING must name every QuerySet method that ``get(pk=...)`` and iteration go
    through: a subclass may override any of them (a soft-delete scope in _fetch_all,
    say). A method Django adds to that path is one compile_get() does not check."""
    doc = Document.objects.create()
    calls: list[str] = []
    recording = recording_queryset(calls)
    assert recording(Document).get(pk=doc.pk).pk == doc.pk
    list(recording(Document).iterator())
    list(recording(Document).using("default").order_by().all())
    # (it only refuses a union(): it fetches no rows, so overriding it changes none)
    harmless = {"_not_support_combined_queries"}
    unchecked = set(calls) - set(sources.FETCHING) - harmless
    assert not unchecked, (
        f"Django's QuerySet.get()/iteration now goes through {sorted(unchecked)}, not in "
        f"FETCHING of django_dbworker/processes/sources.py (compile_get): a subclass "
        f"overriding them would be compiled as plain")
    unused = set(sources.FETCHING) - set(calls)
    assert not unused, (
        f"Django's QuerySet.get()/iteration no longer goes through {sorted(unused)}: "
        f"FETCHING of django_dbworker/processes/sources.py (compile_get) names private "
        f"methods Django no longer uses to fetch rows")


# (attribute, compile_get()'s test of a plain query, querysets it must find not plain)
QUERY_ATTRIBUTES = [
    ("where", lambda q: not q.where, {
        "filter()": lambda: Document.objects.filter(uploaded=True),
        "alias().filter()": lambda: Document.objects.alias(t=F("title")).filter(t="x")}),
    ("annotations", lambda q: not q.annotations, {
        "annotate()": lambda: Document.objects.annotate(n=Count("id")),
        "alias()": lambda: Document.objects.alias(t=F("title"))}),
    ("extra", lambda q: not q.extra, {"extra()": lambda: Document.objects.extra(select={"one": "1"})}),
    ("select_related", lambda q: q.select_related is False, {
        "select_related('author')": lambda: Document.objects.select_related("author")}),
    ("distinct", lambda q: not q.distinct, {"distinct()": lambda: Document.objects.distinct()}),
    ("deferred_loading", lambda q: q.deferred_loading == (frozenset(), True), {
        "defer()": lambda: Document.objects.defer("text"),
        "only()": lambda: Document.objects.only("title")}),
    ("combinator", lambda q: q.combinator is None, {
        "union()": lambda: Document.objects.union(Document.objects.all())}),
    ("low_mark", lambda q: not q.low_mark, {"[2:]": lambda: Document.objects.all()[2:]}),
    ("high_mark", lambda q: q.high_mark is None, {"[:5]": lambda: Document.objects.all()[:5]}),
    # registration/registry.py (Worker.eligible_queryset) refuses a sliced eligible().
    ("is_sliced", lambda q: not q.is_sliced, {
        "[:5]": lambda: Document.objects.all()[:5],
        "[2:]": lambda: Document.objects.all()[2:]}),
]


@pytest.mark.parametrize("attribute, plain, changed", QUERY_ATTRIBUTES,
                         ids=[a for a, _, _ in QUERY_ATTRIBUTES])
def test_query_attribute_tells_a_plain_query(attribute, plain, changed):
    """compile_get() reads these private attributes of Django's Query to decide that the
    default manager's SELECT cannot change from one call to the next."""
    user = ("django_dbworker/registration/registry.py (Worker.eligible_queryset)"
            if attribute == "is_sliced" else "django_dbworker/processes/sources.py (compile_get)")
    query = Document.objects.all().query
    assert hasattr(query, attribute), f"Django's private Query.{attribute} is gone: {user} relies on it"
    assert plain(query), (
        f"Django's private Query.{attribute} of a plain queryset is now {getattr(query, attribute)!r}: "
        f"{user} takes it as not plain")
    for label, make in changed.items():
        query = make().query
        assert not plain(query), (
            f"Django's private Query.{attribute} is {getattr(query, attribute)!r} after {label}: "
            f"{user} no longer tells that query from a plain one")


@pytest.mark.parametrize("model, key", [(Document, 7), (UuidItem, uuid.uuid4()), (Tag, "a-tag")],
                         ids=["integer", "uuid", "text"])
def test_query_compiler_as_sql_gives_the_key_as_its_one_parameter(db, model, key):
    """compile_get() compiles ``filter(pk=...).order_by()`` once with
    ``query.get_compiler(using=...).as_sql()`` and runs it as a raw query: the SQL must
    come with ``%s`` placeholders and the key, prepared for the database, as the only
    parameter."""
    row = model._default_manager.create(pk=key)
    qs = model._default_manager.filter(pk=row.pk).order_by()
    compiled = qs.query.get_compiler(using="default").as_sql()
    assert isinstance(compiled, tuple) and len(compiled) == 2, (
        "Django's SQLCompiler.as_sql() no longer returns (sql, params): "
        "django_dbworker/processes/sources.py (compile_get) relies on it")
    sql, params = compiled
    assert isinstance(sql, str) and sql.count("%s") == 1, (
        f"Django's SQLCompiler.as_sql() gives {sql!r} for filter(pk=...): "
        f"django_dbworker/processes/sources.py (compile_get) expects one %s placeholder")
    assert list(params) == [sources._db_value(model, "default", row.pk)], (
        f"Django's SQLCompiler.as_sql() gives parameters {params!r} for filter(pk=...): "
        f"django_dbworker/processes/sources.py (compile_get) expects the prepared key alone")
    assert [r.pk for r in model._default_manager.raw(sql, params)] == [row.pk], (
        "Django's SQLCompiler.as_sql() SQL no longer runs as a raw query: "
        "django_dbworker/processes/sources.py (load) runs it so")


# -- django_dbworker/store/claims.py (Claims.eligible_sql, ordering_terms) ----------------
def test_query_order_by_keeps_the_items_as_given():
    """ordering_terms() reads ``qs.query.order_by``: field names as the strings given
    ("-" for descending), OrderBy expressions with ``expression``, ``descending``,
    ``nulls_first`` and ``nulls_last``, any other expression as it is."""
    qs = Document.objects.order_by("-priority", F("steps").desc(nulls_last=True),
                                   F("title").asc(nulls_first=True), Lower("title"), "id")
    items = qs.query.order_by
    assert isinstance(items, tuple | list) and len(items) == 5, (
        f"Django's private Query.order_by is now {items!r}: django_dbworker/store/claims.py "
        f"(ordering_terms) relies on it holding the order_by() items")
    assert items[0] == "-priority" and items[4] == "id", (
        f"Django's private Query.order_by no longer keeps field names as given ({items!r}): "
        f"django_dbworker/store/claims.py (ordering_terms) relies on it")
    desc, asc = items[1], items[2]
    assert isinstance(desc, OrderBy) and isinstance(asc, OrderBy), (
        f"Django's Query.order_by no longer holds F().desc()/asc() as OrderBy ({items!r}): "
        f"django_dbworker/store/claims.py (ordering_terms) relies on it")
    for attribute in ("expression", "descending", "nulls_first", "nulls_last"):
        assert hasattr(desc, attribute), (
            f"Django's OrderBy.{attribute} is gone: django_dbworker/store/claims.py "
            f"(ordering_terms) reads it")
    assert (desc.expression, desc.descending, bool(desc.nulls_first), bool(desc.nulls_last)) == (
        F("steps"), True, False, True), (
        "Django's OrderBy attributes no longer describe F('steps').desc(nulls_last=True): "
        "django_dbworker/store/claims.py (ordering_terms) relies on them")
    assert (asc.expression, asc.descending, bool(asc.nulls_first), bool(asc.nulls_last)) == (
        F("title"), False, True, False), (
        "Django's OrderBy attributes no longer describe F('title').asc(nulls_first=True): "
        "django_dbworker/store/claims.py (ordering_terms) relies on them")
    assert isinstance(items[3], Lower), (
        f"Django's Query.order_by no longer keeps an expression as given ({items[3]!r}): "
        f"django_dbworker/store/claims.py (ordering_terms) relies on it")
    assert Document.objects.order_by("?").query.order_by == ("?",), (
        "Django's Query.order_by no longer holds a random order as '?': "
        "django_dbworker/store/claims.py (ordering_terms) refuses it by that")


def eligible_compiled(qs: QuerySet) -> tuple[str, tuple, list, QuerySet]:
    """What Claims.eligible_sql() does with a worker's eligible() queryset."""
    annotations, terms = ordering_terms(qs.query.order_by)
    values = qs.order_by().values(dbw_pk=F("pk"), **annotations)
    sql, params = values.query.get_compiler(using="default").as_sql()
    return sql, tuple(params), terms, values


def test_values_compiler_selects_the_named_columns(db):
    """Claims.eligible_sql() compiles ``values(dbw_pk=F("pk"), dbw_o0=..., ...)`` with
    ``values.query.get_compiler(using=alias).as_sql()``; the claim reads the result's
    columns by those names, from a subquery."""
    author = Author.objects.create(name="a", rank=2)
    doc = Document.objects.create(title="B", priority=4, author=author)
    qs = Document.objects.filter(pk=doc.pk).order_by("-priority", "-author__rank", Lower("title"))
    sql, params, terms, values = eligible_compiled(qs)
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        names = [column[0] for column in cursor.description]
        rows = [tuple(r) for r in cursor.fetchall()]
    assert names == ["dbw_pk", *[t.alias for t in terms]] == ["dbw_pk", "dbw_o0", "dbw_o1", "dbw_o2"], (
        f"Django's SQLCompiler.as_sql() for values(**expressions) now selects {names}: "
        f"django_dbworker/store/claims.py (Claims.eligible_sql) reads the columns by their aliases")
    assert rows == [(doc.pk, 4, 2, "b")], (
        f"Django's SQLCompiler.as_sql() for values(**expressions) gives rows {rows}: "
        f"django_dbworker/store/claims.py (Claims.eligible_sql) relies on it")


# -- django_dbworker/store/engine.py (django_sql_to_text) --------------------------------
def test_django_sql_is_what_django_sql_to_text_converts(transactional_db):
    """django_sql_to_text() turns Django's compiled SQL into a SQLAlchemy text() with a
    regex: every parameter is a ``%s``, every literal percent sign ``%%``, and nothing
    else in it may read as a SQLAlchemy bind parameter. Checked on the kinds of querysets
    workers' eligible() return, run both ways: the claim's rows must be Django's."""
    author = Author.objects.create(name="a", rank=1)
    d1 = Document.objects.create(title="a:b", behaviour="a", priority=2, steps=1, author=author)
    d2 = Document.objects.create(title="50% off", behaviour="5", uploaded=False, priority=1, steps=3)
    d3 = Document.objects.create(title="x_y", behaviour="x_", priority=None, steps=2, author=author)
    d4 = Document.objects.create(title="xay", behaviour="x_", uploaded=False, priority=1, author=author)
    Execution.objects.filter(worker="docs", source_id=str(d3.pk)).update(status=ExecutionStatus.FINISHED)
    cases = {
        "a boolean": (Document.objects.filter(uploaded=True), {d1, d3}),
        "a colon in a parameter": (Document.objects.filter(title="a:b"), {d1}),
        "a percent sign in a parameter": (Document.objects.filter(title__contains="50%"), {d2}),
        # (Django's SQL itself holds '%%', '\' and '_' here)
        "a pattern from a column": (Document.objects.filter(title__startswith=F("behaviour")), {d1, d2, d3}),
        "has_execution_status": (Document.objects.filter(
            has_execution_status("docs", ExecutionStatus.FINISHED)), {d3}),
        "an order": (Document.objects.filter(priority__in=[1, 2]).exclude(author__isnull=True).order_by(
            "-priority", F("steps").desc(nulls_last=True), Lower("title")), {d1, d4}),
    }
    engine = engines.engine_for("default")
    try:
        for case, (qs, expected) in cases.items():
            sql, params, terms, values = eligible_compiled(qs)
            django_rows = {tuple(r.values()) for r in values}
            assert {r[0] for r in django_rows} == {d.pk for d in expected}, case  # (the test's data)
            tokens = engines._DJANGO_PARAM.findall(sql)
            assert tokens.count("%s") == len(params) and "%" not in engines._DJANGO_PARAM.sub("", sql), (
                f"Django's compiled SQL for {case} has percent signs other than %s and %% ({sql!r}, "
                f"{params!r}): django_dbworker/store/engine.py (django_sql_to_text) expects those only")
            text = engines.django_sql_to_text(sql, params).columns(
                sa.column("dbw_pk"), *[sa.column(t.alias) for t in terms])
            binds = set(text.compile(dialect=engine.dialect).params)
            assert binds == {f"dbw_p{i}" for i in range(len(params))}, (
                f"Django's compiled SQL for {case} ({sql!r}) reads as bind parameters {sorted(binds)} "
                f"to SQLAlchemy: django_dbworker/store/engine.py (django_sql_to_text) expects its own only")
            sub = text.subquery("dbw_eligible")
            with engine.connect() as conn:
                engine_rows = {tuple(r) for r in conn.execute(sa.select(*sub.c))}
            assert engine_rows == django_rows, (
                f"Django's compiled SQL for {case} ({sql!r}) gives other rows once converted by "
                f"django_dbworker/store/engine.py (django_sql_to_text): {engine_rows} != {django_rows}")
    finally:
        engine.dispose()


# -- django_dbworker/admin/diagnosis.py (_eligibility, _describe) ------------------------
def test_where_node_children_are_the_filter_conditions(db):
    """_eligibility() splits an eligible() queryset's ``query.where`` (an AND, not
    negated) into its ``children`` and asks each alone, by setting
    ``part.query.where = WhereNode([child])``; _describe() compiles one with
    ``child.as_sql(compiler, connection)``."""
    both = Document.objects.create(title="a", uploaded=True)
    other_title = Document.objects.create(title="b", uploaded=True)
    not_uploaded = Document.objects.create(title="a", uploaded=False)
    qs = Document.objects.filter(uploaded=True, title="a")
    where = qs.query.where
    assert isinstance(where, WhereNode) and where.connector == AND and not where.negated, (
        "Django's private Query.where of filter(a, b) is no longer a WhereNode(AND), not negated: "
        "django_dbworker/admin/diagnosis.py (_eligibility) relies on it")
    assert len(where.children) == 2, (
        f"Django's private WhereNode.children of filter(uploaded=True, title='a') is {where.children!r}: "
        f"django_dbworker/admin/diagnosis.py (_eligibility) expects one child per condition")
    met = set()
    for child in where.children:
        part = qs.all()
        part.query.where = WhereNode([child])
        met.add(frozenset(part.values_list("pk", flat=True)))
    assert met == {frozenset({both.pk, other_title.pk}), frozenset({both.pk, not_uploaded.pk})}, (
        "Django's private WhereNode([child]) no longer filters by that one condition: "
        "django_dbworker/admin/diagnosis.py (_eligibility) relies on it")
    [title] = [c for c in where.children if getattr(getattr(c, "lhs", None), "target", None)
               == Document._meta.get_field("title")]
    sql, params = title.as_sql(qs.query.get_compiler(using="default"), connection)
    assert sql.count("%s") == 1 and list(params) == ["a"] and "'a'" in sql % tuple(repr(p) for p in params), (
        f"Django's lookup.as_sql(compiler, connection) gives {sql!r}, {params!r}: "
        f"django_dbworker/admin/diagnosis.py (_describe) shows it as SQL with the values in")


def test_exists_condition_shows_its_worker_and_statuses():
    """_describe() recognises a has_execution_status() condition: a lookup whose ``lhs``
    is the Exists and ``rhs`` True, whose ``.query.model`` is Execution, and whose
    ``.query.where.children`` are lookups on ``lhs.target`` (the field) with ``rhs``."""
    qs = Document.objects.filter(has_execution_status("docs", [ExecutionStatus.FINISHED]), title="x")
    conditions = [c for c in qs.query.where.children if isinstance(getattr(c, "lhs", None), Exists)]
    assert len(conditions) == 1 and conditions[0].rhs is True, (
        f"Django's filter(Exists(...)) condition is no longer a lookup with lhs the Exists and rhs "
        f"True ({qs.query.where.children!r}): django_dbworker/admin/diagnosis.py (_describe) relies on it")
    exists = conditions[0].lhs
    assert exists.query.model is Execution, (
        "Django's Exists(...).query.model is no longer the subquery's model: "
        "django_dbworker/admin/diagnosis.py (_describe) relies on it")
    lookups = {}
    for c in exists.query.where.children:
        target = getattr(getattr(c, "lhs", None), "target", None)
        if target is not None:
            lookups[target.name] = c.rhs
    assert lookups.get("worker") == "docs" and list(lookups.get("status") or []) == ["finished"], (
        f"Django's Exists(...).query.where.children no longer read as field (lhs.target) and value "
        f"(rhs): {lookups!r}; django_dbworker/admin/diagnosis.py (_describe) relies on it")


# -- django_dbworker/processes/savepoints.py and processes/groups.py ---------------------
def test_savepoint_ids_are_what_on_commit_tags_callbacks_with(transactional_db):
    """kept_savepoint() lists its savepoint in ``connection.savepoint_ids`` as atomic()
    lists its own: on_commit() tags callbacks with them, and rolling back to the savepoint
    drops the callbacks registered while it was listed."""
    ran = []
    with transaction.atomic():
        assert isinstance(connection.savepoint_ids, list), (
            "Django's private connection.savepoint_ids is no longer a list: "
            "django_dbworker/processes/savepoints.py (kept_savepoint) appends and pops it")
        depth = len(connection.savepoint_ids)
        with transaction.atomic():
            assert len(connection.savepoint_ids) == depth + 1 and connection.savepoint_ids[-1], (
                "Django's atomic() no longer lists its savepoint in connection.savepoint_ids: "
                "django_dbworker/processes/savepoints.py (kept_savepoint) lists its own the same way")
        sid = connection.savepoint()
        connection.savepoint_ids.append(sid)
        transaction.on_commit(lambda: ran.append("inside the savepoint"))
        connection.savepoint_ids.pop()
        transaction.on_commit(lambda: ran.append("outside it"))
        connection.savepoint_rollback(sid)
    assert ran == ["outside it"], (
        "Django's on_commit() no longer tags callbacks with connection.savepoint_ids (or "
        "savepoint_rollback() no longer drops them): django_dbworker/processes/savepoints.py "
        "(kept_savepoint) relies on it")


def test_needs_rollback_is_the_flag_atomic_rolls_back_on(transactional_db):
    """kept_savepoint(), _roll_back_to() and groups.py read and set
    ``connection.needs_rollback``: set_rollback(True) sets it, and the outermost atomic()
    rolls back when it is set, commits when it is not."""
    with transaction.atomic():
        Tag.objects.create(slug="kept")
        transaction.set_rollback(True)
        assert connection.needs_rollback is True, (
            "Django's transaction.set_rollback(True) no longer sets connection.needs_rollback: "
            "django_dbworker/processes/savepoints.py and processes/groups.py read it")
        connection.needs_rollback = False
    with transaction.atomic():
        Tag.objects.create(slug="dropped")
        connection.needs_rollback = True
    slugs = set(Tag.objects.values_list("slug", flat=True))
    assert slugs == {"kept"}, (
        f"Django's atomic() no longer commits or rolls back by connection.needs_rollback (left "
        f"{slugs}): django_dbworker/processes/savepoints.py (_roll_back_to) sets it")


def test_closed_in_transaction_marks_a_connection_closed_inside_atomic(transactional_db):
    """_roll_back_to() gives up on its savepoint when ``connection.closed_in_transaction``:
    the connection was closed inside atomic() and the database rolls back by itself."""
    assert connection.closed_in_transaction is False, (
        "Django's private connection.closed_in_transaction is not False on an open connection: "
        "django_dbworker/processes/savepoints.py (_roll_back_to) relies on it")
    with transaction.atomic():
        Tag.objects.create(slug="lost")
        connection.close()
        assert connection.closed_in_transaction is True and connection.needs_rollback is True, (
            "Django's private connection.closed_in_transaction is not set by close() inside atomic(): "
            "django_dbworker/processes/savepoints.py (_roll_back_to) relies on it")
    assert not Tag.objects.filter(slug="lost").exists(), (  # (connects again)
        "A write before close() inside atomic() was kept: django_dbworker/processes/savepoints.py "
        "(_roll_back_to) counts on the database rolling it back by itself")
    assert connection.closed_in_transaction is False, (
        "Django's private connection.closed_in_transaction stays set after a new connection: "
        "django_dbworker/processes/savepoints.py (_roll_back_to) would never roll back again")


def test_connection_attribute_is_the_dbapi_connection_or_none(transactional_db):
    """groups.py (_database_gone) and savepoints.py (_transaction_state) read
    ``connection.connection``: the DB-API connection, None once closed; groups.py asks
    ``is_usable()`` of it."""
    connection.ensure_connection()
    assert connection.connection is not None, (
        "Django's connection.connection is None on an open connection: "
        "django_dbworker/processes/groups.py (_database_gone) relies on it")
    assert connection.is_usable() is True, (
        "Django's connection.is_usable() is not True on an open connection: "
        "django_dbworker/processes/groups.py (_database_gone) would close it")
    connection.close()
    assert connection.connection is None, (
        "Django's connection.connection is not None after close(): "
        "django_dbworker/processes/savepoints.py (_transaction_state) takes None as ended")


@pytest.mark.skipif(connection.vendor == "sqlite", reason="SQLite's is_usable() is always True")
def test_is_usable_says_a_broken_connection_is_not(transactional_db):
    """groups.py (_database_gone) closes the connections whose ``is_usable()`` is False,
    and counts the failure as the database's."""
    connection.ensure_connection()
    connection.connection.close()  # broken under Django's feet
    try:
        assert connection.is_usable() is False, (
            "Django's connection.is_usable() is not False on a broken connection: "
            "django_dbworker/processes/groups.py (_database_gone) relies on it")
    finally:
        try:
            connection.close()
        except DatabaseError:
            connection.connection = None  # (a driver that refuses to close twice)


def test_connections_all_initialized_only_gives_this_threads_connections():
    """_database_gone() checks ``connections.all(initialized_only=True)``: the
    connections this thread has used, without creating the others."""
    found: dict[str, list] = {}

    def in_a_new_thread():
        found["before"] = connections.all(initialized_only=True)
        used = connections["default"]
        found["after"] = [c for c in connections.all(initialized_only=True) if c is used]
        used.close()

    thread = threading.Thread(target=in_a_new_thread)
    thread.start()
    thread.join()
    assert found["before"] == [] and len(found["after"]) == 1, (
        f"Django's connections.all(initialized_only=True) no longer gives this thread's used "
        f"connections only ({found}): django_dbworker/processes/groups.py (_database_gone) relies on it")


# -- django_dbworker/vendors/claiming.py (_compiled_once) --------------------------------
def claim_update(*extra: sa.ColumnElement) -> sa.Update:
    """An UPDATE shaped like PostgreSQL's claim: bound token and claimer, RETURNING."""
    e = execution_table()
    return (sa.update(e).where(e.c.id >= sa.bindparam("dbw_floor"), *extra)
            .values(status="working", claim_token=sa.bindparam(TOKEN), claimed_by=sa.bindparam("dbw_claimer"),
                    attempts=e.c.attempts + 1)
            .returning(e.c.id, e.c.source_id, e.c.status, e.c.attempts))


def test_compiled_bind_processors_lists_the_parameter_conversions():
    """_compiled_once() runs the claim's UPDATE on the driver directly, skipping
    SQLAlchemy, only when ``Compiled._bind_processors`` is empty: no parameter needs a
    conversion. Compiled for psycopg, without a server."""
    dialect = pg_psycopg.dialect()
    compiled = claim_update().compile(dialect=dialect)
    assert hasattr(compiled, "_bind_processors"), (
        "SQLAlchemy's private Compiled._bind_processors is gone: "
        "django_dbworker/vendors/claiming.py (_compiled_once) relies on it")
    processors = compiled._bind_processors
    assert hasattr(processors, "keys") and not processors, (
        f"SQLAlchemy's private Compiled._bind_processors is {processors!r} for psycopg's claim "
        f"UPDATE of integers and strings: django_dbworker/vendors/claiming.py (_compiled_once) "
        f"expects it empty (the claim would no longer run on the driver directly)")
    assert claiming._compiled_once(claim_update(), dialect) is not None
    pickled = claim_update(execution_table().c.source_id != sa.bindparam("dbw_pickled", type_=sa.PickleType()))
    processors = pickled.compile(dialect=dialect)._bind_processors
    assert "dbw_pickled" in processors, (
        f"SQLAlchemy's private Compiled._bind_processors no longer lists a parameter that needs a "
        f"conversion ({processors!r}): django_dbworker/vendors/claiming.py (_compiled_once) would "
        f"run such a statement on the driver unconverted")
    assert claiming._compiled_once(pickled, dialect) is None


# -- django_dbworker/store/claims.py (Claims._wrapped) -----------------------------------
def driver_errors():
    yield pytest.param(sqlite3, sqlite3.OperationalError("database is locked"),
                       pysqlite.dialect(), id="sqlite3")
    try:
        import psycopg
    except ImportError:  # (the postgres extra)
        yield pytest.param(None, None, None, id="psycopg",
                           marks=pytest.mark.skip(reason="psycopg is not installed"))
        return
    yield pytest.param(psycopg, psycopg.errors.DeadlockDetected("deadlock detected"),
                       pg_psycopg.dialect(), id="psycopg")


@pytest.mark.parametrize("dbapi, orig, dialect", list(driver_errors()))
def test_dbapi_error_instance_wraps_a_driver_error(dbapi, orig, dialect):
    """Claims._wrapped() turns a driver's error from a raw claim into SQLAlchemy's with
    ``DBAPIError.instance(statement, params, orig, dbapi_base_err, dialect=...)``, as
    SQLAlchemy's own execution would: the outage handling and the deadlock retry read
    its class and ``orig``."""
    names = list(inspect.signature(sa.exc.DBAPIError.instance).parameters)
    assert names[:4] == ["statement", "params", "orig", "dbapi_base_err"] and "dialect" in names, (
        f"SQLAlchemy's DBAPIError.instance() now takes {names}: django_dbworker/store/claims.py "
        f"(Claims._wrapped) passes statement, params, orig, dbapi_base_err and dialect=")
    wrapped = sa.exc.DBAPIError.instance("UPDATE t SET x = %(x)s", {"x": 1}, orig, dbapi.Error,
                                         dialect=dialect)
    assert isinstance(wrapped, sa.exc.OperationalError), (
        f"SQLAlchemy's DBAPIError.instance() gives {type(wrapped).__name__} for the driver's "
        f"{type(orig).__name__}: django_dbworker/store/claims.py (Claims._wrapped) expects the "
        f"matching DBAPIError subclass (OperationalError)")
    assert wrapped.orig is orig and wrapped.statement == "UPDATE t SET x = %(x)s", (
        "SQLAlchemy's DBAPIError.instance() no longer keeps the driver's error and statement: "
        "django_dbworker/store/claims.py (Claims._wrapped) relies on it")


# -- django_dbworker/admin/__init__.py ---------------------------------------------------
def test_model_admin_does_not_exist_redirect(admin_client):
    """ExecutionAdmin.reset_view() answers a missing execution with Django's own message
    and redirect, ``ModelAdmin._get_obj_does_not_exist_redirect(request, opts, object_id)``."""
    method = getattr(ModelAdmin, "_get_obj_does_not_exist_redirect", None)
    assert method is not None, (
        "Django's private ModelAdmin._get_obj_does_not_exist_redirect is gone: "
        "django_dbworker/admin/__init__.py (ExecutionAdmin.reset_view) relies on it")
    assert list(inspect.signature(method).parameters) == ["self", "request", "opts", "object_id"], (
        "Django's private ModelAdmin._get_obj_does_not_exist_redirect has another signature: "
        "django_dbworker/admin/__init__.py (ExecutionAdmin.reset_view) calls it with (request, opts, object_id)")
    response = admin_client.get(reverse("admin:django_dbworker_execution_reset", args=["999999"]),
                                follow=True)
    messages = [str(m) for m in response.context["messages"]]
    assert response.redirect_chain == [(reverse("admin:index"), 302)] and any(
        "999999" in m and "exist" in m for m in messages), (
        f"Django's private ModelAdmin._get_obj_does_not_exist_redirect no longer redirects to the "
        f"admin index with a message ({response.redirect_chain}, {messages}): "
        f"django_dbworker/admin/__init__.py (ExecutionAdmin.reset_view) relies on it")


def test_changelist_get_queryset_takes_exclude_parameters():
    """ExecutionChangeList overrides ``ChangeList.get_queryset(request, exclude_parameters)``
    (ChangeList is not documented; the admin's facets call it with
    ``exclude_parameters=``)."""
    parameters = list(inspect.signature(ChangeList.get_queryset).parameters)
    assert parameters == ["self", "request", "exclude_parameters"], (
        f"Django's ChangeList.get_queryset now takes {parameters}: django_dbworker/admin/__init__.py "
        f"(ExecutionChangeList.get_queryset) overrides it with (request, exclude_parameters=None)")


# -- django_dbworker/api.py and admin/tasks.py (SourceKeyText, TaskKey) -------------------
def test_func_source_expressions_are_its_arguments_resolved():
    """SourceKeyText.as_sql() and TaskKey.as_sql() compile ``self.source_expressions[0]``
    (Func's attribute, not its documented get_source_expressions()): once resolved in a
    query, the column it wraps."""
    func = Func(F("title"), function="LOWER")
    assert func.source_expressions == func.get_source_expressions() == [F("title")], (
        "Django's Func.source_expressions is not the list of its arguments: django_dbworker/api.py "
        "(SourceKeyText) and admin/tasks.py (TaskKey) compile source_expressions[0]")
    resolved = Document.objects.annotate(k=func).query.annotations["k"]
    [column] = resolved.source_expressions
    assert column.target == Document._meta.get_field("title"), (
        f"Django's Func.source_expressions of a resolved Func is {resolved.source_expressions!r}: "
        f"django_dbworker/api.py (SourceKeyText) and admin/tasks.py (TaskKey) compile its first item")


# -- connection attributes of each vendor (django_dbworker/vendors) -------------------------
@pytest.mark.skipif(connection.vendor != "postgresql", reason="PostgreSQL's connection attribute")
def test_postgresql_pg_version_is_the_server_version_number(db):
    """vendors/postgresql.py (check_supported, describe) reads ``connection.pg_version``,
    an int like 160004."""
    with connection.cursor() as cursor:
        cursor.execute("SHOW server_version_num")
        server = int(cursor.fetchone()[0])
    version = getattr(connection, "pg_version", None)
    assert isinstance(version, int) and version == server, (
        f"Django's connection.pg_version is {version!r} (server_version_num {server}): "
        f"django_dbworker/vendors/postgresql.py (check_supported, describe) relies on it")


@pytest.mark.skipif(connection.vendor != "mysql", reason="MySQL's and MariaDB's connection attributes")
def test_mysql_version_attributes_describe_the_server(db):
    """vendors/__init__.py (_is_mariadb) reads ``connection.mysql_is_mariadb``,
    vendors/mysql.py ``connection.mysql_version`` (check_supported, describe) and
    ``connection.sql_mode`` (literal: NO_BACKSLASH_ESCAPES)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT VERSION(), @@sql_mode")
        text, sql_mode = cursor.fetchone()
    mariadb = getattr(connection, "mysql_is_mariadb", None)
    assert mariadb is ("mariadb" in text.lower()), (
        f"Django's connection.mysql_is_mariadb is {mariadb!r} on {text!r}: "
        f"django_dbworker/vendors/__init__.py (_is_mariadb) relies on it")
    version = getattr(connection, "mysql_version", None)
    assert (isinstance(version, tuple) and len(version) >= 2 and all(isinstance(v, int) for v in version)
            and text.startswith(".".join(map(str, version)))), (
        f"Django's connection.mysql_version is {version!r} on {text!r}: "
        f"django_dbworker/vendors/mysql.py (check_supported, describe) expects a tuple of ints")
    modes = getattr(connection, "sql_mode", None)
    assert modes == {m for m in (sql_mode or "").split(",") if m} and all(isinstance(m, str) for m in modes), (
        f"Django's connection.sql_mode is {modes!r} (@@sql_mode {sql_mode!r}): "
        f"django_dbworker/vendors/mysql.py (literal) expects the set of mode names")


# -- django_dbworker/installation/triggers.py and migrations/0007 --------------------------
def test_introspection_names_the_tables_and_indexes(db):
    """install() keeps the workers whose table is in ``introspection.table_names()``;
    migration 0007 makes an index again unless its name is a key of
    ``introspection.get_constraints(cursor, table)`` (introspection is not documented)."""
    table = Execution._meta.db_table
    assert table in connection.introspection.table_names(), (
        "Django's connection.introspection.table_names() no longer lists the tables: "
        "django_dbworker/installation/triggers.py (install) relies on it")
    with connection.cursor() as cursor:
        constraints = connection.introspection.get_constraints(cursor, table)
    missing = {"dbworker_claimable", "dbworker_claimable_priority", "dbworker_waiting"} - set(constraints)
    assert not missing, (
        f"Django's connection.introspection.get_constraints() keys no longer name the indexes "
        f"(missing {missing}): django_dbworker/migrations/0007_execution_crashes.py would make them again")


# -- django_dbworker/processes/main_guard.py ---------------------------------------------
def test_sys_frames_give_the_main_threads_code():
    """_main_thread_frame() finds where __main__'s code is running with
    ``sys._getframe(1)`` in the main thread and ``sys._current_frames()`` from another
    (CPython's underscored functions)."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("the tests do not run in the main thread")

    def caller_frame():
        return sys._getframe(1)

    here = sys._getframe(0)
    assert caller_frame() is here, (
        "CPython's sys._getframe(1) is not the caller's frame: "
        "django_dbworker/processes/main_guard.py (_main_thread_frame) relies on it")
    seen: list[str] = []

    def from_another_thread():
        frame = sys._current_frames().get(threading.main_thread().ident or 0)
        while frame is not None:
            seen.append(frame.f_code.co_name)
            frame = frame.f_back

    thread = threading.Thread(target=from_another_thread)
    thread.start()
    thread.join()
    assert here.f_code.co_name in seen, (
        f"CPython's sys._current_frames() no longer gives the main thread's frames ({seen}): "
        f"django_dbworker/processes/main_guard.py (_main_thread_frame) relies on it")
