"""What a newcomer reads: migrate's report, removed workers' clean-up, a sortable column."""

from io import StringIO

import pytest
from django.core.management import call_command
from django.db import connection
from django.urls import reverse

from django_dbworker import ExecutionStatus
from django_dbworker.installation import Report, install
from django_dbworker.models import Execution, InstalledTrigger
from django_dbworker.registry import registry
from django_dbworker.vendors import for_connection
from tests.helpers import mark_failed
from tests.testapp.models import Document

pytestmark = pytest.mark.django_db(transaction=True)


def _drop_triggers_of(worker_name):
    vendor = for_connection(connection)
    w = registry[worker_name]
    with connection.cursor() as cursor:
        for name in vendor.trigger_names(w.trigger_source()):
            for sql in vendor.drop_trigger_sql(name, w.table):
                cursor.execute(sql)
    InstalledTrigger.objects.filter(worker=worker_name).delete()


def test_migrate_reports_the_triggers_it_installs_and_the_rows_it_makes_pending():
    _drop_triggers_of("docs")
    Document.objects.bulk_create([Document(title=f"old {i}") for i in range(28)])
    Execution.objects.filter(worker="docs").delete()  # as if "docs" were a new worker
    out = StringIO()
    install("default", report=Report(verbosity=1, out=out))
    text = out.getvalue()
    print("\nmigrate reported:\n" + text)
    names = for_connection(connection).trigger_names(registry["docs"].trigger_source())
    for name in names:
        assert f"installed trigger {name} on {registry['docs'].table} (worker docs)" in text
    assert "28 existing rows of testapp.Document are now pending for worker docs" in text
    assert Execution.objects.filter(worker="docs", status=ExecutionStatus.PENDING).count() == 28
    # Nothing changed the second time: verbosity 1 says nothing about this worker.
    again = StringIO()
    install("default", report=Report(verbosity=1, out=again))
    assert "worker docs" not in again.getvalue()
    quiet = StringIO()
    install("default", report=Report(verbosity=0, out=quiet))
    assert quiet.getvalue() == ""


def test_migrate_reports_and_cleanup_deletes_a_removed_workers_executions():
    Execution.objects.create(worker="gone_worker", source_id="1", status="pending")
    Execution.objects.create(worker="gone_worker", source_id="2", status="failed")
    held = Execution.objects.create(worker="gone_worker", source_id="3", status="working")
    out = StringIO()
    install("default", report=Report(verbosity=1, out=out))
    assert ("3 executions belong to worker gone_worker, which is no longer registered; "
            "delete them with `manage.py dbworker_cleanup`") in out.getvalue()

    dry = StringIO()
    call_command("dbworker_cleanup", "--dry-run", stdout=dry)
    assert "would delete 2 execution(s) of worker gone_worker" in dry.getvalue()
    assert Execution.objects.filter(worker="gone_worker").count() == 3  # a dry run deletes nothing

    done = StringIO()
    call_command("dbworker_cleanup", stdout=done)
    assert "deleting 2 execution(s) of worker gone_worker" in done.getvalue()
    # A row a coordinator still holds stays; registered workers' rows are never touched.
    assert list(Execution.objects.filter(worker="gone_worker")) == [held]
    doc = Document.objects.create()
    call_command("dbworker_cleanup", stdout=StringIO())
    assert Execution.objects.filter(worker="docs", source_id=str(doc.pk)).exists()


def test_the_mixins_status_column_sorts_by_status(admin_client):
    docs = [Document.objects.create(title=t) for t in ("a", "b", "c")]
    mark_failed(Execution.objects.filter(worker="docs", source_id=str(docs[1].pk)))
    Execution.objects.filter(worker="docs", source_id=str(docs[2].pk)).update(status="finished")
    url = reverse("admin:testapp_document_changelist")
    page = admin_client.get(url)
    cl = page.context["cl"]
    columns = list(cl.list_display)
    index = next(i for i, c in enumerate(columns) if getattr(c, "__name__", "") == "dbworker_docs_status")
    assert columns[index] in cl.model_admin.get_sortable_by(page.wsgi_request)
    # Sorting by the column (?o=N) orders the rows by their status text.
    for direction, expected in (("", ["failed", "finished", "pending"]),
                                ("-", ["pending", "finished", "failed"])):
        page = admin_client.get(url, {"o": f"{direction}{index}"})
        assert page.status_code == 200
        rows = list(page.context["cl"].result_list)
        assert [r.docs_execution_status for r in rows] == expected
