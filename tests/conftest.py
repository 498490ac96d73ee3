import os

import pytest

# The release artefacts are built and installed with their own SQLite, whatever
# DBWORKER_TEST_DB says, and the unit layer (tests/unit: pure policies) needs no database
# at all: both run in the SQLite runs of `make test` only (`make unit`: the unit layer
# alone).
if os.environ.get("DBWORKER_TEST_DB", "sqlite") != "sqlite":
    collect_ignore = ["test_packaging.py", "unit"]


def pytest_report_header(config):
    return f"dbworker test database: {os.environ.get('DBWORKER_TEST_DB', 'sqlite')}"


@pytest.fixture(autouse=True)
def _no_leftover_workers():
    """A runworkers process must never outlive its test and claim the next test's rows."""
    yield
    from tests.helpers import kill_started

    kill_started()


@pytest.fixture(autouse=True, scope="session")
def _no_leftover_marker_files(django_db_setup):
    """Handlers' marker files live in one folder per test database: gone with the run."""
    yield
    import shutil

    from tests.testapp.workers import markers

    shutil.rmtree(markers(), ignore_errors=True)


def pytest_unconfigure(config):
    """SQLite leaves the test database's -wal and -shm files when a process that had it
    open was killed (the crash tests kill them): gone with the database itself."""
    from django.conf import settings

    if not settings.configured or settings.DB != "sqlite":
        return
    from pathlib import Path

    name = Path(settings.DATABASES["default"]["TEST"]["NAME"])
    if not name.exists():
        for suffix in ("-wal", "-shm"):
            Path(f"{name}{suffix}").unlink(missing_ok=True)


# -- after each transactional test's flush -----------------------------------------------
# Django flushes every table after a transactional test and then sends post_migrate, so
# migrate's install() ran after every such test: it re-created every trigger and re-recorded
# it, one statement at a time (0.2-0.3 s a test, about 8 minutes of `make test`). After a
# flush every table is empty, so its backfill, clean-up and reconcile have nothing to do;
# what the next test needs is the triggers as install() leaves them and their records.
# So when the triggers in the database are exactly those the last full install() left (the
# catalog's own definitions, compared) and the registry still wants those, only the
# records are written back; anything else -- a test dropped, changed or added a trigger,
# or left the registry changed -- gets the full install(), as before. migrate's own
# post_migrate (which passes a plan; flush does not) always gets the full install().
def _trigger_catalog(connection):
    """Every trigger in the test database, with its definition as the catalog holds it."""
    queries = {
        "postgresql": "SELECT t.tgname, c.relname, pg_get_triggerdef(t.oid), "
                      "pg_get_functiondef(t.tgfoid) FROM pg_trigger t "
                      "JOIN pg_class c ON c.oid = t.tgrelid WHERE NOT t.tgisinternal",
        "mysql": "SELECT TRIGGER_NAME, EVENT_OBJECT_TABLE, ACTION_TIMING, EVENT_MANIPULATION, "
                 "ACTION_STATEMENT FROM information_schema.TRIGGERS "
                 "WHERE TRIGGER_SCHEMA = DATABASE()",
        "sqlite": "SELECT name, tbl_name, sql FROM sqlite_master WHERE type = 'trigger'",
    }
    with connection.cursor() as cursor:
        cursor.execute(queries[connection.vendor])
        return sorted(tuple(map(str, row)) for row in cursor.fetchall())


def _wanted_ddl(vendor):
    """The trigger DDL the registry asks for now (pure Python: no query)."""
    from django_dbworker.registration.registry import registry

    return sorted({sql for w in registry.values() for sql in vendor.create_trigger_sql(
        w.trigger_source())})


@pytest.fixture(autouse=True, scope="session")
def _flush_keeps_the_installed_triggers(django_db_setup):
    from django.apps import apps
    from django.db import connections
    from django.db.models.signals import post_migrate

    from django_dbworker import conf
    from django_dbworker.installation import triggers
    from django_dbworker.models import Execution, InstalledTrigger
    from django_dbworker.vendors import for_connection

    config = apps.get_app_config("django_dbworker")
    left: dict[str, tuple] = {}  # alias -> (catalog, wanted DDL, records) after a full install

    def after_migrate_or_flush(sender, using, verbosity=1, **kwargs):
        if using != conf.value("DATABASE"):  # (install() has nothing to do there)
            return
        connection = connections[using]
        # A flush (no plan), install() ran here before, and the tables are empty indeed.
        if ("plan" not in kwargs and using in left
                and not InstalledTrigger.objects.using(using).exists()
                and not Execution.objects.using(using).exists()):
            catalog, wanted, records = left[using]
            vendor = for_connection(connection)
            if _trigger_catalog(connection) == catalog and _wanted_ddl(vendor) == wanted:
                InstalledTrigger.objects.using(using).bulk_create(
                    [InstalledTrigger(**record) for record in records])
                return
        triggers.install_after_migrate(sender, using, verbosity, **kwargs)
        left[using] = (_trigger_catalog(connection), _wanted_ddl(for_connection(connection)),
                      list(InstalledTrigger.objects.using(using).values()))

    post_migrate.disconnect(triggers.install_after_migrate, sender=config)
    post_migrate.connect(after_migrate_or_flush, sender=config)
    yield
    post_migrate.disconnect(after_migrate_or_flush, sender=config)
    post_migrate.connect(triggers.install_after_migrate, sender=config)
