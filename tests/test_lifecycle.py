"""The state machine of an Execution row, transition by transition (the specification
of ``django_dbworker.store.transitions``), on every database.

Each transition runs both ways it is run in production: on a Django connection inside
the caller's transaction (the child, the admin, the API) and on the coordinator's
SQLAlchemy engine. Rows come from the real triggers; claims from the real claim.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import pytest
import sqlalchemy as sa
from django.db import transaction

from django_dbworker.models import Execution
from django_dbworker.status import ExecutionStatus
from django_dbworker.store import clock, transitions
from django_dbworker.store.bridge import Bridge
from django_dbworker.store.retry import RetryDecision
from django_dbworker.store.session import OnDjango, OnEngine
from django_dbworker.store.transitions import Ended
from tests.helpers import claim, execution
from tests.testapp.models import Tag

pytestmark = pytest.mark.django_db(transaction=True)

RETRY_IN_AN_HOUR = RetryDecision(ExecutionStatus.UNFINISHED, 3600.0)
FAILED_FOR_GOOD = RetryDecision(ExecutionStatus.FAILED, None)
BOOM = {"error_type": "RuntimeError", "error_message": "boom", "error_traceback": "Traceback"}


@pytest.fixture(params=["django", "engine"])
def session(request):
    """A context manager giving a session in a transaction, as each side runs one."""
    if request.param == "django":
        @contextmanager
        def on_django() -> Iterator[OnDjango]:
            with transaction.atomic():
                yield OnDjango("default")
        yield on_django
        return
    bridge = Bridge()

    @contextmanager
    def on_engine() -> Iterator[OnEngine]:
        with bridge.writing() as conn:
            yield bridge.session(conn)
    try:
        yield on_engine
    finally:
        bridge.close()


def claimed(slug: str = "t1", claimer: str = "box:1"):
    Tag.objects.create(slug=slug)
    [c] = claim("tags", claimer=claimer)
    return c


def ended(c) -> list[Ended]:
    return [Ended(c.execution_id, c.token, started=-2.0, finished=-1.0)]


def row(c) -> Execution:
    return Execution.objects.get(pk=c.execution_id)


def db_now():
    return clock.now("default")


# -- claim and renew ------------------------------------------------------------------------
def test_a_new_source_row_is_pending_and_a_claim_makes_it_working():
    Tag.objects.create(slug="new")
    e = execution("tags", "new")
    assert (e.status, e.attempts, e.claim_token, e.claimed_by) == ("pending", 0, None, None)
    before = db_now()
    [c] = claim("tags", claimer="box:7")
    e = row(c)
    assert (e.status, e.attempts, e.claim_token, e.claimed_by) == ("working", 1, c.token, "box:7")
    assert e.lease_expires_at > before and e.started_at >= before - timedelta(seconds=1)
    assert claim("tags") == []  # claimed once: a second claim finds nothing


def test_renew_pushes_the_lease_only_while_the_claim_holds(session):
    c = claimed()
    Execution.objects.filter(pk=c.execution_id).update(lease_expires_at=db_now())
    with session() as s:
        assert transitions.renew(s, [c], 60) == 1
    assert row(c).lease_expires_at > db_now() + timedelta(seconds=50)
    stranger = Ended(c.execution_id, "not-the-token", 0, 0)
    with session() as s:
        assert transitions.renew(s, [stranger], 60) == 0


# -- what a handler answers ---------------------------------------------------------------
def test_finish_ends_the_attempt_and_keeps_who_ran_it(session):
    c = claimed(claimer="box:2")
    Execution.objects.filter(pk=c.execution_id).update(crashes=2, error_type="Old")
    with session() as s:
        assert transitions.finish(s, ended(c)) == 1
    e = row(c)
    assert (e.status, e.claim_token, e.lease_expires_at, e.crashes, e.error_type) == (
        "finished", None, None, 0, None)
    assert e.claimed_by == "box:2" and e.attempts == 1
    # Its times: the database's, as long ago as the child measured.
    assert timedelta(0) < e.finished_at - e.started_at < timedelta(seconds=1.5)
    assert e.next_attempt_at is None


def test_finish_with_rerun_every_waits_to_go_stale(session):
    c = claimed()
    with session() as s:
        transitions.finish(s, ended(c), rerun_every=60)
    e = row(c)
    assert e.status == "finished" and e.waiting_worker == "tags"
    assert timedelta(seconds=55) < e.next_attempt_at - e.finished_at < timedelta(seconds=65)


def test_continue_makes_the_row_claimable_again_with_no_retry_used(session):
    c = claimed()
    with session() as s:
        assert transitions.continue_later(s, ended(c)) == 1
    e = row(c)
    assert (e.status, e.attempts, e.claim_token, e.claimable_worker) == ("unfinished", 0, None, "tags")
    assert e.ready_at is not None


@pytest.mark.parametrize("end", ["finish", "fail"])
def test_a_row_whose_source_changed_while_it_ran_goes_pending_instead(session, end):
    c = claimed()
    Execution.objects.filter(pk=c.execution_id).update(rerun_requested=True,
                                                        rerun_reason="changed: slug")
    with session() as s:
        if end == "finish":
            transitions.finish(s, ended(c), rerun_on=True, rerun_every=60)
        else:
            transitions.fail_or_retry(s, transitions.held([c]), FAILED_FOR_GOOD, BOOM,
                                      crashes="reset", rerun_on=True)
    e = row(c)
    assert (e.status, e.rerun_requested, e.rerun_reason) == ("pending", False, "changed: slug")
    assert e.next_attempt_at is None and e.claimable_worker == "tags"


def test_without_the_flag_a_rerun_on_row_ends_as_usual(session):
    c = claimed()
    with session() as s:
        transitions.finish(s, ended(c), rerun_on=True)
    e = row(c)
    assert (e.status, e.rerun_requested, e.rerun_reason) == ("finished", False, None)


# -- failures, crashes, interruptions -------------------------------------------------------
def test_fail_or_retry_waits_out_the_delay_on_the_database_clock(session):
    c = claimed(claimer="box:3")
    with session() as s:
        assert transitions.fail_or_retry(s, transitions.held([c]), RETRY_IN_AN_HOUR, BOOM,
                                         crashes="reset") == 1
    e = row(c)
    assert (e.status, e.error_type, e.error_message, e.claim_token) == (
        "unfinished", "RuntimeError", "boom", None)
    assert e.waiting_worker == "tags" and e.claimable_worker is None
    assert timedelta(minutes=59) < e.next_attempt_at - db_now() < timedelta(minutes=61)
    assert e.finished_at is None and e.claimed_by == "box:3"


def test_fail_or_retry_fails_for_good(session):
    c = claimed()
    with session() as s:
        transitions.fail_or_retry(s, transitions.held([c]), FAILED_FOR_GOOD, BOOM, crashes="reset")
    e = row(c)
    assert (e.status, e.next_attempt_at, e.error_traceback) == ("failed", None, "Traceback")
    assert e.finished_at is not None and e.claimable_worker is e.waiting_worker is None


@pytest.mark.parametrize(("crashes", "after"), [("reset", 0), ("count", 3), ("keep", 2)])
def test_a_crash_counts_toward_quarantine_and_a_handlers_answer_resets_it(session, crashes, after):
    c = claimed()
    Execution.objects.filter(pk=c.execution_id).update(crashes=2)
    with session() as s:
        transitions.fail_or_retry(s, transitions.held([c]), RETRY_IN_AN_HOUR, BOOM,
                                  crashes=crashes)
    assert row(c).crashes == after


def test_release_undoes_a_claim_whose_handler_never_started(session):
    c = claimed()
    with session() as s:
        assert transitions.release(s, c, c.previous_status) is True
    e = row(c)
    assert (e.status, e.attempts, e.claim_token, e.claimed_by, e.lease_expires_at) == (
        "pending", 0, None, None, None)
    assert e.claimable_worker == "tags"


def test_a_lost_claim_changes_nothing(session):
    c = claimed()
    taken = Ended(c.execution_id, "someone-elses-token", -1, 0)
    with session() as s:
        assert transitions.finish(s, [taken]) == 0
        assert transitions.continue_later(s, [taken]) == 0
        assert transitions.fail_or_retry(s, transitions.held([taken]), FAILED_FOR_GOOD, BOOM,
                                         crashes="reset") == 0
        assert transitions.release(s, taken, "pending") is False
        assert transitions.renew(s, [taken], 60) == 0
    e = row(c)
    assert (e.status, e.claim_token, e.attempts) == ("working", c.token, 1)


def test_recover_hands_back_rows_whose_lease_ran_out_and_only_those(session):
    gone, alive = claimed("gone", claimer="gone:1"), claimed("alive", claimer="alive:1")
    Execution.objects.filter(pk=gone.execution_id).update(
        lease_expires_at=db_now() - timedelta(seconds=5))
    lease = {"error_type": "LeaseExpired", "error_message": "expired"}
    with session() as s:
        changed = transitions.recover(s, "tags", present=sa.true(),
                                      decide=lambda r: (RETRY_IN_AN_HOUR, lease))
    assert [r.id for r, _ in changed] == [gone.execution_id]
    e = row(gone)
    assert (e.status, e.error_type, e.claim_token, e.claimed_by) == (
        "unfinished", "LeaseExpired", None, "gone:1")
    assert e.next_attempt_at > db_now() + timedelta(minutes=59)
    assert row(alive).status == "working"


def test_end_leases_of_dead_coordinators_lets_recovery_take_their_rows_now(session):
    dead, live = claimed("d", claimer="host:111"), claimed("l", claimer="host:222")
    with session() as s:
        assert transitions.end_leases(s, ["host:111"]) == 1
    assert row(dead).lease_expires_at < db_now() < row(live).lease_expires_at


# -- waiting rows -------------------------------------------------------------------------------
def test_promote_makes_due_rows_claimable_and_stale_finished_rows_pending(session):
    retry, stale, later = claimed("r"), claimed("s"), claimed("l")
    with session() as s:
        transitions.fail_or_retry(s, transitions.held([retry]), RETRY_IN_AN_HOUR, BOOM,
                                  crashes="reset")
        transitions.fail_or_retry(s, transitions.held([later]), RETRY_IN_AN_HOUR, BOOM,
                                  crashes="reset")
        transitions.finish(s, ended(stale), rerun_every=3600)
    past = db_now() - timedelta(seconds=1)
    Execution.objects.filter(pk__in=[retry.execution_id, stale.execution_id]).update(
        next_attempt_at=past)
    with session() as s:
        assert transitions.promote(s, "tags") == 2
    r, st, la = row(retry), row(stale), row(later)
    assert (r.status, r.claimable_worker, r.next_attempt_at) == ("unfinished", "tags", None)
    assert abs(r.ready_at - past) < timedelta(seconds=1)  # ready since it was due
    assert (st.status, st.rerun_reason, st.claimable_worker) == ("pending", "stale", "tags")
    assert la.waiting_worker == "tags" and la.claimable_worker is None  # not due yet
    with session() as s:
        assert transitions.promote(s, "tags") == 0


# -- fresh starts ------------------------------------------------------------------------------
@pytest.mark.parametrize(("transition", "status"), [("reset", "failed"), ("run_again", "finished")])
def test_a_fresh_start_clears_one_status_and_leaves_the_others_alone(session, transition, status):
    """reset starts failed rows afresh, run_again finished ones: from a clean slate (no
    attempt, crash, error, claimer or end), claimable again at once."""
    failed, done = claimed("f"), claimed("d")
    with session() as s:
        transitions.fail_or_retry(s, transitions.held([failed]), FAILED_FOR_GOOD, BOOM,
                                  crashes="count")
        transitions.finish(s, ended(done))
        fresh = getattr(transitions, transition)
        assert fresh(s, [failed.execution_id, done.execution_id]) == 1
    started, left = (failed, done) if status == "failed" else (done, failed)
    e = row(started)
    assert (e.status, e.attempts, e.crashes, e.error_type, e.finished_at, e.claimed_by) == (
        "unfinished", 0, 0, None, None, None)
    assert e.claimable_worker == "tags" and e.ready_at is not None
    assert row(left).status == ("finished" if status == "failed" else "failed")


def test_the_admin_and_the_api_reset_through_the_store():
    c = claimed()
    with transaction.atomic():
        transitions.fail_or_retry(OnDjango("default"), transitions.held([c]), FAILED_FOR_GOOD,
                                  BOOM, crashes="reset")
    assert Execution.objects.filter(worker="tags").reset_failed() == 1
    assert Execution.objects.filter(worker="tags").reset_failed() == 0  # nothing failed now
    assert row(c).status == "unfinished"


def test_finished_rows_wait_to_go_stale_exactly_while_the_worker_has_rerun_every(session):
    c = claimed()
    with session() as s:
        transitions.finish(s, ended(c))
        assert transitions.reschedule_finished(s, "tags", 60.0) == 1  # gained rerun_every
    e = row(c)
    assert e.waiting_worker == "tags"
    assert abs(e.next_attempt_at - e.finished_at - timedelta(seconds=60)) < timedelta(seconds=1)
    with session() as s:
        assert transitions.reschedule_finished(s, "tags", 60.0) == 0  # already waits
        assert transitions.reschedule_finished(s, "tags", None) == 1  # lost it
    assert row(c).next_attempt_at is None and row(c).status == "finished"
