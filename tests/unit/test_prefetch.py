"""Prefetch sizing: how many rows each child of a pool may hold, and so how many rows the
coordinator claims for the pool (the sum of its children's room)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from django_dbworker.processes import protocol
from django_dbworker.processes.children import Running
from django_dbworker.processes.pool import Pool

AHEAD, MOST, FIRST = Pool.AHEAD_SECONDS, Pool.MAX_AHEAD, Pool.FIRST_AHEAD


def test_before_any_handler_is_timed_a_child_holds_one_row():
    assert FIRST == 1 and Pool.rows_ahead(None) == 1


@pytest.mark.parametrize("row_seconds,ahead", [
    (0.01, 10),     # 0.1 s of 10 ms rows
    (0.03, 4),      # rounded up: 3.33 rows
    (0.1, 1),
    (5.0, 1),       # slower than AHEAD_SECONDS: a single row, never none
    (0.001, 32),    # 100 rows of work, capped at MAX_AHEAD
    (0.0, 32),      # instant handlers: no division by zero
])
def test_a_child_holds_about_a_tenth_of_a_second_of_work(row_seconds, ahead):
    assert (AHEAD, MOST) == (0.1, 32)
    assert Pool.rows_ahead(row_seconds) == ahead


def test_a_child_is_never_sent_more_rows_than_it_may_take_before_it_retires():
    assert Pool.rows_ahead(0.001, left=5) == 5
    assert Pool.rows_ahead(0.001, left=40) == MOST
    assert Pool.rows_ahead(None, left=0) == 0
    assert Pool.rows_ahead(0.01, left=-2) == 0  # (past its limit: nothing, not negative)


@pytest.mark.parametrize("capacity,held,sent", [
    (10, 0, 10),
    (10, 5, 5),    # down to half: topped up
    (10, 6, 0),    # more than half: nothing yet, so claims come in batches
    (10, 10, 0),
    (1, 0, 1),
    (1, 1, 0),
    (0, 0, 0),     # retiring: nothing
    (4, 7, 0),     # holds more than its (shrunk) capacity: nothing, not negative
])
def test_a_child_is_topped_up_only_once_it_is_down_to_half_its_share(capacity, held, sent):
    assert Pool.top_up(capacity, held) == sent


def no_spawn():
    raise AssertionError("the sizing rules spawn nothing")


def pool(max_tasks_per_child: int | None = None, timeout: float | None = None) -> Pool:
    worker = SimpleNamespace(name="w", max_tasks_per_child=max_tasks_per_child, timeout=timeout)
    return Pool(worker, 2, no_spawn)  # type: ignore[arg-type]


def test_the_per_row_time_is_a_moving_average_weighting_the_newest_group_a_fifth():
    p = pool()
    assert p.row_seconds is None
    p.timed(10, 1.0)  # the first group sets it: 0.1 s a row
    assert p.row_seconds == pytest.approx(0.1)
    p.timed(2, 0.02)  # 0.01 s a row: 0.8 * 0.1 + 0.2 * 0.01
    assert p.row_seconds == pytest.approx(0.082)
    p.timed(0, 5.0)  # an empty group says nothing
    assert p.row_seconds == pytest.approx(0.082)


def test_no_handler_counts_as_stuck_until_one_was_timed_then_after_twenty_times_the_usual():
    p = pool()
    assert p.stuck_after() == math.inf
    p.timed(1, 0.001)
    assert p.stuck_after() == Pool.STUCK_SECONDS == 0.5  # at least half a second
    p.timed(1, 1.0)  # the average is now about 0.2 s a row
    assert p.stuck_after() == pytest.approx(Pool.STUCK_FACTOR * p.row_seconds)
    assert p.stuck_after() > 0.5


@dataclass
class Child:
    """What the sizing rules read of a child: its handshake, shared slot and rows held."""

    ready: bool = True
    sent: int = 0
    outstanding: dict[int, object] = field(default_factory=dict)
    slot: list[float] = field(default_factory=lambda: [0.0] * protocol.SLOT_SIZE)

    @property
    def busy(self) -> bool:
        return bool(self.outstanding)

    def running(self) -> Running | None:
        seq = int(self.slot[protocol.SLOT_SEQ])
        return None if seq == 0 else Running(seq, self.slot[protocol.SLOT_STARTED])

    def holding(self, n: int, running_since: float | None = None) -> Child:
        self.outstanding = {seq: object() for seq in range(1, n + 1)}
        if running_since is not None:
            self.slot[protocol.SLOT_SEQ], self.slot[protocol.SLOT_STARTED] = 1, running_since
        return self


def test_the_pool_claims_what_its_ready_children_have_room_for():
    p = pool()
    p.timed(10, 0.1)  # 10 ms a row: 10 rows ahead per child
    p.children = [Child(), Child().holding(5), Child().holding(6)]  # type: ignore[list-item]
    assert [p.room(c, 0.0) for c in p.children] == [10, 5, 0]  # type: ignore[arg-type]
    assert p.free_slots(0.0) == 15  # the coordinator's claim for this pool


def test_a_starting_child_or_one_answering_a_revocation_gets_no_rows():
    p = pool()
    starting, revoking = Child(ready=False), Child()
    revoking.slot[protocol.SLOT_REVOKE] = 1
    p.children = [starting, revoking]  # type: ignore[list-item]
    assert p.free_slots(0.0) == 0


def test_a_child_whose_handler_is_stuck_gets_no_more_rows():
    p = pool()
    p.timed(10, 0.1)  # stuck after max(0.5, 20 * 0.01) = 0.5 s
    child = Child().holding(1, running_since=100.0)
    p.children = [child]  # type: ignore[list-item]
    assert p.room(child, 100.4) == 9  # type: ignore[arg-type]
    assert p.room(child, 100.5) == 0  # type: ignore[arg-type]


def test_a_child_near_max_tasks_per_child_is_sent_only_what_it_will_run():
    p = pool(max_tasks_per_child=12)
    p.timed(10, 0.1)  # 10 rows ahead, but it retires after 12
    fresh, most_used, used_up = Child(sent=0), Child(sent=9), Child(sent=12)
    p.children = [fresh, most_used, used_up]  # type: ignore[list-item]
    assert [p.capacity(c) for c in p.children] == [10, 3, 0]  # type: ignore[arg-type]
    assert p.free_slots(0.0) == 13
