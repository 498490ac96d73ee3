"""A worker's children: spawned once, reused for many rows, replaced when one dies.

The pool owns its children from start to end: the handshake (one code path, for the first
children and for every replacement), sending rows, turning what children report into
events, exits, timeouts, revoking rows that wait behind a stuck handler, and killing. The
coordinator decides what the events mean for the rows (release them, count them); it
never touches a child's state itself.
"""

from __future__ import annotations

import logging
import math
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from django.core.exceptions import ImproperlyConfigured

from ..registration.registry import Worker
from . import protocol
from .children import ChildProcess, describe_exit
from .protocol import Claim, Result, Timing

logger = logging.getLogger("django_dbworker.pool")
# A child must be ready this long after it was spawned (Django set-up, imports).
CHILD_START_SECONDS = 120.0
# A replacement that fails to start is tried again after 1, 2, 4, 8 s; after this many
# failures in a row the pool gives up (the coordinator stops with the error).
MAX_START_FAILURES = 5
KILLED_FROM_OUTSIDE = {-signal.SIGKILL, -signal.SIGTERM}


class PoolBroken(ImproperlyConfigured):
    """The pool cannot keep children running (they fail to start): stop with the error."""


# -- events the coordinator acts on ------------------------------------------------------------
class Settled(NamedTuple):
    """One result a child reported, with the claim it settles."""

    claim: Claim | None  # None: the row had been given back already (a revoked row)
    result: Result
    timing: Timing | None  # for a row that ran


@dataclass
class Reported:
    """A child reported on a group: each result with the claim it settles."""

    results: list[Settled]


@dataclass
class Died:
    """A child died: ``running`` was its running row (the attempt counts), ``others`` the
    rows it held that never reached a commit."""

    running: Claim | None
    others: list[Claim]
    exit: str


@dataclass
class TimedOut:
    """A handler ran past the worker's timeout; its child was killed."""

    claim: Claim
    others: list[Claim] = field(default_factory=list)


Event = Reported | Died | TimedOut


class Pool:
    """The children of one worker, and how many rows each may hold.

    Rows go to a child ahead of need (they wait in its pipe), so a child never waits for
    a claim round trip and one claim statement serves many rows. How far ahead adapts to
    the handler: about ``AHEAD_SECONDS`` of work per child, at most ``MAX_AHEAD`` rows,
    and a single row for handlers slower than that, so a coordinator never sits on rows
    another could start now. Rows a child holds are renewed like running ones and
    released when it stops or dies.
    """

    AHEAD_SECONDS = 0.1
    MAX_AHEAD = 32
    FIRST_AHEAD = 1  # before any handler has been timed
    # A handler running this much longer than usual (and at least STUCK_SECONDS) is
    # "stuck": its child gets no more rows, and the rows waiting behind it are given
    # back so that other children and coordinators can run them.
    STUCK_FACTOR = 20
    STUCK_SECONDS = 0.5
    REALLY_STUCK = 60.0  # seconds: past this a waiting row's give-back is a warning

    def __init__(self, worker: Worker, concurrency: int,
                 spawn: Callable[[], ChildProcess]) -> None:
        self.worker = worker
        self.concurrency = concurrency
        self._spawn = spawn
        self.children: list[ChildProcess] = []
        self.retired: list[ChildProcess] = []  # told to exit; watched until they do
        self.row_seconds: float | None = None  # moving average, per row of a group
        self.start_failures = 0  # replacements that failed to start, in a row
        self._respawn_at: float | None = None
        self._handles: dict[Any, ChildProcess] | None = None
        self.version = 0  # changes whenever the children (so the handles) change
        self.stopping = False

    # -- children ---------------------------------------------------------------------------
    def _changed(self) -> None:
        self._handles = None
        self.version += 1

    def start(self) -> None:
        self.children = [self._spawn() for _ in range(self.concurrency)]
        self._changed()

    @property
    def starting(self) -> bool:
        return any(not c.ready for c in self.children)

    def handles(self) -> dict[Any, ChildProcess]:
        """Pipes and process sentinels to wait on, each with its child (cached until the
        children change)."""
        if self._handles is None:
            self._handles = {}
            for c in [*self.children, *self.retired]:
                self._handles[c.conn] = c
                self._handles[c.sentinel] = c
        return self._handles

    def _replace(self, old: ChildProcess) -> None:
        """Drop ``old`` (dead, killed or retiring) and spawn its successor now, or later
        when starts keep failing."""
        if old in self.children:
            self.children.remove(old)
        self._changed()
        if self.stopping:
            return
        if self.start_failures == 0:
            self.children.append(self._spawn())
        else:
            delay = min(2.0 ** (self.start_failures - 1), 30.0)
            self._respawn_at = time.monotonic() + delay

    def tick(self, now: float) -> None:
        """Spawn children that are due (after failed starts), and give up on a child that
        never became ready."""
        if self._respawn_at is not None and now >= self._respawn_at and not self.stopping:
            self._respawn_at = None
            while len(self.children) < self.concurrency:
                self.children.append(self._spawn())
            self._changed()
        for c in list(self.children):
            if not c.ready and now - c.spawned_at > CHILD_START_SECONDS:
                c.kill()
                self._start_failed(c, f"not ready within {CHILD_START_SECONDS:.0f}s")

    def next_deadline(self) -> float | None:
        """The next moment ``tick`` or ``check`` has something to do, if any."""
        deadlines = [] if self._respawn_at is None else [self._respawn_at]
        for c in self.children:
            running = c.running() if c.busy else None
            if running is None:
                continue
            if self.worker.timeout is not None:
                deadlines.append(running.started + self.worker.timeout)
            if len(c.outstanding) > 1:
                deadlines.append(running.started + self.stuck_after())
        return min(deadlines) if deadlines else None

    # -- what children say --------------------------------------------------------------------
    def on_ready(self, handle: Any, *, strict: bool = False) -> list[Event]:
        """A watched pipe or sentinel is ready. ``strict`` (the first start): a child that
        cannot start stops the coordinator at once, naming why."""
        child = self.handles().get(handle)
        if child is None:
            return []
        if handle is child.conn:
            return self._read(child, strict)
        return self._exited(child, strict)

    def _read(self, child: ChildProcess, strict: bool) -> list[Event]:
        events: list[Event] = []
        try:
            while not child.conn.closed and child.conn.poll():
                message = child.conn.recv()
                event = self._message(child, message, strict)
                if event is not None:
                    events.append(event)
        except (EOFError, OSError):
            pass  # it is gone; its sentinel says so
        return events

    def _message(self, child: ChildProcess, message: Any, strict: bool) -> Event | None:
        kind = message[0]
        if kind == protocol.READY:
            child.ready = True
            self.start_failures = 0
            return None
        if kind == protocol.SETUP_FAILED:
            last = str(message[1]).strip().splitlines()[-1] if message[1] else ""
            child.kill()
            if strict:
                raise ImproperlyConfigured(
                    f"A child for worker {self.worker.name!r} could not start "
                    f"({self.worker.handler_path}): {last}")
            self._start_failed(child, last)
            return None
        _, results, seconds, timings = message  # (RESULTS, [Result], seconds, {seq: Timing})
        settled = [Settled(child.settle(r.seq), r, timings.get(r.seq)) for r in results]
        self.timed(sum(1 for s in settled if s.result.kind != protocol.SKIPPED), seconds)
        for s in settled:
            if s.result.kind == protocol.SKIPPED and s.claim is not None:
                child.sent -= 1  # it never ran there
        if child.retiring is False and self._retires(child):
            self._retire(child)
        return Reported(settled)

    def _exited(self, child: ChildProcess, strict: bool) -> list[Event]:
        child.reap()
        events = self._read(child, strict)  # what it sent before it died comes first
        code = child.exitcode
        if child in self.retired:
            self.retired.remove(child)
            self._changed()
            child.close()
            return events
        if child not in self.children:
            return events
        if not child.ready and code in KILLED_FROM_OUTSIDE:
            # Killed while starting (an operator, the OOM killer): nothing wrong with its
            # code, so no start failure; its successor starts now.
            logger.error("A child of worker %s was %s while it started; starting another",
                         self.worker.name, describe_exit(code))
            child.close()
            self._replace(child)
            return events
        if not child.ready:
            if strict:
                raise ImproperlyConfigured(
                    f"A child for worker {self.worker.name!r} could not start "
                    f"({self.worker.handler_path}): it died during set-up ({describe_exit(code)})")
            self._start_failed(child, f"it died during set-up ({describe_exit(code)})")
            return events
        if self.stopping and code == 0 and not child.outstanding:
            self.children.remove(child)  # told to stop, it handed everything back
            self._changed()
            child.close()
            return events
        running, others = child.take_all()
        child.close()
        self._replace(child)
        if running is not None:
            logger.error("A child of worker %s died (%s) while running execution %s; its row "
                         "is released, and %d other row(s) it held go back untouched",
                         self.worker.name, describe_exit(code), running.execution_id,
                         len(others))
        elif not self.stopping:
            logger.error("A child of worker %s died (%s) between handlers; %d row(s) it held "
                         "go back untouched (a row it had already committed stays as "
                         "committed)", self.worker.name, describe_exit(code), len(others))
        events.append(Died(running, others, describe_exit(code)))
        return events

    def _start_failed(self, child: ChildProcess, why: str) -> None:
        child.close()
        self.start_failures += 1
        if self.start_failures >= MAX_START_FAILURES:
            raise PoolBroken(
                f"Children of worker {self.worker.name!r} failed to start "
                f"{self.start_failures} times in a row ({self.worker.handler_path}): {why}")
        delay = min(2.0 ** (self.start_failures - 1), 30.0)
        logger.error("A child of worker %s could not start (%s); trying again in %.0fs "
                     "(failure %d of %d)", self.worker.name, why, delay, self.start_failures,
                     MAX_START_FAILURES)
        self._replace(child)

    # -- retiring (max_tasks_per_child) -----------------------------------------------------------
    def _retires(self, child: ChildProcess) -> bool:
        limit = self.worker.max_tasks_per_child
        return limit is not None and child.sent >= limit and not child.busy

    def _retire(self, child: ChildProcess) -> None:
        child.retiring = True
        child.stop()
        self.retired.append(child)
        self._replace(child)

    # -- timeouts and stuck handlers --------------------------------------------------------------
    def check(self, now: float) -> tuple[list[Event], list[Claim]]:
        """Handlers past the worker's timeout (their children are killed and replaced),
        and rows given back from behind stuck handlers."""
        events: list[Event] = []
        revoked: list[Claim] = []
        for child in list(self.children):
            running = child.running() if child.busy else None
            if running is None:
                continue
            limit = self.worker.timeout
            if limit is not None and now - running.started >= limit:
                events.extend(self._time_out(child, running.seq, limit))
            elif len(child.outstanding) > 1 and now >= running.started + self.stuck_after():
                waiting = child.revoke_waiting()
                if waiting:
                    # Routine (a slow row among quick ones), unless it runs for minutes.
                    level = logging.WARNING if now - running.started > self.REALLY_STUCK else logging.INFO
                    logger.log(level,
                               "Worker %s: one handler has run for %.1fs, longer than its "
                               "rows usually take; the %d row(s) waiting behind it in the same "
                               "child were given back, so other children or coordinators run "
                               "them meanwhile", self.worker.name, now - running.started,
                               len(waiting))
                revoked.extend(waiting)
        return events, revoked

    def _time_out(self, child: ChildProcess, seq: int, limit: float) -> list[Event]:
        claim = child.outstanding.get(seq)
        child.kill()
        events = self._read(child, strict=False)  # results committed before the kill
        if claim is None or seq not in child.outstanding:
            # It finished that row just now: only the rows it held are left.
            running, others = None, [*child.outstanding.values()]
        else:
            child.outstanding.pop(seq)
            running, others = claim, [*child.outstanding.values()]
        child.outstanding.clear()
        child.close()
        self._replace(child)
        if running is None:
            events.append(Died(None, others, describe_exit(child.exitcode)))
        else:
            logger.error("Worker %s: execution %s ran past its %ss timeout; its child was "
                         "killed", self.worker.name, running.execution_id, limit)
            events.append(TimedOut(running, others))
        return events

    def stuck_after(self) -> float:
        # Before any group was timed (a child's first rows include its warm-up), no
        # handler counts as slow.
        if self.row_seconds is None:
            return float("inf")
        return max(self.STUCK_SECONDS, self.STUCK_FACTOR * self.row_seconds)

    # -- sending rows -------------------------------------------------------------------------------
    def timed(self, rows: int, seconds: float) -> None:
        """A group of ``rows`` took ``seconds``: update the per-row average."""
        if rows <= 0:
            return
        per_row = seconds / rows
        self.row_seconds = per_row if self.row_seconds is None else (
            0.8 * self.row_seconds + 0.2 * per_row)

    @classmethod
    def rows_ahead(cls, row_seconds: float | None, left: int | None = None) -> int:
        """How many rows a child may hold at once, given the per-row average (None: no
        handler timed yet) and how many rows it may still take before it retires (None:
        no max_tasks_per_child)."""
        if row_seconds is None:
            ahead = cls.FIRST_AHEAD
        else:
            ahead = max(1, min(cls.MAX_AHEAD,
                               math.ceil(cls.AHEAD_SECONDS / max(row_seconds, 1e-6))))
        if left is not None:
            ahead = min(ahead, left)  # it retires after max_tasks_per_child rows
        return max(ahead, 0)

    @staticmethod
    def top_up(capacity: int, held: int) -> int:
        """Rows to send a child that holds ``held`` of its ``capacity``: none until it is
        down to half (so claims come in batches), then enough to fill it."""
        return capacity - held if held * 2 <= capacity and held < capacity else 0

    def capacity(self, child: ChildProcess) -> int:
        limit = self.worker.max_tasks_per_child
        return self.rows_ahead(self.row_seconds, None if limit is None else limit - child.sent)

    def room(self, child: ChildProcess, now: float) -> int:
        """Rows to send this child now: none until it is down to half its share (so
        claims come in batches), then enough to fill it; none while it is starting,
        stuck, or answering a revocation."""
        if not child.ready or child.slot[protocol.SLOT_REVOKE]:
            return 0
        running = child.running() if child.busy else None
        if running is not None and now >= running.started + self.stuck_after():
            return 0
        return self.top_up(self.capacity(child), len(child.outstanding))

    def free_slots(self, now: float) -> int:
        return sum(self.room(c, now) for c in self.children)

    def distribute(self, claims: Iterable[Claim], now: float) -> list[Claim]:
        """Send claimed rows to the children with room; returns any left over."""
        todo = list(claims)
        for child in sorted(self.children, key=lambda c: len(c.outstanding)):
            n = self.room(child, now)
            if n and todo:
                batch, todo = todo[:n], todo[n:]
                try:
                    child.send(batch)
                except (OSError, ValueError):
                    todo = batch + todo  # it died as we wrote: its sentinel says so next
        return todo

    def claims(self) -> list[Claim]:
        """Every row this pool's children hold (renewed with the running ones)."""
        return [claim for c in self.children for claim in c.outstanding.values()]

    @property
    def busy(self) -> list[ChildProcess]:
        return [c for c in self.children if c.busy]

    # -- stopping ---------------------------------------------------------------------------------
    def stop(self) -> None:
        """Graceful: children hand back what they have not started, then exit."""
        self.stopping = True
        self._respawn_at = None
        for c in [*self.children, *self.retired]:
            c.stop()

    def kill(self) -> list[Claim]:
        """Kill every child at once; returns the rows they held (none reached a commit)."""
        self.stopping = True
        held: list[Claim] = []
        for c in [*self.children, *self.retired]:
            c.kill()
            running, others = c.take_all()
            held.extend([running, *others] if running is not None else others)
            c.close()
        self.children, self.retired = [], []
        self._changed()
        return held

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for c in [*self.children, *self.retired]:
            c.process.join(max(deadline - time.monotonic(), 0))
            if c.process.is_alive():
                c.kill()
            c.close()
        self.children, self.retired = [], []
        self._changed()


def start_all(pools: Iterable[Pool]) -> None:
    """Start every pool's first children and wait for their handshake (the strict one:
    a child that cannot start stops set-up, naming why). On failure nothing is left
    running."""
    from multiprocessing.connection import wait

    pools = list(pools)
    try:
        for pool in pools:
            pool.start()
        deadline = time.monotonic() + CHILD_START_SECONDS
        while any(p.starting for p in pools):
            watched = {h: p for p in pools for h in p.handles()}
            ready = wait(list(watched), timeout=max(deadline - time.monotonic(), 0))
            if not ready:
                raise ImproperlyConfigured(
                    f"Worker children did not start within {CHILD_START_SECONDS:.0f}s.")
            for handle in ready:
                watched[handle].on_ready(handle, strict=True)
    except BaseException:
        for pool in pools:
            pool.kill()
        raise
