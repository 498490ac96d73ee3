"""The pool on its own, without spawning: each child is a fake process on a real pipe,
and the test plays the child's side of the protocol."""

from __future__ import annotations

import logging
import os
import re
import signal
import time
from multiprocessing import Pipe

import pytest
from django.core.exceptions import ImproperlyConfigured

from django_dbworker.processes import protocol
from django_dbworker.processes.children import ChildProcess
from django_dbworker.processes.pool import (
    MAX_START_FAILURES,
    Died,
    Pool,
    PoolBroken,
    Reported,
    Settled,
    TimedOut,
)
from django_dbworker.processes.protocol import Claim, Result
from django_dbworker.registration.registry import registry


class FakeProcess:
    """What a pool reads of a process: a sentinel that becomes readable at exit."""

    _pids = iter(range(90_000, 99_000))

    def __init__(self) -> None:
        self.pid = next(self._pids)
        self._exit_r, self._exit_w = os.pipe()
        self.exitcode: int | None = None

    @property
    def sentinel(self) -> int:
        return self._exit_r

    def die(self, code: int) -> None:
        if self.exitcode is None:
            self.exitcode = code
            os.close(self._exit_w)

    def is_alive(self) -> bool:
        return self.exitcode is None

    def kill(self) -> None:
        self.die(-signal.SIGKILL)

    def join(self, timeout: float | None = None) -> None:
        pass


class FakeChild(ChildProcess):
    """A ChildProcess whose process is fake; ``other`` is the child's end of its pipe."""

    def __init__(self) -> None:  # no super().__init__(): nothing is spawned
        self.conn, self.other = Pipe()
        self.slot = [0.0] * protocol.SLOT_SIZE
        self.process = FakeProcess()  # type: ignore[assignment]
        self.spawned_at = time.monotonic()
        self.ready = False
        self.retiring = False
        self.outstanding = {}
        self.sent = 0
        self._next_seq = 1

    # the child's side
    def say_ready(self) -> None:
        self.other.send((protocol.READY, self.process.pid))

    def deliveries(self) -> list[protocol.Delivery]:
        got = []
        while self.other.poll():
            message = self.other.recv()
            if message is not None:
                got.extend(message)
        return got

    def start_running(self, seq: int, started: float | None = None) -> None:
        self.slot[protocol.SLOT_STARTED] = time.monotonic() if started is None else started
        self.slot[protocol.SLOT_SEQ] = seq

    def report(self, results: list[protocol.Result], seconds: float = 0.01) -> None:
        self.slot[protocol.SLOT_SEQ] = 0
        self.other.send((protocol.RESULTS, results, seconds, {}))


@pytest.fixture
def pool():
    spawned: list[FakeChild] = []

    def spawn() -> FakeChild:
        child = FakeChild()
        spawned.append(child)
        return child

    p = Pool(registry["docs"], 2, spawn)
    p.spawned = spawned
    p.start()
    yield p


def ready(pool: Pool, strict: bool = False) -> list:
    events = []
    for child in list(pool.children):
        if not child.ready:
            child.say_ready()
            events += pool.on_ready(child.conn, strict=strict)
    return events


def claims(n: int, start: int = 1) -> list[Claim]:
    return [Claim(i, str(i), f"t{i}", "pending", 1) for i in range(start, start + n)]


def test_children_get_rows_only_after_their_handshake(pool):
    assert pool.starting and pool.free_slots(time.monotonic()) == 0
    ready(pool)
    assert not pool.starting
    assert pool.free_slots(time.monotonic()) == 2  # one each before any handler is timed
    left = pool.distribute(claims(3), time.monotonic())
    assert len(left) == 1
    assert sorted(len(c.deliveries()) for c in pool.children) == [1, 1]


def test_a_row_claimed_again_before_its_report_is_two_deliveries(pool):
    """The drain defect: the child commits row 7, the row is claimed again at once, then the
    report of the first run arrives. Keyed by row, the report settled the new claim."""
    ready(pool)
    child = pool.children[0]
    first = Claim(7, "7", "first", "unfinished", 1)
    again = Claim(7, "7", "again", "unfinished", 1)
    child.send([first])
    [(seq1, *_)] = child.deliveries()
    child.send([again])  # claimed again: its first run committed, the report is on the way
    [(seq2, *_)] = child.deliveries()
    assert seq1 != seq2
    child.report([Result.done(seq1, "unfinished")])
    [event] = pool.on_ready(child.conn)
    assert isinstance(event, Reported)
    assert event.results == [Settled(first, Result(protocol.DONE, seq1, "unfinished"), None)]
    assert child.outstanding == {seq2: again}  # still held: drain must not end yet
    assert pool.busy == [child]


def test_a_dead_child_gives_back_its_rows_and_is_replaced(pool):
    ready(pool)
    child = pool.children[0]
    running, waiting = claims(2)
    child.send([running, waiting])
    seq_running = child.deliveries()[0].seq
    child.start_running(seq_running)
    child.process.die(-signal.SIGKILL)
    [event] = pool.on_ready(child.sentinel)
    assert isinstance(event, Died)
    assert event.running == running and event.others == [waiting]
    assert event.exit == "killed by SIGKILL"
    assert child not in pool.children and len(pool.children) == 2  # replaced at once


def test_results_sent_before_a_death_are_settled_first(pool):
    ready(pool)
    child = pool.children[0]
    done, lost = claims(2)
    child.send([done, lost])
    seqs = [d.seq for d in child.deliveries()]
    child.report([Result.done(seqs[0], "finished")])
    child.process.die(1)
    events = pool.on_ready(child.sentinel)
    assert isinstance(events[0], Reported) and events[0].results[0].claim == done
    assert isinstance(events[1], Died) and events[1].others == [lost] and events[1].running is None


def test_a_handler_past_its_timeout_is_killed(pool, monkeypatch):
    monkeypatch.setattr(pool.worker, "timeout", 5)
    ready(pool)
    child = pool.children[0]
    slow, behind = claims(2)
    child.send([slow, behind])
    child.start_running(child.deliveries()[0].seq, started=time.monotonic() - 6)
    events, revoked = pool.check(time.monotonic())
    [event] = events
    assert isinstance(event, TimedOut) and event.claim == slow and event.others == [behind]
    assert child.process.exitcode == -signal.SIGKILL
    assert child not in pool.children and len(pool.children) == 2


def test_rows_behind_a_stuck_handler_are_revoked(pool, caplog):
    ready(pool)
    pool.timed(10, 0.01)  # handlers usually take 1 ms
    child = pool.children[0]
    stuck, *behind = claims(4)
    child.send([stuck, *behind])
    child.start_running(child.deliveries()[0].seq, started=time.monotonic() - 1.0)
    assert pool.room(child, time.monotonic()) == 0  # stuck: no more rows for it
    with caplog.at_level(logging.INFO, logger="django_dbworker.pool"):
        events, revoked = pool.check(time.monotonic())
    assert events == [] and revoked == behind
    assert child.slot[protocol.SLOT_REVOKE] == 1
    # Said in words, at INFO: a slow row among quick ones is routine, not an alarm.
    [said] = [r for r in caplog.records if "given back" in r.getMessage()]
    assert said.levelno == logging.INFO
    assert re.search(r"one handler has run for \d+\.\ds, longer than its rows usually take; "
                     r"the 3 row\(s\) waiting behind it in the same child were given back",
                     said.getMessage()), said.getMessage()
    assert list(child.outstanding.values()) == [stuck]
    # The child then reports the revoked rows SKIPPED: they are no longer its to settle.
    child.report([Result.done(1, "finished"), *[Result.skipped(s) for s in (2, 3, 4)]])
    [event] = pool.on_ready(child.conn)
    assert [s.claim for s in event.results] == [stuck, None, None, None]


def test_a_failed_first_start_stops_set_up_naming_the_cause(pool):
    child = pool.children[0]
    child.other.send((protocol.SETUP_FAILED, "Traceback ...\nModuleNotFoundError: No module named 'gone'"))
    with pytest.raises(ImproperlyConfigured, match="could not start .*No module named 'gone'"):
        pool.on_ready(child.conn, strict=True)


def test_replacements_that_keep_failing_back_off_then_break_the_pool(pool):
    ready(pool)
    pool.children[0].process.die(1)  # a crash: replaced at once
    pool.on_ready(pool.children[0].sentinel)
    failures = 0
    with pytest.raises(PoolBroken, match=f"failed to start {MAX_START_FAILURES} times"):
        while True:
            fresh = next(c for c in pool.children if not c.ready)
            fresh.other.send((protocol.SETUP_FAILED, "ImportError: broken deploy"))
            pool.on_ready(fresh.conn)
            failures += 1
            assert len(pool.children) == 1  # the next one waits for its back-off
            wait = pool.next_deadline() - time.monotonic()
            assert wait == pytest.approx(2 ** (failures - 1), abs=0.5)
            pool.tick(time.monotonic() + wait + 0.01)
            assert len(pool.children) == 2
    assert failures == MAX_START_FAILURES - 1


def test_a_child_killed_while_it_starts_is_no_start_failure(pool):
    child = pool.children[0]
    child.process.die(-signal.SIGKILL)
    pool.on_ready(child.sentinel)
    assert pool.start_failures == 0 and len(pool.children) == 2


def test_a_late_ready_is_only_a_handshake(pool):
    """A READY that arrives with results (a slow replacement) is read as a handshake."""
    child = pool.children[0]
    child.say_ready()
    child.other.send((protocol.RESULTS, [], 0.0, {}))
    assert pool.on_ready(child.conn) == [Reported([])]
    assert child.ready


def test_handles_change_version_when_children_change(pool):
    before = pool.version, set(pool.handles())
    ready(pool)
    pool.children[0].process.die(1)
    pool.on_ready(pool.children[0].sentinel)
    assert pool.version != before[0] and set(pool.handles()) != before[1]
