import os

import pytest


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
