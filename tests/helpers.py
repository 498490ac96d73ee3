"""Shared test helpers: run coordinators in this process or as real `runworkers` processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from django.conf import settings

from django_dbworker import Coordinator
from tests.testapp.models import Effect

ROOT = Path(__file__).resolve().parent.parent


def drain(*workers: str, **overrides) -> Counter:
    return Coordinator(list(workers) or None, **overrides).drain()


def effects(worker: str) -> Counter:
    return Counter(Effect.objects.filter(worker=worker).values_list("source_id", flat=True))


def subprocess_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        DJANGO_SETTINGS_MODULE="tests.settings",
        DBWORKER_TEST_USE_TEST_DB="1",
        DBWORKER_TEST_RUN_ID=settings.RUN_ID,
        DBWORKER_TEST_DB=settings.DB,
        PYTHONPATH=str(ROOT),
    )
    env.update(extra)
    return env


STARTED: list[subprocess.Popen] = []


def runworkers(*args: str, env: dict[str, str] | None = None, **popen) -> subprocess.Popen:
    """A real `manage.py runworkers` process on the test database (killed, with its
    children, when the test ends: see conftest); ``env`` adds environment variables."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "django", "runworkers", *args],
        cwd=ROOT, env=subprocess_env(**(env or {})), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True, **popen,
    )
    STARTED.append(proc)
    return proc


def kill_started() -> None:
    import signal

    while STARTED:
        proc = STARTED.pop()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)


def wait_for(predicate: Callable[[], object], timeout: float = 30, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s")


def running_marker(worker: str, key) -> Path:
    """The file a test handler writes when it starts (see testapp.workers.pid_file),
    cleared of any earlier run's. A claimed row ("working") may still wait in its
    child's queue; this says the handler itself is running."""
    from tests.testapp.workers import pid_file

    path = pid_file(worker, key)
    path.unlink(missing_ok=True)
    return path
