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
