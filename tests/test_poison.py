"""A row that kills its child every time (a "poison pill") never stops the rows behind it.

Before crashes counted, such a row was claimable again at once after each crash, and first
in every claim (claims go in id order): the worker crashed on it for ever and ran nothing
else (0 of 500 rows in 35 s, 104 crashes).
"""

import os
import time
from datetime import timedelta

import pytest
from django.db.models import Count
from django.utils import timezone

from django_dbworker import Coordinator
from django_dbworker.models import Execution
from django_dbworker.store.retry import MAX_CRASHES
from tests.helpers import execution, wait_for
from tests.testapp.models import Document, FaultJob

pytestmark = pytest.mark.django_db(transaction=True)
ROWS = 2_000  # (the poison row fails with at most 73 rows done, under load: 10,000 cost CI 110 s a lane)


def statuses(worker: str) -> dict[str, int]:
    return dict(Execution.objects.filter(worker=worker).values_list("status")
                .annotate(n=Count("*")))


def run_until(worker: str, concurrency: int, done, timeout: float = 180) -> float:
    """Seconds from start until ``done()`` holds, with one coordinator."""
    coordinator = Coordinator([worker], concurrency=concurrency)
    started = time.monotonic()
    coordinator.start()
    try:
        wait_for(done, timeout=timeout, interval=0.02)
        return time.monotonic() - started
    finally:
        coordinator.stop()


@pytest.mark.parametrize("concurrency", [1, 2])
def test_a_row_that_kills_its_child_is_quarantined_and_the_rows_behind_it_run(concurrency):
    bad = FaultJob.objects.create(behaviour="poison")  # first in id order: first claimed
    FaultJob.objects.bulk_create([FaultJob(behaviour="poison_ok") for _ in range(ROWS)])

    # Each crash waits its back-off (retry_backoff 0.2 s here), and the rows behind it run
    # meanwhile; a retry that is due is claimed while the backlog drains, not after it.
    # At max_crashes it ends FAILED, saying why, and nothing claims it again.
    seen: dict[str, int] = {}

    def poison_failed() -> bool:
        seen.update(statuses("poison"))
        return seen.get("failed") == 1

    seconds = run_until("poison", concurrency, poison_failed)
    print(f"\npoison row failed after {seconds:.1f}s, {seen.get('finished', 0)} of {ROWS} "
          f"rows finished by then (concurrency {concurrency})")
    assert seen.get("finished", 0) < ROWS
    seconds = run_until("poison", concurrency,
                        lambda: statuses("poison").get("finished") == ROWS)
    e = execution("poison", bad)
    assert e.crashes == MAX_CRASHES
    assert f"crashed its process {MAX_CRASHES} times in a row" in e.error_message
    assert e.next_attempt_at is None and e.claim_token is None
    assert statuses("poison") == {"finished": ROWS, "failed": 1}


def test_a_retry_is_claimed_while_the_backlog_drains_when_a_later_row_waits_too():
    """A busy worker looks for due rows every second even when it knows a later due time
    (a row waiting an hour here): the retries written since come before it."""
    later = FaultJob.objects.create(behaviour="poison_ok")
    Execution.objects.filter(worker="poison", source_id=str(later.pk)).update(
        status="unfinished", next_attempt_at=timezone.now() + timedelta(hours=1))
    bad = FaultJob.objects.create(behaviour="poison")
    FaultJob.objects.bulk_create([FaultJob(behaviour="poison_ok") for _ in range(ROWS)])
    seen: dict[str, int] = {}

    def poison_failed() -> bool:
        seen.update(statuses("poison"))
        return seen.get("failed") == 1

    run_until("poison", 1, poison_failed)
    assert seen.get("finished", 0) < ROWS, "the crash retries waited for the whole backlog"
    assert execution("poison", bad).status == "failed"
    assert execution("poison", later).status == "unfinished"


def test_crashes_wait_the_configured_back_off_and_count_only_in_a_row():
    """The retry after a crash is due retry_backoff (with jitter in [0.5, 1]) after it,
    on the database's clock; an outcome the handler commits clears the count."""
    bad = FaultJob.objects.create(behaviour="poison")
    seen = {}

    def crashed_twice() -> bool:  # (read while it waits: its next claim changes the times)
        e = execution("poison", bad)
        if e.crashes == 2 and e.status == "unfinished":
            seen["e"] = e
        return "e" in seen

    run_until("poison", 1, crashed_twice, timeout=60)
    e = seen["e"]
    # retry_backoff=0.2: crash 2 waits 0.2 * 2 * [0.5, 1] s from the release that wrote it
    # (both times from that one statement, on the database's clock): never the 10 s default.
    waits = (e.next_attempt_at - e.updated_at).total_seconds()
    assert 0.19 <= waits <= 0.41, waits

    FaultJob.objects.filter(pk=bad.pk).update(behaviour="poison_ok")  # the cure
    run_until("poison", 1, lambda: execution("poison", bad).status == "finished", timeout=30)
    assert execution("poison", bad).crashes == 0


@pytest.mark.skipif(os.environ.get("DBWORKER_TEST_DB", "sqlite") == "sqlite",
                    reason="a SQLite file has no connection to lose (PostgreSQL and MariaDB)")
def test_a_row_that_breaks_its_own_connection_every_time_ends_failed_not_looping():
    """An interrupted attempt (the connection broke under the handler) is retried at once,
    as an outage is no fault of the row's; but it counts as a crash in a row, so a handler
    that breaks its connection every time ends FAILED instead of looping (it was seen
    re-claimed 853 times in 20 s, holding up the rows claimed beside it)."""
    cut = Document.objects.create(behaviour="lose_connection", uploaded=True)
    fine = [Document.objects.create(uploaded=True) for _ in range(20)]
    run_until("docs", 1, lambda: execution("docs", cut).status == "failed", timeout=60)
    e = execution("docs", cut)
    assert e.crashes == MAX_CRASHES and e.error_type == "Interrupted"
    assert f"{MAX_CRASHES} times in a row" in e.error_message
    run_until("docs", 1, lambda: all(execution("docs", d).status == "finished" for d in fine),
              timeout=60)
