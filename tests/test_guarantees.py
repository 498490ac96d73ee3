"""SPEC guarantees that had no test of their own, each on every database it applies to."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from django.db import IntegrityError, connection, transaction
from django.db.models import F, Q
from django.utils import timezone

import django_dbworker
from django_dbworker import Coordinator
from django_dbworker.installation.triggers import install
from django_dbworker.models import Execution
from django_dbworker.registration.registry import Worker, registry
from django_dbworker.store.bridge import Bridge
from tests.helpers import (
    claim,
    effects,
    execution,
    run_with_settings,
    runworkers,
    wait_for,
    without_trigger,
)
from tests.testapp.models import Author, Document, Tag

pytestmark = pytest.mark.django_db(transaction=True)


def test_lost_claim_and_outcome_are_exported():
    from django_dbworker import LostClaim, Outcome  # noqa: F401

    assert {"LostClaim", "Outcome"} <= set(django_dbworker.__all__)


def test_one_execution_per_worker_and_source_key():
    doc = Document.objects.create()
    with pytest.raises(IntegrityError), transaction.atomic():
        Execution.objects.create(worker="docs", source_id=str(doc.pk), status="pending")


def test_every_worker_runs_by_default_and_worker_can_be_repeated():
    assert [w.name for w in Coordinator().workers] == list(registry)
    assert [w.name for w in Coordinator(["docs", "summaries"]).workers] == ["docs", "summaries"]


def _drained_workers(err: str) -> set[str]:
    """The workers a runworkers banner names ("docs x2, summaries x1; database ...")."""
    [banner] = [line for line in err.splitlines() if "django-dbworker coordinator" in line]
    listed = banner.split(": ", 2)[2].split(";")[0]
    return {item.rsplit(" x", 1)[0] for item in listed.split(", ")}


def test_runworkers_runs_every_worker_by_default_and_worker_can_be_repeated():
    doc = Document.objects.create()
    tag = Tag.objects.create(slug="plain")
    proc = runworkers("--drain", "--worker", "docs", "--worker", "tags")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert _drained_workers(err) == {"docs", "tags"}
    assert (effects("docs"), effects("tags"), effects("summaries")) == (
        {str(doc.pk): 1}, {tag.pk: 1}, {})  # (summaries waits for docs: not asked for)
    # Every worker, one child each: which workers run is the question, not how many
    # children (62 children took a minute of CI to start, 40 take two thirds of it).
    one_each = [arg for name, n in Coordinator().settings.concurrency.items() if n > 1
                for arg in ("--concurrency", f"{name}=1")]
    proc = runworkers("--drain", *one_each)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err
    # Every worker, task queues included.
    assert {"docs", "summaries", "tags", "uuids", "stress", "tasks.default.default"} <= _drained_workers(err)
    assert effects("summaries") == {str(doc.pk): 1}


def test_missing_triggers_from_the_command_line_are_one_line_and_a_non_zero_exit():
    with without_trigger("dbworker_tags_ins", Tag):
        proc = runworkers("--drain", "--worker", "tags")
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Triggers missing for worker(s) tags" in lines[0], err
    assert "manage.py migrate" in lines[0] and "Traceback" not in err


@pytest.mark.skipif(connection.vendor == "sqlite", reason="SQLite has one writer: a locked "
                    "row cannot be skipped there (claims take the write lock instead)")
@pytest.mark.parametrize("worker", ["docs", "ordered_desc"])  # one statement; lock, then claim
def test_a_row_locked_by_another_transaction_is_skipped_not_waited_for(worker):
    docs = [Document.objects.create(priority=3 - i) for i in range(3)]
    first = execution(worker, docs[0])
    holder = Bridge()
    claimed: list = []
    try:
        with holder.engine.connect() as conn:
            conn.exec_driver_sql(
                f"SELECT id FROM django_dbworker_execution WHERE id = {first.pk} FOR UPDATE")
            # Another coordinator claims while the lock is held (in a thread: a claim that
            # waits for the lock would otherwise wait for this test forever).
            claimer = threading.Thread(target=lambda: claimed.extend(claim(worker, limit=3)),
                                       daemon=True)
            started = time.monotonic()
            claimer.start()
            claimer.join(timeout=10)
            took = time.monotonic() - started
            waited = claimer.is_alive()
            conn.rollback()  # (a waiting claim goes on now)
            claimer.join(timeout=30)
    finally:
        holder.close()
    assert not waited, f"the claim waited for the locked row ({took:.0f}s and counting)"
    assert {c.execution_id for c in claimed} == {execution(worker, d).pk for d in docs[1:]}
    assert took < 5, f"the claim took {took:.1f}s"


def test_drain_does_not_wait_for_rows_another_live_coordinator_holds():
    held, free = Document.objects.create(), Document.objects.create()
    [mine] = claim("docs", limit=1, claimer="other-host:1")  # alive: its lease runs for an hour
    assert mine.source_id == str(held.pk)
    Execution.objects.filter(pk=mine.execution_id).update(
        lease_expires_at=timezone.now() + timedelta(hours=1))
    started = time.monotonic()
    stats = Coordinator(["docs"]).drain()
    assert time.monotonic() - started < 30
    assert stats["claimed"] == 1 and execution("docs", free).status == "finished"
    assert execution("docs", held).status == "working"  # left to its holder


def test_no_workers_is_one_line_and_a_non_zero_exit(tmp_path):
    # (Task queues of our backend are workers too: none here either.)
    code, out, err = run_with_settings(tmp_path, """
        DBWORKER = {**DBWORKER, "WORKER_MODULES": []}
        try:
            import django.tasks as _tasks  # Django 6
        except ImportError:
            import django_tasks as _tasks  # Django 5.2: the backport
        TASKS = {"default": {"BACKEND": _tasks.__name__ + ".backends.immediate.ImmediateBackend"}}
    """)
    assert code == 1, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "No workers are registered" in lines[0], err


def _nulls_handler(doc):  # module level: children import handlers by path
    return None


# Each database puts NULL somewhere by default (PostgreSQL: last ascending, first
# descending; MariaDB and SQLite the other way round): each case differs from some
# database's default, so a claim that dropped nulls_first/nulls_last fails somewhere.
@pytest.mark.parametrize("order,expected", [
    (F("author__rank").asc(nulls_last=True), ["low", "high", "none"]),
    (F("author__rank").asc(nulls_first=True), ["none", "low", "high"]),
    (F("author__rank").desc(nulls_last=True), ["high", "low", "none"]),
    (F("author__rank").desc(nulls_first=True), ["none", "high", "low"]),
], ids=["asc-nulls-last", "asc-nulls-first", "desc-nulls-last", "desc-nulls-first"])
def test_eligible_with_q_and_nulls_ordering_orders_a_real_claim(order, expected):
    w = Worker(name="nulls_test", source=Document, handler=_nulls_handler,
               eligible=lambda: Document.objects.filter(Q(uploaded=True) | Q(title="x"))
               .order_by(order, "id"))
    registry.register(w)
    try:
        install("default", [w])
        low, high = Author.objects.create(name="l", rank=1), Author.objects.create(name="h", rank=5)
        # Created in an order that no case expects, so the id tie-break proves nothing.
        docs = {"high": Document.objects.create(author=high),
                "none": Document.objects.create(author=None),
                "low": Document.objects.create(uploaded=False, title="x", author=low)}
        Document.objects.create(uploaded=False, title="not eligible", author=low)
        claims = claim("nulls_test", limit=10)
    finally:
        registry.unregister("nulls_test")
        install("default")
    assert [c.source_id for c in claims] == [str(docs[k].pk) for k in expected]


def test_engine_options_and_the_lease_and_poll_settings_reach_the_coordinator(settings):
    settings.DBWORKER = {**settings.DBWORKER, "ENGINE_OPTIONS": {"pool_size": 3, "max_overflow": 0},
                         "POLL_SECONDS": 0.07, "MAX_POLL_SECONDS": 0.7, "LEASE_SECONDS": 4}
    bridge = Bridge()
    try:
        assert bridge.engine.pool.size() == 3  # (the package's own default is 2)
    finally:
        bridge.close()
    options = Coordinator(["docs"]).settings
    assert (options.poll_seconds, options.max_poll_seconds, options.lease_seconds) == (0.07, 0.7, 4)
    # What they do: test_wakeups (the poll back-off, set through these settings) and the
    # lease tests of test_crash (the 3 s lease of tests/settings.py).
    doc = Document.objects.create()
    running = Coordinator(["docs"])
    running.start()
    try:
        wait_for(lambda: execution("docs", doc).status == "finished", timeout=30)
        assert running.bridge is not None and running.bridge.engine.pool.size() == 3
    finally:
        running.stop()


def test_the_database_setting_chooses_the_coordination_database(tmp_path):
    """DBWORKER["DATABASE"] = "work": the coordinator, its claims and its children use the
    "work" alias. "default" here points nowhere (every model is routed to "work"), so a
    coordinator that used it could not even start."""
    nowhere = ('{"NAME": "/nonexistent-dir/db.sqlite3"}' if connection.vendor == "sqlite"
               else '{"HOST": "127.0.0.1", "PORT": "1"}')
    docs = [Document.objects.create() for _ in range(3)]
    code, out, err = run_with_settings(tmp_path, f"""
        DATABASES = {{"default": {{**DATABASES["default"], **{nowhere}}},
                     "work": DATABASES["default"]}}
        DBWORKER = {{**DBWORKER, "DATABASE": "work"}}


        class EverythingToWork:
            def db_for_read(self, model, **hints):
                return "work"

            def db_for_write(self, model, **hints):
                return "work"

            def allow_migrate(self, db, app_label, **hints):
                return db == "work"


        DATABASE_ROUTERS = [__name__ + ".EverythingToWork"]
    """, "--worker", "docs")
    assert code == 0, err
    assert "Drained: claimed 3, finished 3" in out, out
    assert effects("docs") == {str(d.pk): 1 for d in docs}
    # And the other way round: pointed at the alias that goes nowhere, it says so.
    code, out, err = run_with_settings(tmp_path, f"""
        DATABASES = {{**DATABASES, "work": {{**DATABASES["default"], **{nowhere}}}}}
        DBWORKER = {{**DBWORKER, "DATABASE": "work"}}
    """, "--worker", "docs", "--wait-for-database", "1")
    assert code == 1 and "database 'work'" in err.lower(), err


def test_worker_modules_replaces_autodiscovery(tmp_path):
    """DBWORKER["WORKER_MODULES"] lists the modules to import, instead of every app's
    workers.py (in a fresh interpreter: test modules import tests.testapp.workers)."""
    import json
    import subprocess
    import sys

    from tests.helpers import ROOT, settings_module, subprocess_env

    script = (
        "import json, sys, django\n"
        "django.setup()\n"
        "from django_dbworker import registry\n"
        "print(json.dumps({'autodiscovered': 'tests.testapp.workers' in sys.modules,\n"
        "                  'workers': sorted(registry)}))\n"
    )
    env = {**subprocess_env(), **settings_module(
        tmp_path, 'DBWORKER = {**DBWORKER, "WORKER_MODULES": ["tests.testapp.listed_workers"]}\n')}
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["autodiscovered"] is False
    assert "listed_only" in found["workers"] and "docs" not in found["workers"], found


def test_rows_run_in_one_transaction_keep_their_own_start_and_finish_times():
    """Quick rows share a transaction and one outcome UPDATE; each still gets the times
    of its own handler run, in the order they ran (one child: one after the other)."""
    from tests.testapp.models import StressJob

    StressJob.objects.bulk_create([StressJob(delay=0.012) for _ in range(12)])
    stats = Coordinator(["stress"], concurrency=1).drain()
    assert stats["finished"] == 12
    rows = list(Execution.objects.filter(worker="stress").order_by("id")
                .values_list("started_at", "finished_at"))
    assert all(s is not None and f is not None for s, f in rows), rows
    for started, finished in rows:
        assert finished - started >= timedelta(seconds=0.011), rows  # its own sleep
    for (_, before), (after, _) in zip(rows, rows[1:], strict=False):
        assert after >= before, rows  # the next began after this one ended
    assert len({s for s, _ in rows}) == 12, rows
