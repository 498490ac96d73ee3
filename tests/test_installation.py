"""migrate installs triggers: every source row has an Execution from the moment it exists."""

import uuid

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import connection

from django_dbworker import Coordinator, ExecutionStatus, execution_status
from django_dbworker.installation import install, installed_triggers, missing_triggers
from django_dbworker.models import Execution
from django_dbworker.registry import registry
from django_dbworker.vendors import for_connection
from tests.testapp.models import Document, Tag, UuidItem

pytestmark = pytest.mark.django_db(transaction=True)


def pending(worker):
    return set(Execution.objects.filter(worker=worker, status="pending").values_list("source_id", flat=True))


def test_orm_insert_creates_a_pending_execution():
    doc = Document.objects.create()
    assert execution_status("docs", doc) == ExecutionStatus.PENDING
    assert execution_status("docs", doc.pk) == ExecutionStatus.PENDING
    # Every worker on the table gets its own row.
    assert Execution.objects.filter(source_id=str(doc.pk)).count() == len(
        [w for w in registry.values() if w.source is Document])


def test_bulk_create_creates_pending_executions():
    docs = Document.objects.bulk_create([Document(title=str(i)) for i in range(50)])
    ids = {str(d.pk) for d in Document.objects.all()}
    assert len(docs) == 50
    assert pending("docs") == ids


def test_raw_sql_insert_becomes_work():
    table = connection.ops.quote_name(Document._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(f"INSERT INTO {table} (title, behaviour, uploaded, steps, text) "
                       "VALUES ('raw', 'ok', %s, 0, '')", [True])
    doc = Document.objects.get(title="raw")
    assert execution_status("docs", doc) == ExecutionStatus.PENDING


def test_uuid_and_string_keys_match_the_python_key():
    item = UuidItem.objects.create(id=uuid.uuid4())
    tag = Tag.objects.create(slug="hello-world")
    assert execution_status("uuids", item) == ExecutionStatus.PENDING
    assert execution_status("uuids", str(item.pk)) == ExecutionStatus.PENDING
    assert execution_status("tags", tag) == ExecutionStatus.PENDING
    assert execution_status("tags", "hello-world") == ExecutionStatus.PENDING
    assert execution_status("tags", "missing") is None


def test_deleting_a_source_row_removes_its_history_but_not_a_held_claim():
    a, b = Document.objects.create(), Document.objects.create()
    Execution.objects.filter(worker="docs", source_id=str(b.pk)).update(status="working")
    Document.objects.filter(pk__in=[a.pk, b.pk]).delete()
    assert not Execution.objects.filter(worker="docs", source_id=str(a.pk)).exists()
    # A handler holds b: it must be able to record that its source disappeared.
    assert Execution.objects.get(worker="docs", source_id=str(b.pk)).status == "working"


def test_install_backfills_rows_that_existed_before_and_cleans_up_removed_ones():
    vendor = for_connection(connection)
    docs = registry["docs"]
    with connection.cursor() as cursor:
        for name in installed_triggers(vendor):
            if name.startswith("dbworker_docs_"):
                for sql in vendor.drop_trigger_sql(name, docs.table):
                    cursor.execute(sql)
    assert missing_triggers("default", [docs])
    before = Document.objects.create(title="before triggers")
    assert execution_status("docs", before) is None
    # History of a row removed while no trigger watched.
    Execution.objects.create(worker="docs", source_id="999999", status="finished")
    install("default", [docs])
    assert missing_triggers("default", [docs]) == []
    assert execution_status("docs", before) == ExecutionStatus.PENDING
    assert not Execution.objects.filter(worker="docs", source_id="999999").exists()
    install("default", [docs])  # idempotent
    assert Execution.objects.filter(worker="docs", source_id=str(before.pk)).count() == 1


def test_triggers_of_workers_that_no_longer_exist_are_dropped():
    vendor = for_connection(connection)
    with connection.cursor() as cursor:
        for sql in vendor.create_trigger_sql(_Ghost(), Execution._meta.db_table):
            cursor.execute(sql)
    assert any(n.startswith("dbworker_ghost_") for n in installed_triggers(vendor))
    install("default")
    assert not any(n.startswith("dbworker_ghost_") for n in installed_triggers(vendor))
    assert not missing_triggers("default", registry.values())


def test_coordinator_refuses_to_start_without_triggers():
    vendor = for_connection(connection)
    with connection.cursor() as cursor:
        for sql in vendor.drop_trigger_sql("dbworker_tags_ins", Tag._meta.db_table):
            cursor.execute(sql)
    try:
        with pytest.raises(ImproperlyConfigured, match="manage.py migrate"):
            Coordinator(["tags"]).drain()
    finally:
        install("default")


class _Ghost:
    """A worker that was registered once and has since been removed."""

    name = "ghost"
    table = Tag._meta.db_table
    pk_field = Tag._meta.pk
    pk_column = Tag._meta.pk.column
