"""MariaDB: the change probe waits in the server (one statement that loops until the
probe's answer moves), so an idle coordinator sleeps on its socket instead of probing
on a timer, and still picks up a new row, or sees a pause, at once."""

import os
import select
import time

import pytest
from django.db import connection

from django_dbworker import Coordinator
from django_dbworker.coordinator.changewait import WAIT_SECONDS, ChangeWait
from django_dbworker.pauses import pause, resume
from django_dbworker.store.bridge import Bridge
from django_dbworker.vendors import ANY_WORKER_NOTICE, PAUSE_NOTICE
from tests.helpers import counting_probes, execution, seconds_to_claim, wait_for
from tests.testapp.models import Document

pytestmark = [
    pytest.mark.skipif(os.environ.get("DBWORKER_TEST_DB", "sqlite") != "mysql",
                       reason="waiting in the server is MariaDB's (MariaDB runs only)"),
    pytest.mark.django_db(transaction=True),
]


def readable(wait: ChangeWait, timeout: float) -> bool:
    return bool(select.select([wait], [], [], timeout)[0])


@pytest.fixture
def waiting():
    bridge = Bridge()
    wait = ChangeWait(bridge, 0.02)
    yield wait
    wait.close()
    bridge.close()


def test_the_wait_returns_when_rows_or_pauses_change_and_not_before(waiting):
    wait = waiting
    assert readable(wait, 5)  # the first answer comes at once: everything is woken
    assert wait.drain() == {ANY_WORKER_NOTICE, PAUSE_NOTICE}
    assert not readable(wait, 0.3)  # nothing changed: the statement still waits
    Document.objects.create()
    committed = time.monotonic()
    assert readable(wait, 5)
    print(f"\nrow seen {(time.monotonic() - committed) * 1000:.1f} ms after its commit")
    assert time.monotonic() - committed < 0.2
    assert wait.drain() == {ANY_WORKER_NOTICE}
    pause("docs")
    assert readable(wait, 5)
    assert wait.drain() == {PAUSE_NOTICE}
    resume("docs")
    assert readable(wait, 5)
    assert wait.drain() == {PAUSE_NOTICE}
    # With nothing changing, the statement ends after WAIT_SECONDS, and is sent again.
    started = time.monotonic()
    assert readable(wait, WAIT_SECONDS * 3)
    assert wait.drain() == set()
    assert time.monotonic() - started >= WAIT_SECONDS * 0.9


def test_the_wait_reads_without_locks(waiting):
    """Its reads take no row lock and wait for none: a read in a stored program's WHILE
    condition is a locking read, and it stalled the wait behind a transaction that held
    the newest row (and made claims skip the newest row while it held it)."""
    from django.db import transaction

    from django_dbworker.models import Execution

    wait = waiting
    assert readable(wait, 5)
    wait.drain()  # the baseline
    Document.objects.create()
    assert readable(wait, 5)
    assert wait.drain() == {ANY_WORKER_NOTICE}
    with transaction.atomic():
        newest = Execution.objects.select_for_update().order_by("-id").first()
        assert newest is not None
        # Held: the statement still answers (nothing changed) after WAIT_SECONDS.
        assert readable(wait, WAIT_SECONDS * 2.5), "the wait is stuck behind a row lock"
        assert wait.drain() == set()


def test_an_idle_coordinator_waits_in_the_server_and_picks_up_a_row_at_once():
    coordinator = Coordinator(["docs"], poll_seconds=0.25, max_poll_seconds=10)
    coordinator.start()
    waits: list[float] = []
    try:
        assert isinstance(coordinator.wakeups.listener, ChangeWait)
        probes = counting_probes(coordinator)  # the timer's probe: not used
        for _ in range(3):
            # Idle for 2.5 s each time: the poll back-off (0.25, 0.5, 1 s...) would claim
            # the row 0.75 s or more after its insert.
            time.sleep(2.5)
            waits.append(seconds_to_claim())
    finally:
        coordinator.stop()
    print(f"\nclaimed {[round(w * 1000) for w in waits]} ms after each insert")
    assert probes == []
    assert max(waits) < 0.5, waits


def test_a_wait_whose_connection_is_killed_gives_way_to_the_probe_then_comes_back():
    coordinator = Coordinator(["docs"], poll_seconds=0.25, max_poll_seconds=10,
                              lease_seconds=3)
    coordinator.start()
    try:
        first = coordinator.wakeups.listener
        assert isinstance(first, ChangeWait)
        with connection.cursor() as cursor:
            cursor.execute(f"KILL CONNECTION {first._conn.thread_id()}")
        # Until the next lease renewal waits again, the row is still found (the lost wait
        # woke every worker; then the timer's probe and the poll look).
        doc = Document.objects.create()
        wait_for(lambda: execution("docs", doc).status == "finished", timeout=10, interval=0.01)
        wait_for(lambda: isinstance(coordinator.wakeups.listener, ChangeWait)
                 and coordinator.wakeups.listener is not first, timeout=10)
        doc = Document.objects.create()
        wait_for(lambda: execution("docs", doc).status == "finished", timeout=10, interval=0.01)
    finally:
        coordinator.stop()


def test_a_wait_that_goes_silent_is_given_up_without_blocking(waiting, monkeypatch):
    """A statement that answers nothing long past WAIT_SECONDS lost its connection without
    a word (a partition): the wait says it is not usable, and drain() raises at once
    instead of blocking the coordinator on a read that may never end. (SILENT_SECONDS is
    made shorter than one statement here, so a healthy wait stands in for a silent one.)"""
    from django_dbworker.coordinator import changewait

    wait = waiting
    assert readable(wait, 5)
    wait.drain()
    assert wait.usable
    monkeypatch.setattr(changewait, "SILENT_SECONDS", 0.3 - WAIT_SECONDS)
    time.sleep(0.4)
    assert not readable(wait, 0)  # still waiting in the server
    assert not wait.usable
    started = time.monotonic()
    with pytest.raises(ConnectionError):
        wait.drain()
    assert time.monotonic() - started < 0.1
