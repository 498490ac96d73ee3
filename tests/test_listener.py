"""Claims on the LISTEN connection (PostgreSQL): a claim answers the NOTIFY that woke the
coordinator on the connection that received it, whose server process is still awake.

What that must not cost: a notification that arrives while a claim runs on the connection
is read by the driver with the claim's result, not left on the socket; it must still wake
the coordinator. And a LISTEN connection that breaks must not take claims down with it."""

import os
import select

import pytest
import sqlalchemy as sa
from django.db import connection

from django_dbworker.bridge import DATABASE_ERRORS, Bridge, listener_for
from django_dbworker.registry import registry
from django_dbworker.watching import Watcher
from tests.testapp.models import Document

pytestmark = [
    pytest.mark.skipif(os.environ.get("DBWORKER_TEST_DB", "sqlite") != "postgres",
                       reason="LISTEN/NOTIFY is PostgreSQL's (PostgreSQL runs only)"),
    pytest.mark.django_db(transaction=True),
]


@pytest.fixture
def listening():
    bridge = Bridge()
    listener = listener_for(bridge)
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


def test_a_broken_listen_connection_fails_one_claim_then_claims_go_through_the_pool(listening):
    bridge, listener = listening
    pid = listener.run("SELECT pg_backend_pid()", {})[0][0]
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(%s)", [pid])
    doc = Document.objects.create()
    # The claim meets the broken connection: an error the outage handling knows, and
    # the row is still claimable (nothing was claimed).
    with pytest.raises(DATABASE_ERRORS) as failed:
        bridge.claim(registry["docs"], 5, "test:listener")
    assert isinstance(failed.value, sa.exc.DBAPIError)
    assert not listener.usable
    [claimed] = bridge.claim(registry["docs"], 5, "test:listener")  # through the pool
    assert claimed.source_id == str(doc.pk)


def test_a_closed_listener_is_not_used_for_claims(listening):
    bridge, listener = listening
    listener.close()  # (as the coordinator does when NOTIFY does not reach it)
    doc = Document.objects.create()
    [claimed] = bridge.claim(registry["docs"], 5, "test:listener")
    assert claimed.source_id == str(doc.pk)
