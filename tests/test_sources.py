"""A lone row's source, loaded by SQL compiled once (django_dbworker.processes.sources): the same
instance as the default manager's .get(pk=...) gives, or .get() itself when the manager's
queryset is not plain."""

import uuid

import pytest
from django.db.models import Count, F

from django_dbworker.models import Task
from django_dbworker.processes import sources
from tests.testapp.models import Author, Document, Tag, UuidItem

pytestmark = pytest.mark.django_db(transaction=True)


def fields_of(instance):
    return {f.attname: getattr(instance, f.attname) for f in instance._meta.concrete_fields}


@pytest.fixture
def rows():
    author = Author.objects.create(name="Ann", rank=3)
    return [
        Document.objects.create(title="a", priority=None, author=author, uploaded=False),
        UuidItem.objects.create(name="u"),
        Tag.objects.create(slug="a-tag"),
        Task.objects.create(id=uuid.uuid4(), backend="default", queue_name="q", task_path="m.f",
                            priority=-3, args=[1, "two", {"three": [3.0]}], kwargs={"k": None},
                            worker_ids=["h:1"]),
    ]


def test_a_plain_default_manager_is_compiled_once_and_gives_what_get_gives(rows):
    for row in rows:
        model = type(row)
        first = sources.load(model, "default", row.pk)
        assert isinstance(sources._compiled[model, "default"], str)  # the compiled path
        again = sources.load(model, "default", row.pk)
        expected = model._default_manager.get(pk=row.pk)
        assert fields_of(first) == fields_of(again) == fields_of(expected)
        assert first._state.db == "default" and not first._state.adding
        first.save()  # an instance like any other (an UPDATE of its row)


def test_a_missing_row_is_does_not_exist_as_from_get(rows):
    for row in rows:
        model = type(row)
        sources.load(model, "default", row.pk)  # compiled
        row.delete()
        with pytest.raises(model.DoesNotExist, match="matching query does not exist"):
            sources.load(model, "default", row.pk)


@pytest.mark.parametrize("queryset", [
    lambda: Document.objects.filter(uploaded=True),
    lambda: Document.objects.annotate(n=Count("id")),
    lambda: Document.objects.alias(t=F("title")).filter(t="x"),
    lambda: Document.objects.select_related("author"),
    lambda: Document.objects.prefetch_related("author"),
    lambda: Document.objects.defer("text"),
    lambda: Document.objects.only("title"),
    lambda: Document.objects.distinct(),
    lambda: Document.objects.extra(select={"one": "1"}),
    lambda: Document.objects.values(),
    lambda: Document.objects.all()[:5],
])
def test_a_queryset_that_is_not_plain_is_asked_with_get_each_time(queryset):
    assert sources.compile_get(queryset(), "default", 1) is None


def test_the_compiled_select_has_the_key_as_its_only_parameter():
    sql = sources.compile_get(Document.objects.all(), "default", 7)
    assert sql is not None and sql.count("%s") == 1 and "ORDER BY" not in sql
