"""runworkers through a real PgBouncer in transaction pooling mode (scripts/services.sh
starts one on 127.0.0.1:6432 in front of the test PostgreSQL; another one can be named with
DBWORKER_TEST_PGBOUNCER_URL). PostgreSQL only.

- With DBWORKER["LISTEN_DATABASE"] naming a direct alias: claims and handlers go through
  PgBouncer, the one LISTEN connection goes straight to the server, and a NOTIFY wakes an
  idle coordinator at once (polling here only every 20 s).
- Without it: one WARNING at start ("NOTIFY does not reach ..."), then rows are found by
  the change probe and polling; a drain still runs every row exactly once.
- The core promises through it: two coordinators claiming one worker's rows while their
  children are SIGKILLed and then one coordinator is (claims, crash recovery, each row's
  effect once), a failing handler retried to its last attempt, and a coordinator frozen
  inside a claim, whose row locks the server ends after a lease (SET LOCAL of the idle
  timeout: no session settings behind a pooler).
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections import Counter
from urllib.parse import urlsplit

import pytest
from django.db import connection

from django_dbworker.models import CoordinatorHeartbeat, Execution
from tests.helpers import (
    effects,
    execution,
    lost_and_twice,
    runworkers,
    settings_module,
    wait_for,
)
from tests.processes import BANNER, Killer, Output
from tests.testapp.models import Document, StressJob, Tag

DB = os.environ.get("DBWORKER_TEST_DB", "sqlite")
PGBOUNCER_URL = os.environ.get("DBWORKER_TEST_PGBOUNCER_URL", "postgresql://root@127.0.0.1:6432/test")
pytestmark = [
    pytest.mark.skipif(DB != "postgres", reason="PgBouncer pools PostgreSQL connections only "
                       "(PostgreSQL runs only)"),
    pytest.mark.django_db(transaction=True),
    pytest.mark.solo,
]
WARNING = "NOTIFY does not reach"


@pytest.fixture(autouse=True)
def _pgbouncer():
    parts = urlsplit(PGBOUNCER_URL)
    try:
        socket.create_connection((parts.hostname, parts.port or 6432), timeout=3).close()
    except OSError as exc:
        reason = f"no PgBouncer at {parts.hostname}:{parts.port} ({exc}); scripts/services.sh starts one"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason}, and CI=true")
        pytest.skip(reason)
    yield
    # PgBouncer keeps server connections to the test database open in its pool: close
    # them, or the test database cannot be dropped at the end of the run.
    from tests.helpers import kill_started

    kill_started()
    name = connection.settings_dict["NAME"]
    if any(d["name"] == name for d in admin("SHOW DATABASES")):
        try:
            admin(f"KILL {name}")
        finally:
            admin(f"RESUME {name}")


def through_pgbouncer(tmp_path, listen_direct: bool, dbworker: str = "") -> dict[str, str]:
    """Settings: DATABASES["default"] through PgBouncer, "direct" straight to the server."""
    return settings_module(tmp_path, f"""
        from urllib.parse import urlsplit as _split
        _bouncer = _split({PGBOUNCER_URL!r})
        DATABASES["direct"] = dict(DATABASES["default"])
        DATABASES["default"] = {{**DATABASES["default"], "HOST": _bouncer.hostname,
                                 "PORT": str(_bouncer.port or 6432),
                                 "DISABLE_SERVER_SIDE_CURSORS": True}}
        DBWORKER = {{**DBWORKER, {'"LISTEN_DATABASE": "direct",' if listen_direct else ''} {dbworker}}}
    """)


def admin(command: str) -> list[dict]:
    """PgBouncer's admin console: SHOW CLIENTS, SHOW SERVERS, ..."""
    import psycopg

    parts = urlsplit(PGBOUNCER_URL)
    with psycopg.connect(host=parts.hostname, port=parts.port or 6432, dbname="pgbouncer",
                         user=parts.username or "root", autocommit=True) as conn:
        cur = conn.execute(command)
        if cur.description is None:  # KILL, RESUME: no rows
            return []
        names = [d.name for d in cur.description]
        return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]


def test_with_a_direct_listen_connection_notify_wakes_a_coordinator_behind_pgbouncer(tmp_path):
    # Polls 20 s apart, no change probe: a pickup within a second is a NOTIFY's doing.
    env = through_pgbouncer(tmp_path, listen_direct=True, dbworker=(
        '"POLL_SECONDS": 20, "MAX_POLL_SECONDS": 20, "PROBE_SECONDS": 20'))
    proc = runworkers("--worker", "docs", env=env)
    wait_for(lambda: CoordinatorHeartbeat.objects.filter(pid=proc.pid).exists(), timeout=60)
    name = connection.settings_dict["NAME"]

    def listening() -> set[int]:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pid FROM pg_stat_activity WHERE datname = %s "
                           "AND query LIKE 'LISTEN %%'", [name])
            return {pid for (pid,) in cursor.fetchall()}

    listeners = wait_for(listening, timeout=60)  # (it LISTENs once it has started)
    # Claims and handlers are PgBouncer's clients; LISTEN is on a server connection of
    # its own, not one of PgBouncer's.
    assert [c for c in admin("SHOW CLIENTS") if c["database"] == name]
    pooled = {s["remote_pid"] for s in admin("SHOW SERVERS")}
    assert not listeners & pooled, (listeners, pooled)

    pickups = []
    docs = []
    for _ in range(3):
        time.sleep(1)
        inserted = time.monotonic()
        doc = Document.objects.create()
        docs.append(doc)
        wait_for(lambda d=doc: execution("docs", d).status == "finished", timeout=30, interval=0.01)
        pickups.append(time.monotonic() - inserted)
    assert max(pickups) < 2.0, pickups  # well under the 20 s between polls
    more = Document.objects.bulk_create([Document() for _ in range(30)])
    wait_for(lambda: Execution.objects.filter(worker="docs", status="finished").count() == 33,
             timeout=60, interval=0.05)
    assert proc.poll() is None
    proc.terminate()
    _, err = proc.communicate(timeout=60)
    assert WARNING not in err, err
    assert "prepared statement" not in err, err  # none survives a pooled connection
    assert effects("docs") == {str(d.pk): 1 for d in [*docs, *more]}  # each once
    assert all(e.attempts == 1 for e in Execution.objects.filter(worker="docs"))
    print("pickup after insert:", ", ".join(f"{p * 1000:.0f} ms" for p in pickups))


def test_without_a_direct_listen_connection_it_warns_once_and_drains_by_polling(tmp_path):
    docs = Document.objects.bulk_create([Document() for _ in range(40)])
    failing = Document.objects.create(behaviour="fail")  # its handler raises: rolled back
    env = through_pgbouncer(tmp_path, listen_direct=False)
    started = time.monotonic()
    proc = runworkers("--drain", "--worker", "docs", env=env)
    out, err = proc.communicate(timeout=120)
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, err
    warnings = [line for line in err.splitlines() if WARNING in line]
    assert len(warnings) == 1 and "WARNING" in warnings[0], err
    assert "LISTEN_DATABASE" in warnings[0]
    assert "prepared statement" not in err, err
    assert effects("docs") == {str(d.pk): 1 for d in docs}  # each once, the failed one's undone
    assert execution("docs", failing).status == "failed"
    assert "cannot handle document" in execution("docs", failing).error_message
    assert Execution.objects.filter(worker="docs", status="finished").count() == len(docs)
    print(f"drained {len(docs) + 1} rows through PgBouncer by polling in {elapsed:.1f}s")


def test_two_coordinators_through_pgbouncer_with_processes_killed_run_every_row_once(tmp_path):
    """Claims, crash recovery and the token guard through transaction pooling: no claim
    or renewal depends on a session (each is one transaction). Children are SIGKILLed at
    random (their rows come back through their coordinator), then one coordinator is
    killed outright with its children (its rows come back to the other: same host, its
    pid gone, or by lease); no row is lost, none runs to completion twice."""
    count = 300
    StressJob.objects.bulk_create([StressJob(delay=0.02) for _ in range(count)])
    ids = {str(pk) for pk in StressJob.objects.values_list("pk", flat=True)}
    rows = Execution.objects.filter(worker="stress")
    env = through_pgbouncer(tmp_path, listen_direct=True)
    procs = [runworkers("--worker", "stress", "--concurrency", "stress=2", env=env)
             for _ in range(2)]
    outputs = [Output(p) for p in procs]
    wait_for(lambda: all(BANNER in o.err for o in outputs)
             or any(p.poll() is not None for p in procs), timeout=120, interval=0.1)
    assert all(p.poll() is None for p in procs), [o.err[-2000:] for o in outputs]
    killer = Killer([p.pid for p in procs])
    killer.start()
    try:
        wait_for(lambda: (rows.filter(status="finished").count() >= count // 3
                          and rows.filter(status="working",
                                          claimed_by__endswith=f":{procs[0].pid}").exists())
                 or any(p.poll() is not None for p in procs), timeout=180, interval=0.1)
        assert all(p.poll() is None for p in procs), [o.err[-2000:] for o in outputs]
        os.killpg(procs[0].pid, signal.SIGKILL)  # the coordinator and its children
        procs[0].wait(timeout=30)  # reaped: its pid is gone (a zombie would seem alive)
        wait_for(lambda: rows.filter(status="finished").count() == count
                 or procs[1].poll() is not None, timeout=180, interval=0.2,
                 state=lambda: Counter(rows.values_list("status", flat=True)))
    finally:
        killer.stop()
    procs[1].terminate()
    codes = [o.wait(timeout=120) for o in outputs]
    assert codes == [-signal.SIGKILL, 0], [o.err[-2000:] for o in outputs]
    assert all("prepared statement" not in o.err for o in outputs)
    lost, twice = lost_and_twice("stress", ids)
    assert (lost, twice) == (0, 0), (lost, twice)
    rerun = rows.filter(attempts__gt=1).count()
    assert len(killer.killed) >= 3 and rerun >= 1, (killer.killed, rerun)
    print(f"through PgBouncer: 2 coordinators x 2, {count} rows, {len(killer.killed)} child "
          f"kills and 1 coordinator killed, {rerun} rows run again, 0 lost, 0 twice")


def test_a_failing_handler_is_retried_to_its_last_attempt_through_pgbouncer(tmp_path):
    tag = Tag.objects.create(slug="retry-through-pgbouncer")
    proc = runworkers("--worker", "retrying", env=through_pgbouncer(tmp_path, listen_direct=True))
    output = Output(proc)
    try:
        wait_for(lambda: execution("retrying", tag).status == "failed", timeout=60)
    finally:
        proc.terminate()
        code = output.wait(timeout=60)
    assert code == 0, output.err
    row = execution("retrying", tag)
    assert row.attempts == 3, (row.attempts, output.err)
    assert "always fails" in row.error_message
    # Each attempt's effect was rolled back with it: the handler's writes never commit.
    assert effects("retrying") == {}


def test_a_coordinator_frozen_inside_a_claim_through_pgbouncer_holds_its_rows_a_lease_at_most(
        tmp_path):
    """Behind transaction pooling the coordinator makes no session settings; its
    transactions set the idle timeout for themselves (SET LOCAL), so the server still ends
    a frozen claim's transaction, and its row locks, after a lease."""
    from tests.test_outage import rows_a_frozen_coordinator_holds_locked_wait_at_most_a_lease

    rows_a_frozen_coordinator_holds_locked_wait_at_most_a_lease(
        tmp_path, env=through_pgbouncer(tmp_path, listen_direct=True))
