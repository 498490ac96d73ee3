"""When a coordinator looks again: the idle poll's back-off, the due rows' times (retries,
run_after, rerun_every) and the change probe's pace, with fixed clocks and a fake database
that only answers what the test says."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from django_dbworker.coordinator.backoff import QUIET_FACTOR, QUIET_SECONDS, Backoff
from django_dbworker.coordinator.due import LOOK_SECONDS, DueRows
from django_dbworker.coordinator.wakeups import Probed, Wakeups

POLL = 0.25
DOCS, MAIL = SimpleNamespace(name="docs"), SimpleNamespace(name="mail")


class Health:
    """A database that never fails: calls go straight through."""

    def call(self, fn, *args, **kwargs):
        return fn(*args, **kwargs)


# -- the idle poll's back-off -----------------------------------------------------------------
def test_an_idle_worker_waits_twice_as_long_after_each_empty_claim_up_to_the_most():
    backoff = Backoff(0.25, 2.0)
    waits = []
    for now in range(7):
        backoff.found_nothing(float(now))
        waits.append(backoff.next_at - now)
    assert waits == [0.25, 0.5, 1.0, 2.0, 2.0, 2.0, 2.0]


def test_a_worker_claims_at_once_after_work_or_a_wake_up_and_starts_doubling_afresh():
    backoff = Backoff(0.25, 2.0)
    for now in range(4):
        backoff.found_nothing(float(now))
    assert backoff.exhausted and backoff.delay == 2.0
    backoff.found_work()
    assert (backoff.next_at, backoff.delay, backoff.exhausted) == (0.0, 0.25, False)
    backoff.found_nothing(10.0)
    backoff.found_nothing(11.0)
    backoff.wake()
    assert (backoff.next_at, backoff.delay, backoff.exhausted) == (0.0, 0.25, False)


@pytest.mark.parametrize("wait", [0.0, 0.0004, 0.3])
def test_a_rates_next_token_is_a_deadline_after_now_even_when_due_at_once(wait):
    """The loop keeps only deadlines after now (_timeout): a token due at once (a wait of
    0) made none, and the loop slept to its next periodic deadline (8 s idle at 50/s)."""
    from django_dbworker.coordinator.loop import token_wait

    backoff, now = Backoff(0.25, 2.0), 100.0
    backoff.wait_until(now + token_wait(wait))
    assert now < backoff.next_at <= now + max(wait, 0.001)
    assert not backoff.exhausted  # (rows are there: drain waits for them)
    assert token_wait(None) is None  # no rate holds it back


def test_a_new_worker_may_claim_at_once():
    backoff = Backoff(0.25, 2.0)
    assert (backoff.next_at, backoff.exhausted) == (0.0, False)


# -- due rows -------------------------------------------------------------------------------
class Bridge:
    """A database with waiting rows: ``due[name]`` is how many rows each promotion finds,
    ``until[name]`` the seconds until its next waiting row (None: none waits)."""

    def __init__(self) -> None:
        self.due: dict[str, int] = {}
        self.until: dict[str, float | None] = {}
        self.promotions: list[str] = []
        self.looks: list[str] = []

    def promote_due(self, worker):
        self.promotions.append(worker.name)
        return self.due.pop(worker.name, 0)

    def seconds_until_due(self, worker):
        self.looks.append(worker.name)
        return self.until.get(worker.name)


@pytest.fixture
def bridge():
    return Bridge()


@pytest.fixture
def rows(bridge):
    return DueRows(bridge, Health(), [DOCS, MAIL], POLL)


def test_each_worker_looks_for_due_rows_at_start(rows, bridge):
    assert rows.promote_due([DOCS, MAIL], 0.0) == []
    assert bridge.promotions == ["docs", "mail"]


def test_the_next_look_is_when_the_next_waiting_row_is_due(rows, bridge):
    bridge.until["docs"] = 5.0
    rows.promote(DOCS, 100.0)
    assert 105.0 in rows.deadlines()
    bridge.promotions.clear()
    assert rows.promote_due([DOCS], 104.9) == [] and bridge.promotions == []
    bridge.due["docs"] = 2
    assert rows.promote_due([DOCS], 105.0) == ["docs"] and bridge.promotions == ["docs"]


def test_a_row_due_now_by_the_databases_clock_is_looked_for_a_poll_later_not_at_once(rows, bridge):
    # Nothing promoted yet the database says one is due: the clocks may disagree a little.
    bridge.until["docs"] = -0.5
    rows.promote(DOCS, 100.0)
    assert rows.deadlines() == [100.0 + POLL, 0.0]  # (mail has not looked yet)


def test_after_a_promotion_the_next_due_row_is_looked_for_on_time(rows, bridge):
    bridge.due["docs"], bridge.until["docs"] = 3, 0.0
    assert rows.promote(DOCS, 100.0) is True
    assert 100.0 in rows.deadlines()


def test_a_worker_with_no_waiting_row_does_not_look_again_while_idle(rows, bridge):
    rows.promote(DOCS, 100.0)  # seconds_until_due: None
    bridge.promotions.clear()
    assert rows.promote_due([DOCS], 10_000.0) == [] and bridge.promotions == []
    assert rows.deadlines() == [0.0]  # only mail's first look


def test_a_busy_worker_looks_for_due_rows_every_look_seconds_though_none_was_known(rows, bridge):
    rows.promote(DOCS, 100.0)  # none waits
    rows.claimed(DOCS, found=True)  # its claims keep finding rows: none comes back empty
    bridge.promotions.clear()
    assert LOOK_SECONDS == 1.0
    rows.promote_due([DOCS], 100.0 + LOOK_SECONDS - 0.01)
    assert bridge.promotions == []
    rows.promote_due([DOCS], 100.0 + LOOK_SECONDS)
    assert bridge.promotions == ["docs"]
    assert 100.0 + 2 * LOOK_SECONDS in rows.deadlines()


def test_a_busy_worker_that_knows_a_later_due_row_still_looks_every_look_seconds(rows, bridge):
    bridge.until["docs"] = 3600.0
    rows.promote(DOCS, 100.0)
    rows.claimed(DOCS, found=True)
    bridge.looks.clear()
    bridge.promotions.clear()
    # A retry written since (by a child, due in half a second) comes before the known row:
    bridge.until["docs"] = 0.5
    rows.promote_due([DOCS], 100.0 + LOOK_SECONDS)
    assert bridge.looks == ["docs"] and bridge.promotions == []  # looked: nothing due yet
    assert 101.5 in rows.deadlines()
    bridge.due["docs"] = 1
    assert rows.promote_due([DOCS], 101.5) == ["docs"]


def test_a_worker_whose_claim_came_back_empty_is_no_longer_busy(rows, bridge):
    rows.promote(DOCS, 100.0)
    rows.claimed(DOCS, found=True)
    rows.claimed(DOCS, found=False)
    bridge.promotions.clear()
    rows.promote_due([DOCS], 100.0 + 5 * LOOK_SECONDS)
    assert bridge.promotions == []


# -- the change probe's pace (no NOTIFY, no doorbell) ------------------------------------------------
class Tokens:
    """The change probe's answers: (rows, *pauses), or None for a failed query."""

    def __init__(self) -> None:
        self.token: tuple | None = (1, 0, None)

    def change_token(self):
        return self.token


@pytest.fixture
def probe():
    options = SimpleNamespace(poll_seconds=POLL, max_poll_seconds=10.0, probe_seconds=0.02)
    wakeups, tokens = Wakeups(["docs", "mail"], options, Health()), Tokens()

    def at(now: float) -> tuple[Probed, float]:
        probed = wakeups.probe(tokens, now)
        return probed, round(wakeups.next_probe - now, 6)

    return wakeups, tokens, at


def test_the_probe_slows_to_half_its_pace_after_a_quiet_second_and_speeds_up_on_a_change(probe):
    _, tokens, at = probe
    # The first answer is a baseline, and no change was seen for a second: the slow pace.
    assert at(100.0) == (Probed.NOTHING, round(0.02 * QUIET_FACTOR, 6))
    tokens.token = (2, 0, None)
    assert at(100.05) == (Probed.ROWS, 0.02)
    assert at(100.05 + QUIET_SECONDS / 2) == (Probed.NOTHING, 0.02)
    assert at(100.05 + QUIET_SECONDS) == (Probed.NOTHING, round(0.02 * QUIET_FACTOR, 6))
    tokens.token = (3, 0, None)
    assert at(102.0) == (Probed.ROWS, 0.02)


def test_the_probe_does_not_run_before_its_time(probe):
    _, tokens, at = probe
    at(100.0)
    tokens.token = (2, 0, None)
    assert at(100.01) == (Probed.NOTHING, 0.03)  # not due until 100.04: not asked
    assert at(100.04)[0] is Probed.ROWS


def test_new_rows_wake_every_worker_and_a_pause_is_told_apart(probe):
    wakeups, tokens, at = probe
    at(100.0)
    for name in ("docs", "mail"):
        wakeups.backoff[name].found_nothing(100.0)
    tokens.token = (1, 1, "12:00")  # a pause, no new rows
    assert at(101.0)[0] is Probed.PAUSES
    assert all(b.next_at > 0 for b in wakeups.backoff.values())  # nobody woken
    tokens.token = (2, 1, "12:00")
    assert at(102.0)[0] is Probed.ROWS
    assert all(b.next_at == 0.0 for b in wakeups.backoff.values())


def test_a_failed_probe_is_reported_and_the_next_answer_compares_with_the_last_good_one(probe):
    _, tokens, at = probe
    at(100.0)
    tokens.token = None
    assert at(101.0)[0] is Probed.FAILED
    tokens.token = (1, 0, None)
    assert at(102.0)[0] is Probed.NOTHING


def test_with_notify_listening_the_probe_never_runs(probe):
    wakeups, tokens, at = probe
    wakeups.listener = object()
    tokens.token = (9, 9, None)
    assert at(100.0)[0] is Probed.NOTHING and wakeups.deadline() is None
