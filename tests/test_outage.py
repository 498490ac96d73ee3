"""The database goes away: at start (wait, then one line), for good (a wrong password: one
line at once), and in the middle of a run (one back-off per outage, work resumes about a
second after the server is back, nothing lost or run twice)."""

from __future__ import annotations

import os
import re
import signal
import time
from collections import Counter

import pytest
from django.conf import settings
from django.db import DatabaseError, connection, connections

from django_dbworker.coordinator.outage import DatabaseHealth
from django_dbworker.models import Execution
from django_dbworker.store.bridge import Bridge
from django_dbworker.store.engine import DATABASE_ERRORS
from django_dbworker.vendors import for_connection
from tests.helpers import drain, effects, execute, run_with_settings, runworkers, wait_for
from tests.processes import Output, run_command, server_stop_start
from tests.testapp.models import Document, StressJob

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.solo]
# Tests that stop a server or need one exist only in the PostgreSQL and MariaDB runs of
# the matrix (so the SQLite run reports no skip for them).
SERVER = os.environ.get("DBWORKER_TEST_DB", "sqlite") != "sqlite"


def server_url() -> str:
    return settings.POSTGRES_URL if connection.vendor == "postgresql" else settings.MYSQL_URL


def _accepts_connections() -> bool:
    try:
        connections.close_all()
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        return True
    except DatabaseError:
        return False


def _finished(worker: str) -> int:
    try:
        return Execution.objects.filter(worker=worker, status="finished").count()
    except DatabaseError:
        connections.close_all()  # broken by the outage; Django reconnects on next use
        return -1


# -- at start -------------------------------------------------------------------------------
def a_server_that_does_not_answer_is_waited_for_then_reported_in_one_line(tmp_path):
    # A port where nothing listens: connection refused, as while a server starts.
    code, out, err = run_with_settings(
        tmp_path, 'DATABASES["default"]["PORT"] = "1"\n', "--wait-for-database", "2", timeout=60)
    assert code == 1, err
    lines = err.strip().splitlines()
    attempts = [line for line in lines if "not reachable yet" in line]
    assert len(attempts) >= 2 and "attempt 1," in attempts[0], err
    assert lines[-1].startswith("CommandError: Database 'default' did not answer within 2s")
    assert "--wait-for-database SECONDS" in lines[-1]
    assert "Traceback" not in err and len(lines) == len(attempts) + 1


def test_a_database_that_can_never_connect_fails_at_once_in_one_line(tmp_path):
    if connection.vendor == "sqlite":
        body = 'DATABASES["default"]["NAME"] = "/nonexistent-dir/db.sqlite3"\n'
    else:  # a user the server does not know: no amount of waiting helps
        body = 'DATABASES["default"]["USER"] = "dbworker_nobody"\n'
    started = time.monotonic()
    code, out, err = run_with_settings(tmp_path, body, "--wait-for-database", "60", timeout=60)
    assert code == 1, err
    assert time.monotonic() - started < 30  # not the 60 s wait
    [line] = err.strip().splitlines()
    assert line.startswith("CommandError: Cannot connect to database 'default'")
    assert "Check NAME, USER and PASSWORD" in line


def a_coordinator_started_while_the_server_is_down_waits_then_works():
    stop, start = server_stop_start(connection.vendor, server_url())
    doc = Document.objects.create()
    connections.close_all()
    run_command(stop)
    try:
        proc = runworkers("--worker", "docs", "--wait-for-database", "90")
        output = Output(proc)
        wait_for(lambda: "not reachable yet" in output.err, timeout=60)
        assert proc.poll() is None
    finally:
        run_command(start)
    wait_for(_accepts_connections, timeout=120, interval=0.5)
    wait_for(lambda: effects("docs").get(str(doc.pk)) == 1, timeout=120, interval=0.5)
    proc.terminate()
    assert output.wait(timeout=60) == 0, output.err
    assert "Traceback" not in output.err


def _outage_state(worker: str, output: Output) -> str:
    """What a failed wait shows: the worker's rows by status, and the coordinator's log."""
    try:
        statuses = Counter(Execution.objects.filter(worker=worker).values_list("status", flat=True))
    except DatabaseError as exc:
        connections.close_all()
        statuses = f"(not readable: {exc})"
    return f"rows: {statuses}\ncoordinator log:\n{output.err[-6000:]}"


# -- in the middle of a run ----------------------------------------------------------------
def a_server_restart_mid_run_is_one_outage_and_work_resumes_at_once():
    stop, start = server_stop_start(connection.vendor, server_url())
    rows = 300
    StressJob.objects.bulk_create([StressJob(delay=0.02) for _ in range(rows)])
    ids = {str(pk) for pk in StressJob.objects.values_list("pk", flat=True)}
    proc = runworkers("--worker", "stress")
    output = Output(proc)
    wait_for(lambda: _finished("stress") >= 30, timeout=120)
    connections.close_all()
    run_command(stop)
    time.sleep(2)  # an outage of a few seconds, as a server restart or a failover
    run_command(start)
    wait_for(_accepts_connections, timeout=120, interval=0.1)
    back = time.monotonic()
    # (-1 is "the count itself failed": read it again until the database answers.)
    done_when_back = wait_for(lambda: (n := _finished("stress")) >= 0 and n + 1, timeout=30) - 1
    assert 0 <= done_when_back < rows, "the run ended before the outage: nothing was tested"
    wait_for(lambda: _finished("stress") > done_when_back, timeout=30, interval=0.05,
             state=lambda: _outage_state("stress", output))
    resumed = time.monotonic() - back
    wait_for(lambda: _finished("stress") == rows or proc.poll() is not None, timeout=240,
             interval=0.5)
    assert proc.poll() is None, f"runworkers died after the restart:\n{output.err}"
    proc.terminate()
    assert output.wait(timeout=60) == 0, output.err
    err = output.err
    # One outage: one line when it began, one when it ended; not one per failed call.
    assert len(re.findall(r"Database unavailable \(", err)) == 1, err
    assert len(re.findall(r"Database available again after [\d.]+s", err)) == 1, err
    assert "Traceback" not in err and "Exception during reset" not in err, err
    assert resumed < 5, f"work resumed {resumed:.1f}s after the server was back"
    assert Counter(Execution.objects.filter(worker="stress").values_list("status", flat=True)) == {
        "finished": rows}
    assert effects("stress") == dict.fromkeys(ids, 1)
    print(f"\n{connection.vendor}: {done_when_back} of {rows} done when the server was back; "
          f"work resumed {resumed:.2f}s later")


# -- contention is not an outage -------------------------------------------------------------
def deadlock_sql() -> str | None:
    """A statement whose failure is the server's own deadlock error."""
    if connection.vendor == "postgresql":
        return "DO $$ BEGIN RAISE EXCEPTION 'deadlock' USING ERRCODE = '40P01'; END $$"
    if connection.vendor == "mysql":
        return "SIGNAL SQLSTATE '40001' SET MYSQL_ERRNO = 1213, MESSAGE_TEXT = 'Deadlock found'"
    return None


def a_deadlock_is_retried_at_once_never_an_outage():
    bridge = Bridge()
    try:
        calls = []

        def flaky():
            calls.append(1)
            if len(calls) == 1:
                execute(bridge, deadlock_sql())
            return "done"

        health = DatabaseHealth(bridge.vendor, bridge.ping, 0.05)
        assert health.call(flaky) == "done" and len(calls) == 2
        assert health.down_since is None  # no outage began
        with pytest.raises(DATABASE_ERRORS) as info:
            execute(bridge, deadlock_sql())
        assert bridge.vendor.is_deadlock(info.value)
        assert not for_connection(connection).is_permanent_connect_error(info.value)
    finally:
        bridge.close()


# -- a frozen coordinator inside a claim: the row locks it holds -----------------------------
def rows_a_frozen_coordinator_holds_locked_wait_at_most_a_lease(tmp_path, env=None):
    """A coordinator stopped (SIGSTOP) inside a claim holds row locks in an open
    transaction. SKIP LOCKED hides those rows from everyone else; the server ends that
    transaction after LEASE_SECONDS (idle_in_transaction_session_timeout on PostgreSQL,
    idle_transaction_timeout on MariaDB), and another coordinator then runs them.
    ``env``: the coordinator's settings (tests/test_pgbouncer.py: through PgBouncer)."""
    from tests.testapp.models import Stepper

    Stepper.objects.bulk_create([Stepper(steps=1) for _ in range(6)])
    marker = tmp_path / "frozen"
    env = {**(env or {}), "DBWORKER_FAILPOINT": f"coordinator.claim_locked:{marker}:stop"}
    frozen = runworkers("--worker", "multi", env=env)
    try:
        wait_for(marker.exists, timeout=60)
        wait_for(lambda: open(f"/proc/{frozen.pid}/stat").read().split(")")[-1].split()[0] == "T",
                 timeout=10)
        frozen_at = time.monotonic()
        held = Execution.objects.filter(worker="multi", status="pending").count()
        assert held == 6, "the frozen claim locked rows that are still pending"
        # Another coordinator skips the locked rows (never waits on them) and drains what
        # it can; once the server has ended the frozen transaction, they are its to run.
        drains = 0
        while Execution.objects.filter(worker="multi").exclude(status="finished").exists():
            assert time.monotonic() - frozen_at < 30, "the locked rows never came free"
            drain("multi")
            drains += 1
        waited = time.monotonic() - frozen_at
        assert list(Stepper.objects.values_list("counter", flat=True)) == [1] * 6  # once each
    finally:
        os.kill(frozen.pid, signal.SIGCONT)  # it wakes to find its transaction gone
    frozen.terminate()
    frozen.communicate(timeout=60)
    assert list(Stepper.objects.values_list("counter", flat=True)) == [1] * 6
    assert waited >= settings.DBWORKER["LEASE_SECONDS"] - 0.5  # they waited for the server
    print(f"\n{connection.vendor}: {held} locked row(s) ran {waited:.1f}s after the freeze "
          f"({drains} drains)")


# -- flow control across a restart ------------------------------------------------------------
def per_key_limits_hold_across_a_server_restart():
    """Two coordinators run `keyed` (per_key=1) over 300 rows of 10 keys in runs; the server
    restarts mid-run. The WORKING rows of each key, sampled every few ms before, during
    (when the database answers) and after, never exceed 1, and every row runs once: a
    limit's state is the rows themselves (and FlowLock rows), nothing a restart loses."""
    from tests.processes import Coordinators
    from tests.testapp.models import KeyedJob

    stop, start = server_stop_start(connection.vendor, server_url())
    rows = [KeyedJob.objects.create(customer=(n // 10) % 10, delay=0.02) for n in range(300)]
    customer_of = {str(r.pk): r.customer for r in rows}
    group = Coordinators(2, "--worker", "keyed", "--concurrency", "keyed=2")
    group.wait_started()
    most: Counter = Counter()

    def sample() -> bool:
        """One sample of WORKING per key; whether every row is finished (False while the
        database does not answer)."""
        try:
            running = Counter(customer_of[s] for s in Execution.objects.filter(
                worker="keyed", status="working").values_list("source_id", flat=True))
            for key, n in running.items():
                most[key] = max(most[key], n)
            return _finished("keyed") == len(rows)
        except DatabaseError:
            connections.close_all()
            return False

    wait_for(lambda: sample() or _finished("keyed") >= 60, timeout=120, interval=0.005)
    connections.close_all()
    run_command(stop)
    time.sleep(2)
    run_command(start)
    wait_for(_accepts_connections, timeout=120, interval=0.1)
    wait_for(sample, timeout=240, interval=0.005)
    assert group.stop() == [0, 0], group.report()
    assert max(most.values()) <= 1, most
    assert effects("keyed") == dict.fromkeys(customer_of, 1)


if SERVER:
    test_per_key_limits_hold_across_a_server_restart = per_key_limits_hold_across_a_server_restart
    test_a_server_that_does_not_answer_is_waited_for_then_reported_in_one_line = (
        a_server_that_does_not_answer_is_waited_for_then_reported_in_one_line)
    test_a_coordinator_started_while_the_server_is_down_waits_then_works = (
        a_coordinator_started_while_the_server_is_down_waits_then_works)
    test_a_server_restart_mid_run_is_one_outage_and_work_resumes_at_once = (
        a_server_restart_mid_run_is_one_outage_and_work_resumes_at_once)
    test_a_deadlock_is_retried_at_once_never_an_outage = (
        a_deadlock_is_retried_at_once_never_an_outage)
    test_rows_a_frozen_coordinator_holds_locked_wait_at_most_a_lease = (
        rows_a_frozen_coordinator_holds_locked_wait_at_most_a_lease)
