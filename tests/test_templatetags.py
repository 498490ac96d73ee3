"""``{% load dbworker %}``: badges and status assignment, one query per list at most."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection
from django.template import Context, Template, TemplateSyntaxError
from django.test.utils import CaptureQueriesContext

from django_dbworker import ExecutionStatus, annotate_execution_status, execution_status
from django_dbworker.models import Execution
from tests.helpers import mark_failed
from tests.testapp.models import Document

pytestmark = pytest.mark.django_db


def render(source: str, **context: Any) -> str:
    return Template("{% load dbworker %}" + source).render(Context(context))


def test_badge_for_each_status() -> None:
    doc = Document.objects.create()
    for status in ExecutionStatus:
        Execution.objects.filter(worker="docs", source_id=str(doc.pk)).update(status=status)
        assert render('{% dbworker_status doc "docs" %}', doc=doc) == (
            f'<span class="dbworker-status dbworker-status--{status.value}">'
            f"{status.name.title()}</span>")


def test_badge_without_a_record() -> None:
    doc = Document.objects.create()
    Execution.objects.filter(worker="docs", source_id=str(doc.pk)).delete()
    assert render('{% dbworker_status doc "docs" %}', doc=doc) == (
        '<span class="dbworker-status dbworker-status--none">No record</span>')


def test_as_assigns_the_status() -> None:
    doc = Document.objects.create()
    mark_failed(Execution.objects.filter(worker="docs", source_id=str(doc.pk)))
    out = render('{% dbworker_status doc "docs" as s %}[{{ s }}]{% if s == "failed" %} '
                 'broken{% endif %}', doc=doc)
    assert out == "[failed] broken"
    Execution.objects.filter(worker="docs", source_id=str(doc.pk)).delete()
    assert render('{% dbworker_status doc "docs" as s %}{{ s|default_if_none:"none" }}',
                  doc=doc) == "none"


def test_worker_name_from_a_variable() -> None:
    doc = Document.objects.create()
    assert "dbworker-status--pending" in render("{% dbworker_status doc name %}", doc=doc,
                                                name="docs")


def test_annotated_objects_need_no_query() -> None:
    Document.objects.bulk_create([Document(title=f"d{i}") for i in range(30)])
    Execution.objects.filter(worker="docs").update(status="finished")
    template = ('{% for d in docs %}{% dbworker_status d "docs" %}'
                '{% dbworker_status d "summaries" as s %}{{ s }};{% endfor %}')
    with CaptureQueriesContext(connection) as queries:
        out = render(template, docs=annotate_execution_status(Document.objects.all(), "docs",
                                                              "summaries"))
    assert len(queries) == 1
    assert out.count("dbworker-status--finished") == 30 and out.count("pending;") == 30


def test_without_annotation_one_query_per_object() -> None:
    doc = Document.objects.create()
    with CaptureQueriesContext(connection) as queries:
        render('{% dbworker_status doc "docs" %}', doc=doc)
    assert len(queries) == 1


def test_an_annotated_none_means_no_record() -> None:
    doc = Document.objects.create()
    Execution.objects.filter(worker="docs", source_id=str(doc.pk)).delete()
    [annotated] = annotate_execution_status(Document.objects.filter(pk=doc.pk), "docs")
    assert "dbworker-status--none" in render('{% dbworker_status d "docs" %}', d=annotated)


def test_a_hostile_status_value_is_escaped_by_the_tag_itself() -> None:
    """The one text the badge takes from the data: a status it does not know (written by
    hand, or by a newer version), shown as "Unknown (...)" and in a title attribute. The
    tag escapes it even where the template's autoescaping is off."""
    doc = Document.objects.create()
    doc.docs_execution_status = '"><script>alert(1)</script>'  # as annotated from the row
    escaped = "&quot;&gt;&lt;script&gt;alert(1)&lt;/script&gt;"
    for source in ['{% dbworker_status doc "docs" %}',
                   '{% autoescape off %}{% dbworker_status doc "docs" %}{% endautoescape %}']:
        out = render(source, doc=doc)
        assert out == ('<span class="dbworker-status dbworker-status--unknown" '
                       f'title="{escaped}">Unknown ({escaped})</span>'), out


def test_an_unknown_status_in_the_database_renders_as_unknown() -> None:
    """Without the annotation the tag runs its own query: a stored value that is no status
    still renders (escaped) and is assigned as it is, where execution_status() raises."""
    doc = Document.objects.create()
    Execution.objects.filter(worker="docs", source_id=str(doc.pk)).update(status='<b>"x"</b>')
    escaped = "&lt;b&gt;&quot;x&quot;&lt;/b&gt;"
    assert render('{% dbworker_status doc "docs" %}', doc=doc) == (
        '<span class="dbworker-status dbworker-status--unknown" '
        f'title="{escaped}">Unknown ({escaped})</span>')
    assert render('{% dbworker_status doc "docs" as s %}[{{ s }}]', doc=doc) == f"[{escaped}]"
    with pytest.raises(ValueError, match="status '<b>\"x\"</b>', which this version of "
                                         "django-dbworker does not know"):
        execution_status("docs", doc)


def test_unknown_worker_names_the_registered_ones() -> None:
    doc = Document.objects.create()
    with pytest.raises(KeyError, match="Registered workers: .*docs"):
        render('{% dbworker_status doc "nope" %}', doc=doc)


@pytest.mark.parametrize("source", ['{% dbworker_status doc %}',
                                    '{% dbworker_status doc "docs" into s %}',
                                    '{% dbworker_status doc "docs" as %}'])
def test_syntax_errors(source: str) -> None:
    with pytest.raises(TemplateSyntaxError, match='dbworker_status obj "ocr"'):
        Template("{% load dbworker %}" + source)


def test_stylesheet_tag() -> None:
    assert render("{% dbworker_stylesheet %}") == (
        '<link rel="stylesheet" href="/static/django_dbworker/dbworker.css">')
