"""SPEC guarantees that had no test of their own, each on every database it applies to."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from django.db import IntegrityError, connection, transaction
from django.db.models import F, Q
from django.utils import timezone

import django_dbworker
from django_dbworker import Coordinator
from django_dbworker.bridge import Bridge
from django_dbworker.installation import install
from django_dbworker.models import Execution
from django_dbworker.registry import Worker, registry
from tests.helpers import claim, execution, run_with_settings
from tests.testapp.models import Author, Document

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


@pytest.mark.skipif(connection.vendor == "sqlite", reason="SQLite has one writer: a locked "
                    "row cannot be skipped there (claims take the write lock instead)")
def test_a_row_locked_by_another_transaction_is_skipped_not_waited_for():
    docs = [Document.objects.create() for _ in range(3)]
    first = execution("docs", docs[0])
    holder = Bridge()
    try:
        with holder.engine.connect() as conn:
            conn.exec_driver_sql(
                f"SELECT id FROM django_dbworker_execution WHERE id = {first.pk} FOR UPDATE")
            started = time.monotonic()
            claims = claim("docs", limit=3)  # another coordinator, while the lock is held
            took = time.monotonic() - started
            conn.rollback()
    finally:
        holder.close()
    assert {c.execution_id for c in claims} == {execution("docs", d).pk for d in docs[1:]}
    assert took < 2, f"the claim waited {took:.1f}s for the locked row"


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


def test_eligible_with_q_and_nulls_last_orders_a_real_claim():
    w = Worker(name="nulls_test", source=Document, handler=_nulls_handler,
               eligible=lambda: Document.objects.filter(Q(uploaded=True) | Q(title="x"))
               .order_by(F("author__rank").asc(nulls_last=True), "id"))
    registry.register(w)
    try:
        install("default", [w])
        low, high = Author.objects.create(name="l", rank=1), Author.objects.create(name="h", rank=5)
        none_first = Document.objects.create(author=None)
        late_high = Document.objects.create(author=high)
        early_low = Document.objects.create(author=low)
        Document.objects.create(uploaded=False, title="not eligible")
        claims = claim("nulls_test", limit=10)
    finally:
        registry.unregister("nulls_test")
        install("default")
    assert [c.source_id for c in claims] == [str(d.pk) for d in (early_low, late_high, none_first)]


def test_engine_options_and_the_poll_settings_take_effect(settings):
    settings.DBWORKER = {**settings.DBWORKER, "ENGINE_OPTIONS": {"pool_size": 1, "max_overflow": 0},
                         "POLL_SECONDS": 0.07, "MAX_POLL_SECONDS": 0.7, "LEASE_SECONDS": 4}
    bridge = Bridge()
    try:
        assert bridge.engine.pool.size() == 1
    finally:
        bridge.close()
    options = Coordinator(["docs"]).settings
    assert (options.poll_seconds, options.max_poll_seconds, options.lease_seconds) == (0.07, 0.7, 4)


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
