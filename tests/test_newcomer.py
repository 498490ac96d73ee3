"""What a newcomer reads: migrate's report, removed workers' clean-up, a sortable column."""

from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from django.urls import reverse

from django_dbworker import ExecutionStatus
from django_dbworker.installation.triggers import Report, install
from django_dbworker.models import CoordinatorHeartbeat, Execution, InstalledTrigger
from django_dbworker.registration.registry import registry
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
    failed = Execution.objects.create(worker="gone_worker", source_id="2", status="failed")
    held = Execution.objects.create(worker="gone_worker", source_id="3", status="working")
    done = Execution.objects.create(worker="gone_worker", source_id="4", status="finished")
    out = StringIO()
    install("default", report=Report(verbosity=1, out=out))
    assert ("4 executions belong to worker gone_worker, which is no longer registered; "
            "delete them with `manage.py dbworker_cleanup`") in out.getvalue()

    dry = StringIO()
    call_command("dbworker_cleanup", "--dry-run", stdout=dry)
    # It says exactly what it will do, worker by worker, before anything changes.
    assert ("worker gone_worker (1 failed, 1 finished, 1 pending, 1 working): deletes 1; keeps "
            "1 failed, 1 finished, 1 working (history: --include-history deletes it).") in dry.getvalue()
    assert "Dry run: would delete 1 execution(s); nothing changed." in dry.getvalue()
    assert Execution.objects.filter(worker="gone_worker").count() == 4  # a dry run deletes nothing

    # Without --no-input it asks; nobody at a terminal says yes: nothing goes.
    with pytest.raises(CommandError, match="nothing deleted"):
        call_command("dbworker_cleanup", stdout=StringIO())
    assert Execution.objects.filter(worker="gone_worker").count() == 4

    text = StringIO()
    call_command("dbworker_cleanup", "--no-input", stdout=text)
    assert "Deleted 1 execution(s)." in text.getvalue()
    # History and a row a coordinator still holds stay; registered workers' rows are never
    # touched.
    assert set(Execution.objects.filter(worker="gone_worker")) == {failed, held, done}
    call_command("dbworker_cleanup", "--no-input", "--include-history", stdout=StringIO())
    assert list(Execution.objects.filter(worker="gone_worker")) == [held]
    doc = Document.objects.create()
    call_command("dbworker_cleanup", "--no-input", stdout=StringIO())
    assert Execution.objects.filter(worker="docs", source_id=str(doc.pk)).exists()


def test_cleanup_leaves_alone_a_worker_that_a_live_coordinator_serves():
    """One process's settings lack a worker that another, running, coordinator serves
    (a settings file that differs between two processes): its work is not ours to delete."""
    from django.utils import timezone

    Execution.objects.create(worker="elsewhere", source_id="1", status="pending")
    CoordinatorHeartbeat.objects.create(host="other-host", pid=4242, workers="docs,elsewhere",
                                        heartbeat_at=timezone.now())
    out = StringIO()
    call_command("dbworker_cleanup", "--no-input", stdout=out)
    assert ("worker elsewhere (1 pending): not registered here, but live coordinator(s) "
            "other-host:4242 run it: left alone.") in out.getvalue()
    assert Execution.objects.filter(worker="elsewhere").count() == 1


def test_cleanup_never_makes_finished_work_run_again():
    """A worker missing from one process's settings, cleaned up there, then registered again
    and migrated: its finished rows stay finished (before, cleanup deleted them and
    migrate's backfill made them pending: successful work ran again)."""
    docs = [Document.objects.create(title=f"done {i}") for i in range(3)]
    Execution.objects.filter(worker="docs").update(status="finished")
    w = registry["docs"]
    registry.unregister("docs")
    try:
        call_command("dbworker_cleanup", "--no-input", stdout=StringIO())
    finally:
        registry.register(w)
    install("default", report=Report(verbosity=0))
    assert set(Execution.objects.filter(worker="docs", source_id__in=[str(d.pk) for d in docs])
               .values_list("status", flat=True)) == {"finished"}


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


def test_cleanup_deletes_a_removed_workers_flow_control_rows_and_no_others():
    from django.utils import timezone

    from django_dbworker.models import FlowLock, RateLog

    FlowLock.objects.create(worker="gone_keyed", key="42")
    FlowLock.objects.create(worker="gone_keyed", key="")
    RateLog.objects.create(worker="gone_keyed", at=timezone.now(), claimed=3)
    FlowLock.objects.create(worker="keyed", key="7")  # registered: never touched
    FlowLock.objects.create(worker="gone_busy", key="1")
    Execution.objects.create(worker="gone_busy", source_id="9", status="working")
    dry = StringIO()
    call_command("dbworker_cleanup", "--dry-run", stdout=dry)
    assert "worker gone_keyed: deletes its 3 flow-control row(s) (FlowLock, RateLog)." in dry.getvalue()
    assert "worker gone_busy: keeps its 1 flow-control row(s)" in dry.getvalue()
    assert FlowLock.objects.count() == 4
    with pytest.raises(CommandError, match="nothing deleted"):
        call_command("dbworker_cleanup", stdout=StringIO())
    out = StringIO()
    call_command("dbworker_cleanup", "--no-input", stdout=out)
    assert "Deleted 3 flow-control row(s)." in out.getvalue()
    assert set(FlowLock.objects.values_list("worker", "key")) == {("keyed", "7"), ("gone_busy", "1")}
    assert not RateLog.objects.exists()
