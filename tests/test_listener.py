"""Claims on the LISTEN connection (PostgreSQL): a claim answers the NOTIFY that woke the
coordinator on the connection that received it, whose server process is still awake.

What that must not cost: a notification that arrives while a claim runs on the connection
is read by the driver with the claim's result, not left on the socket; it must still wake
the coordinator. And a LISTEN connection that breaks must not take claims down with it."""

import os
import select

import pytest
from django.db import connection

from django_dbworker import Coordinator
from django_dbworker.coordinator.listening import listener_for
from django_dbworker.coordinator.watching import Watcher
from django_dbworker.registration.registry import registry
from django_dbworker.store.bridge import Bridge
from tests.helpers import execution, wait_for
from tests.testapp.models import Document

pytestmark = [
    pytest.mark.skipif(os.environ.get("DBWORKER_TEST_DB", "sqlite") != "postgres",
                       reason="LISTEN/NOTIFY is PostgreSQL's (PostgreSQL runs only)"),
    pytest.mark.django_db(transaction=True),
]


@pytest.fixture
def listening():
    bridge = Bridge()
    listener = listener_for(bridge, 0.02)
    yield bridge, listener
    listener.close()
    bridge.close()


def test_claims_run_on_the_listen_connection_and_a_notification_read_with_one_still_wakes(
        listening):
    bridge, listener = listening
    assert bridge.claim_listener is listener
    doc = Document.objects.create()  # its trigger NOTIFYs at commit
    assert select.select([listener], [], [], 10)[0], "no NOTIFY arrived"
    # The claim runs on the listener's connection, and the driver reads the waiting
    # notification from the socket along with the claim's result.
    [claimed] = bridge.claim(registry["docs"], 5, "test:listener")
    assert claimed.source_id == str(doc.pk)
    assert not select.select([listener], [], [], 0)[0]  # the socket no longer shows it
    # ... but the watcher does, at once, and the listener hands it over.
    ready = Watcher().wait([], listener, timeout=10.0)
    assert ready == [(None, listener)]
    assert "docs" in listener.drain()  # (and the other workers on Document)
    assert not listener.heard()  # handed over once


def test_a_listen_connection_that_breaks_under_a_claim_hands_it_to_the_pool_and_is_dropped(
        listening):
    bridge, listener = listening
    pid = listener.run("SELECT pg_backend_pid()", {})[0][0]
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(%s)", [pid])
    doc = Document.objects.create()
    # The claim meets the broken connection and runs again on a pool connection.
    [claimed] = bridge.claim(registry["docs"], 5, "test:listener")
    assert claimed.source_id == str(doc.pk)
    assert not listener.usable
    # Its socket is gone: the watcher reports it at once, and its drain() fails (the
    # coordinator then drops it and listens again).
    assert Watcher().wait([], listener, timeout=10.0) == [(None, listener)]
    import psycopg  # (here: the SQLite-only test environments have no psycopg)

    with pytest.raises(psycopg.Error):
        listener.drain()
    Document.objects.create()  # later claims: the pool's
    assert len(bridge.claim(registry["docs"], 5, "test:listener")) == 1


def test_a_coordinator_whose_listen_connection_is_killed_goes_on_picking_up_rows():
    coordinator = Coordinator(["docs"], poll_seconds=0.25, max_poll_seconds=10, lease_seconds=3)
    coordinator.start()
    try:
        first = Document.objects.create()
        wait_for(lambda: execution("docs", first).status == "finished", timeout=30)
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                           "WHERE pid <> pg_backend_pid() AND datname = current_database() "
                           "AND query LIKE %s", ["%dbw_claim%"])
            assert cursor.fetchone() is not None  # (the listener ran the last claim)
        docs = [Document.objects.create() for _ in range(3)]
        wait_for(lambda: all(execution("docs", d).status == "finished" for d in docs),
                 timeout=30)
        wait_for(lambda: coordinator.wakeups.listener is not None
                 and coordinator.wakeups.listener.usable, timeout=30)  # listening again
        last = Document.objects.create()
        wait_for(lambda: execution("docs", last).status == "finished", timeout=30)
    finally:
        coordinator.stop()


def test_a_closed_listener_is_not_used_for_claims(listening):
    bridge, listener = listening
    listener.close()  # (as the coordinator does when NOTIFY does not reach it)
    doc = Document.objects.create()
    [claimed] = bridge.claim(registry["docs"], 5, "test:listener")
    assert claimed.source_id == str(doc.pk)
