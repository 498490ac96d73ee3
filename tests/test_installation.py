"""migrate installs triggers: every source row has an Execution from the moment it exists."""

import uuid

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.db import connection

from django_dbworker import Coordinator, ExecutionStatus, execution_status
from django_dbworker.installation.triggers import (
    existing_triggers,
    install,
    installed_triggers,
    missing_triggers,
)
from django_dbworker.models import Execution
from django_dbworker.registration.registry import Worker, registry
from django_dbworker.vendors import for_connection
from tests.helpers import execution, insert_raw, without_trigger
from tests.testapp.models import Document, Tag, UuidItem

pytestmark = pytest.mark.django_db(transaction=True)


def pending(worker):
    return set(Execution.objects.filter(worker=worker, status="pending").values_list("source_id", flat=True))


def test_every_migration_leaves_the_claim_indexes_in_place():
    """The claim indexes are made by SQL of the app's own; SQLite adds a NOT NULL column
    by copying the table (migration 0007, Execution.crashes), which dropped them."""
    with connection.cursor() as cursor:
        present = connection.introspection.get_constraints(cursor, Execution._meta.db_table)
    assert {"dbworker_claimable", "dbworker_claimable_priority", "dbworker_waiting"} <= set(present)


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
    insert_raw(Document, title="raw", behaviour="ok", uploaded=True, steps=0, text="")
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
    assert execution("docs", b).status == "working"


def test_install_backfills_rows_that_existed_before_and_cleans_up_removed_ones():
    vendor = for_connection(connection)
    docs = registry["docs"]
    with connection.cursor() as cursor:
        for name in vendor.trigger_names(docs.trigger_source()):
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
    ghost = Worker(name="ghost", source=Tag, handler=_ghost_handler)
    registry.register(ghost)
    try:
        install("default")
        vendor = for_connection(connection)
        assert set(vendor.trigger_names(ghost.trigger_source())) <= set(installed_triggers(vendor))
    finally:
        registry.unregister("ghost")
    install("default")
    assert not any(n.startswith("dbworker_ghost_") for n in installed_triggers(vendor))
    assert not existing_triggers(vendor, vendor.trigger_names(ghost.trigger_source()))
    assert not missing_triggers("default", registry.values())


# Triggers of the user's own, with names that look like ours: `_` in LIKE matches any
# character, and SQLite's LIKE (and MySQL's information_schema) ignore case. One even has
# exactly our form: what decides is that this app did not create it.
FOREIGN = ["dbworkers_audit", "dbworkerXaudit", "DBWORKER_AUDIT", "dbworker_audit_ins"]


def create_foreign_trigger(name):
    table = connection.ops.quote_name(Tag._meta.db_table)
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(f'CREATE FUNCTION "{name}"() RETURNS trigger LANGUAGE plpgsql '
                           "AS $f$ BEGIN RETURN NULL; END $f$")
            cursor.execute(f'CREATE TRIGGER "{name}" AFTER INSERT ON {table} '
                           f'FOR EACH STATEMENT EXECUTE FUNCTION "{name}"()')
        elif connection.vendor == "mysql":
            cursor.execute(f"CREATE TRIGGER `{name}` AFTER INSERT ON {table} FOR EACH ROW "
                           "SET @dbworker_test_audit = 1")
        else:
            cursor.execute(f'CREATE TRIGGER "{name}" AFTER INSERT ON {table} BEGIN SELECT 1; END')


def foreign_objects():
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SELECT tgname FROM pg_trigger WHERE NOT tgisinternal")
            triggers = {r[0] for r in cursor.fetchall()}
            cursor.execute("SELECT proname FROM pg_proc")
            functions = {r[0] for r in cursor.fetchall()}
            return {n for n in FOREIGN if n in triggers and n in functions}
        if connection.vendor == "mysql":
            cursor.execute("SELECT TRIGGER_NAME FROM information_schema.TRIGGERS "
                           "WHERE TRIGGER_SCHEMA = DATABASE()")
        else:
            cursor.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'")
        return {r[0] for r in cursor.fetchall()} & set(FOREIGN)


def test_migrate_never_touches_triggers_it_did_not_create():
    for name in FOREIGN:
        create_foreign_trigger(name)
    try:
        assert foreign_objects() == set(FOREIGN)
        call_command("migrate", verbosity=0)  # installs, and drops what it no longer needs
        install("default")
        assert foreign_objects() == set(FOREIGN)
        # Ours are unaffected by the look-alikes: a tag still becomes work.
        tag = Tag.objects.create(slug="still-work")
        assert execution_status("tags", tag) == ExecutionStatus.PENDING
    finally:
        with connection.cursor() as cursor:
            for name in FOREIGN:
                q = connection.ops.quote_name(name)
                if connection.vendor == "postgresql":
                    cursor.execute(f"DROP TRIGGER IF EXISTS {q} ON {connection.ops.quote_name(Tag._meta.db_table)}")
                    cursor.execute(f"DROP FUNCTION IF EXISTS {q}()")
                else:
                    cursor.execute(f"DROP TRIGGER IF EXISTS {q}")


def test_coordinator_refuses_to_start_without_triggers():
    with without_trigger("dbworker_tags_ins", Tag), \
            pytest.raises(ImproperlyConfigured, match="manage.py migrate"):
        Coordinator(["tags"]).drain()


def test_a_handler_defined_in_main_is_refused_with_the_fix():
    """Children are spawned: they import the handler by its module, which __main__ is
    not. The coordinator says so before it starts a child."""
    import dataclasses

    from django_dbworker.installation.preflight import check_can_start

    def in_a_script(tag):
        return None

    in_a_script.__module__ = "__main__"
    worker = dataclasses.replace(registry["tags"], handler=in_a_script)
    with pytest.raises(ImproperlyConfigured, match=r"lives in __main__.*move it into a module"):
        check_can_start("default", [worker])
    check_can_start("default", [registry["tags"]])  # the registered one may start


def _ghost_handler(tag):  # a module-level handler for the ghost worker
    return None


def test_the_migrations_match_the_models():
    """A model change without its migration would leave every user's database behind."""
    try:
        call_command("makemigrations", "django_dbworker", check=True, dry_run=True,
                     verbosity=0)
    except SystemExit as exc:  # --check exits 1 when a migration is missing
        pytest.fail(f"django_dbworker's models have changes with no migration ({exc})")
