"""The statuses' rules, as the claims and waits read them: which rows are claimable, which
may wait for a due time, and what each outcome and retry decision leaves a row in. (The
transitions themselves are statements on the database, tested on every database.)"""

from __future__ import annotations

import itertools

from django_dbworker.admin.mixins import TRANSITIONS
from django_dbworker.outcomes import Finished, Unfinished
from django_dbworker.status import CLAIMABLE, WAITING, ExecutionStatus
from django_dbworker.store.retry import RetryPolicy

PENDING, WORKING, UNFINISHED, FINISHED, FAILED = (
    ExecutionStatus.PENDING, ExecutionStatus.WORKING, ExecutionStatus.UNFINISHED,
    ExecutionStatus.FINISHED, ExecutionStatus.FAILED)


def test_only_pending_and_unfinished_rows_are_claimable():
    assert [s for s in ExecutionStatus if s.claimable] == [PENDING, UNFINISHED]
    assert set(CLAIMABLE) == {PENDING, UNFINISHED}


def test_a_working_or_failed_row_never_waits_for_a_due_time():
    # Pending (run_after), unfinished (a retry) and finished (rerun_every) rows may wait.
    assert set(WAITING) == {PENDING, UNFINISHED, FINISHED}


def test_a_handlers_outcome_names_the_status_it_leaves_the_row_in():
    assert Finished().status == FINISHED and not FINISHED.claimable
    assert Unfinished().status == UNFINISHED and UNFINISHED.claimable


def test_every_retry_decision_leaves_a_row_claimable_later_or_failed_for_good():
    for max_attempts, attempts, crashes in itertools.product([None, 1, 3], range(1, 5), range(4)):
        policy = RetryPolicy(max_attempts, backoff=1.0)
        decisions = [policy.after_failure(attempts), policy.after_interruption(attempts),
                     policy.after_interruption(attempts, crashes)]
        if crashes:
            decisions.append(policy.after_crash(attempts, crashes))
        for decision in decisions:
            assert decision.status in (UNFINISHED, FAILED)
            if decision.status == UNFINISHED:  # claimable again, perhaps after a wait
                assert decision.status.claimable and decision.status in WAITING
            else:  # until a person resets it
                assert decision.delay is None and not decision.status.claimable


def test_a_person_resets_only_failed_rows_and_runs_again_only_finished_ones():
    assert TRANSITIONS == {"reset_failed": FAILED, "run_again": FINISHED}
