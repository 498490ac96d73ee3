"""The retry policy alone (no database): what a failure, a crash and an interruption make
of a row, and back-offs that stay within what a database can store."""

import pytest

from django_dbworker.retry import MAX_CRASHES, MAX_DELAY_SECONDS, RetryPolicy
from django_dbworker.status import ExecutionStatus

UNFINISHED, FAILED = ExecutionStatus.UNFINISHED, ExecutionStatus.FAILED


def test_the_back_off_doubles_with_jitter():
    policy = RetryPolicy(max_attempts=10, backoff=2.0)
    for attempts, step in [(1, 2.0), (2, 4.0), (3, 8.0)]:
        delays = {policy.delay(attempts) for _ in range(200)}
        assert min(delays) >= step * 0.5 and max(delays) <= step


def test_a_back_off_never_overflows_a_database_interval():
    # A huge count is capped (it was an OverflowError in the coordinator's loop).
    policy = RetryPolicy(max_attempts=None, backoff=10.0, max_crashes=100_000)
    assert policy.delay(5_000) <= MAX_DELAY_SECONDS
    assert RetryPolicy(None, 0.0).delay(5_000) == 0.0
    assert policy.after_crash(1, 4_000).delay <= MAX_DELAY_SECONDS


@pytest.mark.parametrize("max_attempts", [None, 5])
def test_crashes_end_a_row_failed_at_max_crashes_with_or_without_max_attempts(max_attempts):
    policy = RetryPolicy(max_attempts, backoff=1.0)
    for crashes in range(1, MAX_CRASHES):
        decision = policy.after_crash(crashes, crashes)
        assert decision.status == UNFINISHED and decision.delay is not None
    assert policy.after_crash(MAX_CRASHES, MAX_CRASHES).status == FAILED


def test_an_interruption_is_retried_at_once_without_max_attempts_and_counts_with_it():
    decision = RetryPolicy(None, 1.0).after_interruption(7)
    assert (decision.status, decision.delay, decision.failed_attempt) == (UNFINISHED, None, False)
    assert RetryPolicy(2, 1.0).after_interruption(2).status == FAILED
    assert RetryPolicy(None, 1.0).after_interruption(1, crashes=MAX_CRASHES).status == FAILED


def test_a_failure_without_max_attempts_is_final():
    assert RetryPolicy(None, 1.0).after_failure(1).status == FAILED
    assert RetryPolicy(3, 1.0).after_failure(2).status == UNFINISHED
    assert RetryPolicy(3, 1.0).after_failure(3).status == FAILED
