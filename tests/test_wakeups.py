"""An idle coordinator notices new work at once: NOTIFY on PostgreSQL, the change probe on
MariaDB and SQLite -- not after its poll back-off has grown to MAX_POLL_SECONDS."""

import time

import pytest

from django_dbworker import Coordinator
from tests.helpers import execution, wait_for
from tests.testapp.models import Document

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_first_row_after_a_long_idle_is_picked_up_at_once():
    coordinator = Coordinator(["docs"], poll_seconds=0.25, max_poll_seconds=10)
    coordinator.start()
    try:
        time.sleep(4)  # idle: the back-off has doubled to 4 s and more (0.25 .. 10)
        started = time.monotonic()
        doc = Document.objects.create()
        wait_for(lambda: execution("docs", doc).status == "finished", timeout=30, interval=0.01)
        waited = time.monotonic() - started
    finally:
        coordinator.stop()
    # Without a wake-up the row would wait for the next poll: 2 s or more by now.
    assert waited < 1.5, f"picked up {waited:.2f}s after the insert"
    print(f"\npicked up and finished {waited * 1000:.0f} ms after the insert")
