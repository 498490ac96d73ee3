"""The unit layer: the pure policies (retry and back-off, prefetch sizing, cron slots, due
times and waits, options), each test named as a sentence of the behaviour.

Nothing here needs a database server or starts a process, and the whole layer runs in a
few seconds (`make unit`). That is enforced, not only promised: a test here may not carry
the django_db mark (without it pytest-django refuses any query), and starting a process
fails the test. A test that needs either belongs beside the integration tests in tests/.
"""

from __future__ import annotations

import multiprocessing.process
import subprocess

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # Before any fixture is set up: the mark's own fixture would create the test database.
    if item.get_closest_marker("django_db") is not None:
        pytest.fail("tests/unit needs no database: no django_db mark here (a test that "
                    "needs one belongs beside the integration tests in tests/)", pytrace=False)


@pytest.fixture(autouse=True)
def _no_process(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("tests/unit starts no process: a test that needs one belongs "
                             "beside the integration tests in tests/")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)


# tests/conftest.py's clean-ups, made for the integration tests, are not this layer's: one
# asks for the test database (which a unit run never creates), the other kills the
# runworkers processes a test started (none here).
@pytest.fixture(scope="session")
def _no_leftover_marker_files():
    yield


@pytest.fixture
def _no_leftover_workers():
    yield
