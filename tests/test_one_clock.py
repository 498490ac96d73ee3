"""One clock, the database's: a host whose own clock is off writes no time of its own.

Leases and due times are compared with the database's clock, so every time the app
writes must come from it too. Before, a child wrote started_at, finished_at and a retry's
next_attempt_at from its host's clock: on a host two hours fast, a retry due in 0.5 s
waited two hours, and the row's times were two hours in the future.

The coordinator runs under libfaketime (its clock, and its children's, two hours fast;
monotonic time untouched). SQLite is not here: its clock is the clock of the process that
runs the statement, so a host's skew is the database's too, and there is no other host.
"""

import glob
from datetime import timedelta

import pytest
from django.conf import settings
from django.db import connection

from django_dbworker.models import Execution, Task
from django_dbworker.tasks.compat import TaskResultStatus
from django_dbworker.vendors import for_connection
from tests.helpers import runworkers, skip_or_fail, wait_for
from tests.testapp.models import Document, FaultJob
from tests.testapp.tasks import add

pytestmark = pytest.mark.django_db(transaction=True)
SKEW = "+2h"


def fast_clock() -> dict[str, str]:
    found = glob.glob("/usr/lib/*/faketime/libfaketime.so.1")
    if not found:
        skip_or_fail("skew a host's clock", "libfaketime is not installed "
                     "(scripts/system-packages.sh installs it)")
    return {"LD_PRELOAD": found[0], "FAKETIME": SKEW, "DONT_FAKE_MONOTONIC": "1"}


def database_now():
    return for_connection(connection).current_time()


@pytest.mark.skipif(settings.DB == "sqlite", reason="SQLite's clock is its process's own")
def test_a_host_two_hours_fast_writes_the_database_s_times():
    ok = FaultJob.objects.create(behaviour="clock_ok")
    flaky = FaultJob.objects.create(behaviour="clock_flaky")
    result = add.enqueue(1, 2)
    proc = runworkers("--worker", "clock", "--queue", "default", env=fast_clock())
    rows = Execution.objects.filter(worker="clock")
    try:
        # The retry is due 0.5 s after the failure on the database's clock: with the
        # host's clock it would wait two hours.
        wait_for(lambda: rows.filter(status="finished").count() == 2
                 and add.get_result(result.id).status == TaskResultStatus.SUCCESSFUL, timeout=60)
    finally:
        proc.kill()
        out, err = proc.communicate(timeout=30)
    now = database_now()
    near = timedelta(minutes=1)
    for row in rows:
        assert abs(row.started_at - now) < near, (row.source_id, row.started_at, now)
        assert abs(row.finished_at - now) < near, (row.source_id, row.finished_at, now)
        assert row.started_at <= row.finished_at
    assert rows.get(source_id=str(flaky.pk)).attempts == 2
    assert rows.get(source_id=str(ok.pk)).attempts == 1
    task = Task.objects.get(pk=result.id)
    for moment in (task.started_at, task.last_attempted_at, task.finished_at):
        assert abs(moment - now) < near, (moment, now)


def test_the_clock_s_expressions_survive_debug_logging():
    """Django formats a query's SQL with its parameters to log it under DEBUG: SQLite's
    strftime('%Y...') unescaped failed the child's failure record (and the demo hung)."""
    document = Document.objects.create(uploaded=True)
    vendor = for_connection(connection)
    connection.force_debug_cursor = True
    try:
        Execution.objects.filter(worker="docs", source_id=str(document.pk)).update(
            updated_at=vendor.now_expression(), next_attempt_at=vendor.now_expression(1.5))
    finally:
        connection.force_debug_cursor = False
    e = Execution.objects.get(worker="docs", source_id=str(document.pk))
    assert 1.4 <= (e.next_attempt_at - e.updated_at).total_seconds() <= 1.6
