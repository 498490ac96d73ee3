"""The retry policy alone: what a failure, a crash and an interruption make of a row, and
back-offs that stay within what a database can store."""

import pytest

from django_dbworker.status import ExecutionStatus
from django_dbworker.store import retry
from django_dbworker.store.retry import MAX_CRASHES, MAX_DELAY_SECONDS, RetryDecision, RetryPolicy

UNFINISHED, FAILED = ExecutionStatus.UNFINISHED, ExecutionStatus.FAILED


@pytest.fixture
def no_jitter(monkeypatch):
    """The jitter's random factor at its top (1.0): the back-off's own step."""
    monkeypatch.setattr(retry.random, "uniform", lambda low, high: high)


def test_the_back_off_doubles_with_jitter():
    policy = RetryPolicy(max_attempts=10, backoff=2.0)
    for attempts, step in [(1, 2.0), (2, 4.0), (3, 8.0)]:
        delays = {policy.delay(attempts) for _ in range(200)}
        assert min(delays) >= step * 0.5 and max(delays) <= step


def test_the_jitter_scales_the_step_by_a_factor_between_a_half_and_one(monkeypatch):
    asked = []

    def uniform(low, high):
        asked.append((low, high))
        return low

    monkeypatch.setattr(retry.random, "uniform", uniform)
    assert RetryPolicy(5, backoff=8.0).delay(3) == 16.0  # 8 * 2 ** 2, halved
    assert asked == [(0.5, 1.0)]


def test_the_first_retry_waits_the_backoff_itself_and_each_one_after_twice_as_long(no_jitter):
    policy = RetryPolicy(max_attempts=10, backoff=3.0)
    assert [policy.delay(n) for n in range(1, 6)] == [3.0, 6.0, 12.0, 24.0, 48.0]


def test_a_count_below_one_waits_like_the_first_attempt(no_jitter):
    assert RetryPolicy(None, 5.0).delay(0) == RetryPolicy(None, 5.0).delay(-3) == 5.0


def test_a_back_off_never_overflows_a_database_interval():
    # A huge count is capped (it was an OverflowError in the coordinator's loop).
    policy = RetryPolicy(max_attempts=None, backoff=10.0, max_crashes=100_000)
    assert policy.delay(5_000) <= MAX_DELAY_SECONDS
    assert RetryPolicy(None, 0.0).delay(5_000) == 0.0
    assert policy.after_crash(1, 4_000).delay <= MAX_DELAY_SECONDS


def test_a_back_off_stops_growing_at_a_year(no_jitter):
    assert MAX_DELAY_SECONDS == 366 * 24 * 3600.0
    policy = RetryPolicy(None, backoff=10.0)
    assert policy.delay(21) < MAX_DELAY_SECONDS  # 10 * 2 ** 20: about 121 days
    assert policy.delay(23) == MAX_DELAY_SECONDS  # 10 * 2 ** 22 is past a year
    assert policy.delay(10**9) == MAX_DELAY_SECONDS


def test_the_exponent_is_capped_so_a_tiny_backoff_with_a_huge_count_is_still_a_number(no_jitter):
    # 2 ** 1e9 as a float would overflow; capped at 2 ** 64 the step stays finite.
    tiny = RetryPolicy(None, backoff=1e-30)
    assert tiny.delay(10**9) == tiny.delay(65) == 1e-30 * 2.0**64
    assert tiny.delay(64) == 1e-30 * 2.0**63


@pytest.mark.parametrize("max_attempts", [None, 5])
def test_crashes_end_a_row_failed_at_max_crashes_with_or_without_max_attempts(max_attempts):
    policy = RetryPolicy(max_attempts, backoff=1.0)
    for crashes in range(1, MAX_CRASHES):
        decision = policy.after_crash(crashes, crashes)
        assert decision.status == UNFINISHED and decision.delay is not None
    assert policy.after_crash(MAX_CRASHES, MAX_CRASHES).status == FAILED


def test_a_row_that_crashes_three_times_in_a_row_is_quarantined_by_default():
    assert MAX_CRASHES == 3 and RetryPolicy().max_crashes == MAX_CRASHES
    decision = RetryPolicy().after_crash(attempts=3, crashes=3)
    assert decision == RetryDecision(FAILED, None) and not decision.retried


def test_max_crashes_moves_the_quarantine(no_jitter):
    lenient = RetryPolicy(None, backoff=1.0, max_crashes=5)
    assert [lenient.after_crash(n, n).status for n in range(1, 6)] == [UNFINISHED] * 4 + [FAILED]
    assert RetryPolicy(None, 1.0, max_crashes=1).after_crash(1, 1).status == FAILED


def test_a_crash_without_max_attempts_waits_the_back_off_of_its_crash_count(no_jitter):
    policy = RetryPolicy(None, backoff=2.0)
    assert policy.after_crash(attempts=9, crashes=1).delay == 2.0
    assert policy.after_crash(attempts=9, crashes=2).delay == 4.0


def test_a_crash_with_max_attempts_counts_as_a_failed_attempt(no_jitter):
    policy = RetryPolicy(max_attempts=2, backoff=2.0, max_crashes=10)
    assert policy.after_crash(attempts=1, crashes=1) == RetryDecision(UNFINISHED, 2.0)
    assert policy.after_crash(attempts=2, crashes=2) == RetryDecision(FAILED, None)


def test_an_interruption_is_retried_at_once_without_max_attempts_and_counts_with_it():
    decision = RetryPolicy(None, 1.0).after_interruption(7)
    assert (decision.status, decision.delay, decision.failed_attempt) == (UNFINISHED, None, False)
    assert RetryPolicy(2, 1.0).after_interruption(2).status == FAILED
    assert RetryPolicy(None, 1.0).after_interruption(1, crashes=MAX_CRASHES).status == FAILED


def test_an_interruption_with_max_attempts_left_waits_its_back_off_as_a_failed_attempt(no_jitter):
    decision = RetryPolicy(3, backoff=4.0).after_interruption(2, crashes=1)
    assert decision == RetryDecision(UNFINISHED, 8.0, failed_attempt=True) and decision.retried


def test_a_failure_without_max_attempts_is_final():
    assert RetryPolicy(None, 1.0).after_failure(1).status == FAILED
    assert RetryPolicy(3, 1.0).after_failure(2).status == UNFINISHED
    assert RetryPolicy(3, 1.0).after_failure(3).status == FAILED


def test_a_failure_with_attempts_left_is_retried_after_its_back_off_and_counts(no_jitter):
    decision = RetryPolicy(3, backoff=10.0).after_failure(2)
    assert decision == RetryDecision(UNFINISHED, 20.0) and decision.failed_attempt
    assert decision.retried


def test_a_final_decision_has_no_delay_and_is_no_retry():
    decision = RetryPolicy(1, 10.0).after_failure(1)
    assert (decision.status, decision.delay, decision.retried) == (FAILED, None, False)
