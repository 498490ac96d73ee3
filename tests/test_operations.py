"""Running it in production: /metrics, /healthz and /readyz; dbworker_status and
dbworker_health; pausing a worker; signals and failure logs; the why-not-running view."""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.error
import urllib.request

import pytest
from django.contrib.admin.models import LogEntry
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection
from django.urls import reverse

from django_dbworker import Coordinator
from django_dbworker.admin.diagnosis import diagnose
from django_dbworker.models import CoordinatorHeartbeat, Execution, WorkerPause
from django_dbworker.operations.metrics import BACKLOG_MAX_AGE
from django_dbworker.pauses import pause, resume
from tests.helpers import (
    analyze,
    drain,
    effects,
    execute,
    execution,
    mark_failed,
    runworkers,
    settings_module,
    wait_for,
)
from tests.processes import Output, process_state
from tests.testapp.models import Document, SignalSeen, Tag

pytestmark = pytest.mark.django_db(transaction=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The samples of a /metrics page, through prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    found = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            found[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return found


# -- metrics and probes ---------------------------------------------------------------------
def test_metrics_count_what_happened_and_the_probes_say_how_it_is():
    port = free_port()
    docs = Document.objects.bulk_create([Document() for _ in range(3)] + [Document(behaviour="fail")])
    proc = runworkers("--worker", "docs", "--metrics-port", str(port))
    output = Output(proc)
    try:
        wait_for(lambda: Execution.objects.filter(worker="docs", status__in=["finished", "failed"])
                 .count() == 4, timeout=60)
        wait_for(lambda: get(port, "/readyz")[0] == 200, timeout=30)
        status, text = get(port, "/metrics")
        assert status == 200
        m = samples(text)
        print("\n" + "\n".join(line for line in text.splitlines()
                                if line.startswith("dbworker_") and "_bucket" not in line))
        labels = (("queue", ""), ("worker", "docs"))
        assert m[("dbworker_claimed_total", labels)] == 4
        assert m[("dbworker_finished_total", labels)] == 3
        assert m[("dbworker_failed_total", labels)] == 1
        assert m[("dbworker_handler_duration_seconds_count", labels)] == 4
        assert m[("dbworker_pickup_latency_seconds_count", labels)] == 4
        assert m[("dbworker_pending_rows", labels)] == 0
        waiting = Document.objects.create(uploaded=False)  # pending, not eligible: counted
        # (The backlog gauges are read at most every BACKLOG_MAX_AGE seconds.)
        m = wait_for(lambda: (found := samples(get(port, "/metrics")[1]))[
            ("dbworker_pending_rows", labels)] == 1 and found, timeout=BACKLOG_MAX_AGE + 10,
            interval=0.5)
        assert 0 <= m[("dbworker_oldest_pending_age_seconds", labels)] < 60
        Execution.objects.filter(worker="docs", source_id=str(waiting.pk)).update(
            created_at="2020-01-01T00:00:00Z")  # a row pending for years
        wait_for(lambda: samples(get(port, "/metrics")[1])[
            ("dbworker_oldest_pending_age_seconds", labels)] > 86400,
            timeout=BACKLOG_MAX_AGE + 10, interval=0.5)
        health = json.loads(get(port, "/healthz")[1])
        assert health == {"ok": True, "loop_alive": True, "database": True,
                          "children_ready": True, "stopping": False}
    finally:
        proc.terminate()
        assert output.wait(timeout=60) == 0, output.err
    assert len(docs) == 4


def test_a_metrics_port_in_use_stops_set_up_and_leaves_nothing_behind():
    """Set-up fails late, after the children started and the coordinator listened (or
    rang its doorbell) and recorded itself: all of that is undone, not left to the
    process's end (a coordinator embedded in a longer-lived process would leak it)."""
    import multiprocessing

    before = set(multiprocessing.active_children())
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        coordinator = Coordinator(["docs"], metrics_port=taken.getsockname()[1])
        with pytest.raises(OSError):
            coordinator.start()
    left = set(multiprocessing.active_children()) - before
    for process in left:  # (so that a failure here fails, not hangs the run at exit)
        process.kill()
    assert not left, "its children were left running"
    assert coordinator.wakeups.listener is None and coordinator.wakeups.doorbell is None
    assert not CoordinatorHeartbeat.objects.exists()


def test_the_counters_count_unfinished_retried_and_crashed_runs():
    from tests.testapp.models import FaultJob

    port = free_port()
    steps = Document.objects.create(behaviour="steps:3")  # Unfinished() twice, then done
    tag = Tag.objects.create(slug="retry-counted")        # "retrying": 3 attempts, all fail
    job = FaultJob.objects.create(behaviour="crash_retry")  # its child dies; retried in 1 h
    proc = runworkers("--worker", "docs", "--worker", "retrying", "--worker", "crash_retry",
                      "--metrics-port", str(port))
    output = Output(proc)
    try:
        wait_for(lambda: execution("docs", steps).status == "finished"
                 and execution("retrying", tag).status == "failed"
                 and execution("crash_retry", job).next_attempt_at is not None, timeout=60)
        # (The coordinator counts a run when its child's report arrives, just after the
        # run's commit: read until the last reports are in.)
        expected = {("unfinished_total", "docs"): 2, ("finished_total", "docs"): 1,
                    ("retried_total", "retrying"): 2, ("failed_total", "retrying"): 1,
                    ("claimed_total", "retrying"): 3, ("crashed_total", "crash_retry"): 1,
                    ("released_total", "crash_retry"): 1, ("retried_total", "crash_retry"): 1,
                    ("busy_children", "docs"): 0}

        def read() -> dict:
            found = samples(get(port, "/metrics")[1])
            return {key: found.get((f"dbworker_{key[0]}", (("queue", ""), ("worker", key[1]))))
                    for key in expected}

        try:
            wait_for(lambda: read() == expected, timeout=30)
        except AssertionError:
            pass  # the assertions below say which figure is off
        m = read()
    finally:
        proc.terminate()
        assert output.wait(timeout=60) == 0, output.err

    def count(name: str, worker: str) -> float:
        return m[(name, worker)]

    assert (count("unfinished_total", "docs"), count("finished_total", "docs")) == (2, 1)
    assert (count("retried_total", "retrying"), count("failed_total", "retrying")) == (2, 1)
    assert count("claimed_total", "retrying") == 3
    # A child that died mid-handler: crashed, its row released, and (with max_attempts) the
    # attempt counted as a failed one with a retry left.
    assert (count("crashed_total", "crash_retry"), count("released_total", "crash_retry"),
            count("retried_total", "crash_retry")) == (1, 1, 1)
    assert count("busy_children", "docs") == 0  # nothing running once all is done


def test_readyz_says_not_ready_while_the_database_is_down(tmp_path):
    """The coordinator's database health is what /readyz reports: an outage makes it 503
    (and /healthz stays 200: restarting would not help)."""
    from django_dbworker.operations.probes import ProbeServer

    port = free_port()
    state = {"last_pass": time.monotonic(), "database": False, "children_ready": True,
             "stopping": False}
    from prometheus_client import CollectorRegistry

    server = ProbeServer(port, CollectorRegistry(), lambda: state, host="127.0.0.1")
    server.start()
    try:
        assert get(port, "/readyz")[0] == 503 and get(port, "/healthz")[0] == 200
        state["database"] = True
        assert get(port, "/readyz")[0] == 200
        state["last_pass"] = time.monotonic() - 60  # a loop stuck for a minute
        assert get(port, "/healthz")[0] == 503
        assert get(port, "/nope")[0] == 404
    finally:
        server.stop()


def test_a_frozen_or_killed_coordinator_fails_its_probes_and_dbworker_health():
    """What an orchestrator sees. Frozen (SIGSTOP: a debugger, a suspended VM), the probe
    thread is frozen too: /healthz does not answer, which Kubernetes counts as a failure
    (timeoutSeconds), and dbworker_health fails once the heartbeat is a lease old. Resumed,
    both pass again. Killed, the port refuses and dbworker_health fails the same way."""
    import signal

    port = free_port()
    proc = runworkers("--worker", "docs", "--metrics-port", str(port))
    output = Output(proc)

    def healthy() -> bool:
        try:
            call_command("dbworker_health", "--worker", "docs")
        except CommandError:
            return False
        return True

    def probe() -> int | None:
        """/healthz's status, or None when it does not answer within 2 s."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                return r.status
        except urllib.error.HTTPError as exc:
            return exc.code
        except (urllib.error.URLError, TimeoutError, ConnectionError):
            return None

    try:
        wait_for(lambda: probe() == 200 and healthy(), timeout=60)
        os.killpg(proc.pid, signal.SIGSTOP)  # the coordinator and its children
        try:
            # (A signal stops a process soon, not at once: on a busy machine the probe
            # server could answer one more probe first.)
            wait_for(lambda: all(process_state(int(t)) in ("T", None) for t in
                                 os.listdir(f"/proc/{proc.pid}/task")), timeout=10)
            assert probe() is None
            wait_for(lambda: not healthy(), timeout=15)
            with pytest.raises(CommandError, match="worker docs: no live coordinator runs it"):
                call_command("dbworker_health", "--worker", "docs")
        finally:
            os.killpg(proc.pid, signal.SIGCONT)
        wait_for(lambda: probe() == 200 and healthy(), timeout=30)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        assert probe() is None
        wait_for(lambda: not healthy(), timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
        output.wait(timeout=30)


# -- status and health commands -------------------------------------------------------------
def test_dbworker_status_json(capsys):
    docs = Document.objects.bulk_create([Document() for _ in range(3)])
    mark_failed(Execution.objects.filter(worker="docs", source_id=str(docs[0].pk)))
    CoordinatorHeartbeat.objects.create(host="box", pid=7, workers="docs")
    call_command("dbworker_status", "--json")
    report = json.loads(capsys.readouterr().out)
    assert report["workers"]["docs"]["counts"] == {
        "pending": 2, "working": 0, "unfinished": 0, "finished": 0, "failed": 1}
    assert report["workers"]["docs"]["failed_last_hour"] == 1
    assert report["workers"]["docs"]["oldest_pending_seconds"] >= 0
    assert [(c["host"], c["pid"], c["live"]) for c in report["coordinators"]] == [("box", 7, True)]
    call_command("dbworker_status")
    text = capsys.readouterr().out
    assert "docs" in text and "1 live coordinator(s)" in text


def test_dbworker_health_fails_without_a_live_coordinator_or_with_old_rows():
    Document.objects.create()
    with pytest.raises(CommandError, match="worker docs: no live coordinator runs it"):
        call_command("dbworker_health", "--worker", "docs")
    CoordinatorHeartbeat.objects.create(host="box", pid=7, workers="docs")
    call_command("dbworker_health", "--worker", "docs")  # healthy
    Execution.objects.filter(worker="docs").update(created_at="2020-01-01T00:00:00Z")
    with pytest.raises(CommandError, match="the oldest pending row has waited"):
        call_command("dbworker_health", "--worker", "docs", "--max-pending-age", "60")


# -- pausing --------------------------------------------------------------------------------
def test_a_paused_worker_is_not_claimed_until_resumed():
    doc = Document.objects.create()
    assert pause("docs", by="ops") is True and pause("docs") is False
    assert drain("docs")["claimed"] == 0
    assert execution("docs", doc).status == "pending"
    assert resume("docs") is True and resume("docs") is False
    assert drain("docs")["finished"] == 1


def test_a_pause_reaches_a_running_coordinator_within_a_poll():
    # A long MAX_POLL_SECONDS: the fallback read of the pauses waits that long, so the
    # pause must arrive by NOTIFY (PostgreSQL) or be seen by the change probe (elsewhere).
    coordinator = Coordinator(["docs"], max_poll_seconds=10)
    coordinator.start()
    try:
        first = Document.objects.create()
        wait_for(lambda: execution("docs", first).status == "finished", timeout=30)
        # A handler running when the pause comes (5 s long) is let finish.
        running = Document.objects.create(behaviour="sleep:5")
        wait_for(lambda: execution("docs", running).status == "working", timeout=30,
                 interval=0.01)
        # (On SQLite the pause's write waits for the running handler's transaction, which
        # holds the one write lock: there the handler has finished once the pause is in.)
        call_command("dbworker_pause", "docs", "--reason", "incident")
        paused_at = time.monotonic()
        wait_for(lambda: "docs" in coordinator.paused, timeout=30, interval=0.01)
        # The fallback read would come only MAX_POLL_SECONDS (10 s) after the last one:
        # far sooner means NOTIFY or the probe told it.
        assert time.monotonic() - paused_at < 5
        if connection.vendor != "sqlite":
            assert execution("docs", running).status == "working"  # running when paused
        wait_for(lambda: execution("docs", running).status == "finished", timeout=30)
        assert execution("docs", running).attempts == 1  # finished, not stopped and re-run
        held = Document.objects.create()
        time.sleep(1.0)  # (a claim would take milliseconds)
        assert execution("docs", held).status == "pending"
        call_command("dbworker_resume", "docs")
        wait_for(lambda: execution("docs", held).status == "finished", timeout=30)
    finally:
        coordinator.stop()
    assert effects("docs") == {str(first.pk): 1, str(running.pk): 1, str(held.pk): 1}


def test_pausing_from_the_dashboard_needs_the_change_permission(admin_client, client,
                                                                django_user_model):
    from django.contrib.auth.models import Permission

    url = reverse("admin:django_dbworker_pause", args=["docs"])
    viewer = django_user_model.objects.create_user("viewer", password="pw", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_execution"))
    client.force_login(viewer)
    assert client.post(url, {"action": "pause"}).status_code == 403
    assert not WorkerPause.objects.exists()
    admin_client.post(url, {"action": "pause", "reason": "deploy"})
    pause_row = WorkerPause.objects.get()
    assert (pause_row.worker, pause_row.paused_by, pause_row.reason) == ("docs", "admin", "deploy")
    page = admin_client.get(reverse("admin:django_dbworker_dashboard"))
    assert 'data-paused="yes"' in page.text and "by admin" in page.text
    assert LogEntry.objects.filter(change_message="Paused.").count() == 1
    admin_client.post(url, {"action": "resume"})
    assert not WorkerPause.objects.exists()
    assert LogEntry.objects.filter(change_message="Resumed.").count() == 1


# -- hooks ----------------------------------------------------------------------------------
def test_signals_are_sent_after_the_outcome_committed_in_the_child():
    """Each receiver (tests/testapp/signals.py) runs in the child, outside any transaction,
    and reads the outcome the signal announces as committed."""
    ok, failing = Document.objects.create(), Document.objects.create(behaviour="fail")
    tag = Tag.objects.create(slug="retry-signalled")  # "retrying": fails 3 attempts of 3
    drain("docs")
    for _ in range(3):  # each retry is due after its back-off: make it due now
        Execution.objects.filter(worker="retrying").update(next_attempt_at=None)
        drain("retrying")
    seen = SignalSeen.objects.filter(kind__startswith="execution_").order_by("id")
    after = "after the commit"
    assert sorted(seen.values_list("kind", "key")) == sorted([
        ("execution_finished", f"docs:{ok.pk}:1:finished:{after}"),
        ("execution_failed", f"docs:{failing.pk}:1:failed:{after}"),
        ("execution_retried", f"retrying:{tag.pk}:1:unfinished:{after}"),
        ("execution_retried", f"retrying:{tag.pk}:2:unfinished:{after}"),
        ("execution_failed", f"retrying:{tag.pk}:3:failed:{after}"),
    ])
    assert os.getpid() not in set(seen.values_list("pid", flat=True))  # sent by the child


def test_a_failure_is_logged_with_the_exception_for_logging_integrations(tmp_path):
    """A handler of the project's LOGGING (a logging integration's place) receives, from
    the child, the failure at ERROR with its exc_info when no retry is left, and at
    WARNING while retries remain."""
    records = tmp_path / "records.jsonl"
    env = settings_module(tmp_path, f"""
        LOGGING = {{"version": 1, "disable_existing_loggers": False,
                   "formatters": {{"plain": {{"format": "%(message)s"}}}},
                   "handlers": {{"records": {{"class": "tests.testapp.logrecords.RecordFile",
                                            "path": {str(records)!r}, "formatter": "plain"}}}},
                   "loggers": {{"django_dbworker.child": {{"handlers": ["records"],
                                                          "level": "INFO"}}}}}}
    """)
    failing = Document.objects.create(behaviour="fail")
    tag = Tag.objects.create(slug="retry-logged")  # the "retrying" worker: 3 attempts
    proc = runworkers("--worker", "docs", "--worker", "retrying", env=env)
    output = Output(proc)
    try:
        wait_for(lambda: execution("docs", failing).status == "failed"
                 and execution("retrying", tag).status == "failed", timeout=60)
    finally:
        proc.terminate()
        assert output.wait(timeout=60) == 0, output.err
    lines = [json.loads(x) for x in records.read_text().splitlines()]
    failures = [r for r in lines if "failed on attempt" in r["message"]]
    print("\n" + "\n".join(f"{r['level']} {r['message']}" for r in failures))
    docs = [r for r in failures if f"source {failing.pk})" in r["message"]
            and r["message"].startswith("Worker docs")]
    assert [(r["level"], r["exc_type"]) for r in docs] == [("ERROR", "ValueError")]
    assert "attempt 1 of 1" in docs[0]["message"]
    assert "raise ValueError" in docs[0]["traceback"]  # the handler's own traceback
    tags = [r for r in failures if r["message"].startswith("Worker retrying")]
    assert [(r["level"], r["exc_type"]) for r in tags] == [
        ("WARNING", "RuntimeError"), ("WARNING", "RuntimeError"), ("ERROR", "RuntimeError")]


# -- why is this row not running? -------------------------------------------------------------
def test_why_names_what_blocks_a_row():
    doc = Document.objects.create(uploaded=False)
    findings = diagnose("docs", doc)
    assert {f.what for f in findings if f.blocking} == {"eligible", "condition", "coordinators"}
    [condition] = [f for f in findings if f.what == "condition"]
    assert "uploaded" in condition.detail
    dependent = {f.what: f for f in diagnose("summaries", doc)}
    assert dependent["eligible"].blocking
    assert "waits for worker docs" in dependent["condition"].detail
    pause("docs")
    Document.objects.filter(pk=doc.pk).update(uploaded=True)
    CoordinatorHeartbeat.objects.create(host="box", pid=7, workers="docs")
    assert {f.what for f in diagnose("docs", doc) if f.blocking} == {"paused"}
    resume("docs")
    assert not [f for f in diagnose("docs", doc) if f.blocking]


def test_the_why_page_and_its_links(admin_client):
    doc = Document.objects.create(uploaded=False)
    e = execution("docs", doc)
    url = reverse("admin:django_dbworker_why", args=["docs", e.source_id])
    page = admin_client.get(url)
    assert page.status_code == 200
    assert 'data-what="eligible" data-blocking="yes"' in page.text
    assert url in admin_client.get(reverse("admin:django_dbworker_execution_change",
                                           args=[e.pk])).text
    assert url in admin_client.get(reverse("admin:testapp_document_changelist")).text


def test_the_dashboard_fragment_and_chart(admin_client):
    docs = Document.objects.bulk_create([Document() for _ in range(3)])
    drain("docs")
    mark_failed(Execution.objects.filter(worker="docs", source_id=str(docs[0].pk)))
    fragment = admin_client.get(reverse("admin:django_dbworker_dashboard") + "?fragment=1")
    assert fragment.status_code == 200
    assert "<html" not in fragment.text and 'data-worker="docs"' in fragment.text
    assert fragment.text.count('class="dbworker-bar-finished"') >= 1
    assert "dbworker-bar-failed" in fragment.text


# -- the gauges and the chart read indexes, never the history ------------------------------
def _plan(bridge, sql: str) -> str:
    from django.db import connection

    prefix = "EXPLAIN QUERY PLAN " if connection.vendor == "sqlite" else "EXPLAIN "
    return "\n".join(" ".join(map(str, r)) for r in execute(bridge, prefix + sql))


def test_the_gauges_and_the_chart_read_indexes_not_the_history():
    """A large finished history (DBWORKER_EXPLAIN_HISTORY, default 100,000; the docs' figure
    is 1,000,000) and a small backlog: the /metrics gauges' two statements and the
    dashboard chart's query are index reads whose plans never scan the Execution table."""
    from datetime import UTC, datetime, timedelta

    from django.db import connection
    from django.utils import timezone

    from django_dbworker.admin.dashboard import chart_query
    from django_dbworker.registration.registry import registry
    from django_dbworker.store.bridge import Bridge

    n = int(os.environ.get("DBWORKER_EXPLAIN_HISTORY", "100000"))
    old = datetime(2020, 1, 1, tzinfo=UTC)
    Execution.objects.bulk_create(
        [Execution(worker="docs", source_id=f"h{i}", status="finished", finished_at=old,
                   attempts=1) for i in range(n)], batch_size=5000)
    Document.objects.bulk_create([Document(title=f"b{i}") for i in range(20)])  # the backlog
    analyze(Execution)
    hour_ago = timezone.now() - timedelta(hours=1)
    chart = chart_query(Execution.objects.all(), hour_ago)  # what the dashboard runs
    bridge = Bridge()
    try:
        import sqlalchemy as sa

        e = bridge.execution
        gauge = sa.select(e.c.claimable_worker, sa.func.count(), sa.func.min(e.c.id)).where(
            e.c.claimable_worker.in_(["docs"])).group_by(e.c.claimable_worker)
        gauge_sql = str(gauge.compile(bridge.engine, compile_kwargs={"literal_binds": True}))
        backlog = bridge.backlog([registry["docs"]])
        plans = {"gauges": _plan(bridge, gauge_sql), "chart": chart.explain()}
    finally:
        bridge.close()
    print("\n\n".join(f"{k}:\n{v}" for k, v in plans.items()))
    assert backlog["docs"][0] == 20  # the history is not counted as backlog
    table = Execution._meta.db_table
    for name, plan in plans.items():
        if connection.vendor == "postgresql":
            assert f"Seq Scan on {table}" not in plan, (name, plan)
        elif connection.vendor == "mysql":
            assert not any(f" {table} ALL " in f" {line} " for line in plan.splitlines()), (name, plan)
        else:
            # (SCAN ... USING INDEX is still a walk over every row: SEARCH is a range.)
            assert f"SCAN {table}" not in plan, (name, plan)
