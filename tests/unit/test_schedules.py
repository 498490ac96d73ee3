"""Cron and interval slots with fixed clocks: which slots are due, the next one, the catch-up
policies after downtime, time zones and DST, and a slot's identity (the same datetime from
whichever coordinator computes it: what the unique (schedule, slot) constraint relies on to
enqueue each slot exactly once)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from django.test import override_settings

from django_dbworker.schedules import EPOCH, MAX_CATCH_UP, SKIP_GRACE, Schedule, validate

T0 = datetime(2026, 6, 1, 12, 0, 0, tzinfo=UTC)
BERLIN = ZoneInfo("Europe/Berlin")


def every_second(catch_up="latest", name="tick") -> Schedule:
    return Schedule(name=name, task_path="tests.testapp.tasks.record", every=timedelta(seconds=1),
                    args=[name], catch_up=catch_up)


def every(delta: timedelta, catch_up: str = "latest") -> Schedule:
    return Schedule(name="e", task_path="x.y", every=delta, catch_up=catch_up)


def cron(expression: str, catch_up: str = "latest") -> Schedule:
    return Schedule(name="c", task_path="x.y", cron=expression, catch_up=catch_up)


def seconds(*offsets: float) -> list[datetime]:
    return [T0 + timedelta(seconds=s) for s in offsets]


# -- which slots are due ----------------------------------------------------------------------
@pytest.mark.parametrize("catch_up,now,expected", [
    ("latest", T0 + timedelta(seconds=5.5), [5]),
    ("all", T0 + timedelta(seconds=5.5), [1, 2, 3, 4, 5]),
    ("skip", T0 + timedelta(seconds=5.4), [5]),  # 0.4 s late: on time (< half the gap)
    ("skip", T0 + timedelta(seconds=5.6), []),   # 0.6 s late: missed, skipped
    ("latest", T0 + timedelta(seconds=0.5), []),  # nothing due yet
])
def test_catch_up_policies_after_downtime(catch_up, now, expected):
    assert every_second(catch_up).due(T0, now) == [T0 + timedelta(seconds=s) for s in expected]


def test_a_slot_is_due_at_its_exact_time_and_not_a_moment_before():
    tick = every_second("all")
    assert tick.due(T0, T0 + timedelta(seconds=2)) == seconds(1, 2)
    assert tick.due(T0, T0 + timedelta(seconds=2) - timedelta(microseconds=1)) == seconds(1)


def test_the_slot_already_recorded_is_never_due_again():
    tick = every_second("all")
    assert tick.due(T0 + timedelta(seconds=3), T0 + timedelta(seconds=3.9)) == []
    assert tick.due(T0 + timedelta(seconds=3), T0 + timedelta(seconds=4)) == seconds(4)


def test_catching_up_all_after_a_long_downtime_enqueues_at_most_the_latest_thousand():
    tick = every_second("all")
    missed = tick.due(T0, T0 + timedelta(seconds=1500.5))
    assert MAX_CATCH_UP == 1000 and len(missed) == MAX_CATCH_UP
    assert missed[0] == T0 + timedelta(seconds=501) and missed[-1] == T0 + timedelta(seconds=1500)
    assert missed == sorted(missed)


def test_skip_runs_a_slot_seen_within_a_minute_when_the_gap_is_long():
    hourly = every(timedelta(hours=1), "skip")
    start = datetime(2026, 6, 1, 0, 0, tzinfo=UTC)
    slot = start + timedelta(hours=1)
    assert SKIP_GRACE == timedelta(seconds=60)
    assert hourly.due(start, slot + timedelta(seconds=60)) == [slot]
    assert hourly.due(start, slot + timedelta(seconds=61)) == []


def test_latest_runs_only_the_newest_missed_slot_however_long_the_downtime():
    nightly = cron("0 3 * * *")
    with override_settings(TIME_ZONE="UTC"):
        due = nightly.due(datetime(2026, 6, 1, 3, 0, tzinfo=UTC),
                          datetime(2026, 6, 9, 12, 0, tzinfo=UTC))
    assert due == [datetime(2026, 6, 9, 3, 0, tzinfo=UTC)]


# -- the next slot, the previous one ------------------------------------------------------------
def test_the_next_slot_is_strictly_after_now():
    tick = every_second()
    assert tick.next_slot(T0) == T0 + timedelta(seconds=1)
    assert tick.next_slot(T0 + timedelta(seconds=0.3)) == T0 + timedelta(seconds=1)


def test_a_new_interval_schedule_starts_its_history_at_the_slot_at_or_before_now():
    quarter = every(timedelta(minutes=15))
    assert quarter.previous_slot(T0) == T0  # at a slot: that slot
    assert quarter.previous_slot(T0 + timedelta(minutes=14)) == T0
    # Nothing from before it was first seen is ever due.
    now = T0 + timedelta(minutes=14)
    assert quarter.due(quarter.previous_slot(now), now) == []


@override_settings(TIME_ZONE="UTC")
def test_a_new_cron_schedule_starts_its_history_at_its_last_slot_before_now():
    nightly = cron("0 3 * * *")
    now = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)
    assert nightly.previous_slot(now) == datetime(2026, 6, 1, 3, 0, tzinfo=UTC)
    assert nightly.due(nightly.previous_slot(now), now) == []
    assert nightly.next_slot(now) == datetime(2026, 6, 2, 3, 0, tzinfo=UTC)


@override_settings(TIME_ZONE="UTC")
def test_a_six_field_cron_counts_seconds_first():
    it = cron("*/15 * * * * *").slots_after(T0)
    assert [next(it) for _ in range(3)] == seconds(15, 30, 45)


# -- a slot's identity ------------------------------------------------------------------------
def test_interval_slots_are_aligned_on_a_fixed_epoch_not_on_when_a_coordinator_started():
    seven = every(timedelta(minutes=7))
    one = seven.slots_after(T0)
    first = [next(one) for _ in range(5)]
    other = seven.slots_after(first[0] + timedelta(minutes=3, seconds=17))  # started later
    assert [next(other) for _ in range(4)] == first[1:]  # the same datetimes
    assert all((slot - EPOCH) % timedelta(minutes=7) == timedelta(0) for slot in first)


@override_settings(TIME_ZONE="Europe/Berlin")
def test_cron_slots_are_the_same_utc_datetimes_from_whichever_start():
    nightly = cron("30 2 * * *")
    a = nightly.slots_after(datetime(2026, 6, 1, 0, 0, tzinfo=UTC))
    b = nightly.slots_after(datetime(2026, 6, 1, 23, 59, tzinfo=BERLIN))  # another zone
    first = [next(a) for _ in range(3)]
    assert [next(b) for _ in range(2)] == first[1:]
    assert all(slot.tzinfo is UTC for slot in first)


def berlin(*args) -> datetime:
    return datetime(*args, tzinfo=BERLIN).astimezone(UTC)


@override_settings(TIME_ZONE="Europe/Berlin")
def test_cron_follows_the_time_zone_and_dst_the_way_cronsim_does():
    nightly = Schedule(name="n", task_path="x.y", cron="30 2 * * *", catch_up="all")
    # Spring forward (29 March 2026: 02:00 -> 03:00): the skipped 02:30 runs at 03:00.
    assert nightly.due(berlin(2026, 3, 28, 2, 30), berlin(2026, 3, 30, 12, 0)) == [
        berlin(2026, 3, 29, 3, 0), berlin(2026, 3, 30, 2, 30)]
    # Fall back (25 October 2026: 03:00 -> 02:00): the repeated 02:30 runs once.
    slots = nightly.due(berlin(2026, 10, 24, 2, 30), berlin(2026, 10, 26, 12, 0))
    assert len(slots) == 2 and slots[1] == berlin(2026, 10, 26, 2, 30)
    assert slots[0].astimezone(BERLIN).hour == 2
    # 02:30 in Berlin is 00:30 UTC in summer: the slots are stored in UTC.
    assert nightly.next_slot(berlin(2026, 7, 1, 0, 0)) == datetime(2026, 7, 1, 0, 30, tzinfo=UTC)


def test_without_a_time_zone_setting_cron_reads_utc(settings):
    del settings.TIME_ZONE
    assert cron("0 3 * * *").zone() == ZoneInfo("UTC")


# -- declarations (the parts that need no import) -------------------------------------------------
@pytest.mark.parametrize("schedule,message", [
    (Schedule("s", "x.y", every=timedelta(0)), "every must be a positive number"),
    (Schedule("s", "x.y", every=timedelta(seconds=-5)), "every must be a positive number"),
    (Schedule("s", "x.y", every=5), "every must be a positive number"),  # type: ignore[arg-type]
    (Schedule("s", "x.y"), "give either cron"),
    (Schedule("s", "x.y", cron="* * * * *", catch_up="never"), "catch_up must be one of"),
])
def test_a_bad_schedule_is_named_with_its_fix(schedule, message):
    problem = validate(schedule)
    assert problem is not None and message in problem and problem.startswith("Schedule 's'")


def test_a_good_schedule_has_no_problem():
    assert validate(every(timedelta(seconds=1))) is None
    assert validate(cron("0 3 * * *", catch_up="skip")) is None
