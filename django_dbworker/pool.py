"""A worker's children: spawned once, reused for many rows, replaced when one dies."""

from __future__ import annotations

import logging
import math
import multiprocessing
import time
from collections.abc import Iterable
from multiprocessing.connection import Connection
from typing import Any

from .bridge import Claim
from .child import SLOT_ID, SLOT_REVOKE, SLOT_SIZE, SLOT_STARTED, child_main
from .registry import Worker

logger = logging.getLogger("django_dbworker.pool")
SPAWN = multiprocessing.get_context("spawn")


class Child:
    """One child process, and the rows sent to it that it has not reported on yet."""

    def __init__(self, worker: Worker, databases: dict[str, str], alias: str,
                 stop: Any) -> None:
        parent_end, child_end = SPAWN.Pipe()
        # Shared memory the child writes before each handler (see child.SLOT_*): no
        # message per row, yet the coordinator knows what runs since when.
        self.slot = SPAWN.RawArray("d", SLOT_SIZE)
        self.process = SPAWN.Process(
            target=child_main,
            args=(child_end, worker.name, worker.handler_path, databases, alias, self.slot,
                  stop),
            name=f"dbworker-{worker.name}",
        )
        self.process.start()
        child_end.close()
        self.conn: Connection = parent_end
        self.ready = False
        self.outstanding: dict[int, Claim] = {}  # execution id -> claim, in send order
        self.sent = 0  # rows this child has been given (for max_tasks_per_child)

    @property
    def busy(self) -> bool:
        return bool(self.outstanding)

    @property
    def sentinel(self) -> int:
        return self.process.sentinel

    def running(self) -> tuple[int, float] | None:
        """(execution id, monotonic start) of the handler running now, if any."""
        execution_id = int(self.slot[SLOT_ID])
        started = self.slot[SLOT_STARTED]
        if execution_id == 0 or int(self.slot[SLOT_ID]) != execution_id:
            return None  # between handlers (or it just moved on)
        return execution_id, started

    def waiting_behind(self, execution_id: int) -> list[Claim]:
        """Rows sent after ``execution_id``: not started while it runs (rows sent before
        it and still unreported are done, in its uncommitted group)."""
        ids = list(self.outstanding)
        if execution_id not in ids:
            return []
        return [self.outstanding[i] for i in ids[ids.index(execution_id) + 1:]]

    def revoke_waiting(self) -> list[Claim]:
        """Take back the rows waiting behind the running handler. The flag is set
        before the running id is read (the child announces an id, then reads the
        flag), so a row is either taken back here or started there, never both."""
        running = self.running()
        if running is None:
            return []
        self.slot[SLOT_REVOKE] = 1
        if int(self.slot[SLOT_ID]) != running[0]:
            return []  # it moved on: the flag makes it hand back the rest as SKIPPED
        waiting = self.waiting_behind(running[0])
        for claim in waiting:
            del self.outstanding[claim.execution_id]
        self.sent -= len(waiting)
        return waiting

    def send(self, claims: list[Claim]) -> None:
        self.conn.send([(c.execution_id, c.source_id, c.token) for c in claims])
        for c in claims:
            self.outstanding[c.execution_id] = c
        self.sent += len(claims)

    def settle(self, execution_id: int) -> Claim | None:
        """The child reported on this row: it is no longer this child's to release."""
        return self.outstanding.pop(execution_id, None)

    def stop(self) -> None:
        """Ask the child to exit once it has run what it was sent."""
        try:
            self.conn.send(None)
        except (OSError, ValueError):
            pass

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(10)
        self.conn.close()

    def join(self, timeout: float) -> None:
        self.process.join(timeout)
        if self.process.is_alive():
            self.kill()
        else:
            self.conn.close()


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

    def __init__(self, worker: Worker, concurrency: int, databases: dict[str, str],
                 alias: str, stop: Any) -> None:
        self.worker = worker
        self.concurrency = concurrency
        self.databases = databases
        self.alias = alias
        self.stop_flag = stop
        self.children: list[Child] = []
        self.row_seconds: float | None = None  # moving average, per row of a group

    def start(self) -> None:
        self.children = [self.spawn() for _ in range(self.concurrency)]

    def spawn(self) -> Child:
        return Child(self.worker, self.databases, self.alias, self.stop_flag)

    def replace(self, child: Child) -> Child:
        """Swap a dead (or retired) child for a fresh one: a broken pool heals itself."""
        child.kill()
        fresh = self.spawn()
        self.children[self.children.index(child)] = fresh
        return fresh

    @property
    def busy(self) -> list[Child]:
        return [c for c in self.children if c.busy]

    def timed(self, rows: int, seconds: float) -> None:
        """A group of ``rows`` took ``seconds``: update the per-row average."""
        if rows <= 0:
            return
        per_row = seconds / rows
        self.row_seconds = per_row if self.row_seconds is None else (
            0.8 * self.row_seconds + 0.2 * per_row)

    def capacity(self, child: Child) -> int:
        if self.row_seconds is None:
            ahead = self.FIRST_AHEAD
        else:
            ahead = max(1, min(self.MAX_AHEAD,
                               math.ceil(self.AHEAD_SECONDS / max(self.row_seconds, 1e-6))))
        limit = self.worker.max_tasks_per_child
        if limit is not None:
            ahead = min(ahead, limit - child.sent)  # it retires after `limit` rows
        return max(ahead, 0)

    def stuck_after(self) -> float:
        return max(self.STUCK_SECONDS, self.STUCK_FACTOR * (self.row_seconds or 0.0))

    def stuck_since(self, child: Child) -> float | None:
        """When the running handler of ``child`` counts as stuck (monotonic), if any."""
        running = child.running()
        return running[1] + self.stuck_after() if running else None

    def room(self, child: Child) -> int:
        """Rows to send this child now: none until it is down to half its share (so
        claims come in batches), then enough to fill it; none while it is stuck."""
        if not child.ready:
            return 0  # (a dead child's send fails; its sentinel has it replaced)
        stuck = self.stuck_since(child)
        if stuck is not None and time.monotonic() >= stuck:
            return 0
        capacity = self.capacity(child)
        held = len(child.outstanding)
        return capacity - held if held * 2 <= capacity and held < capacity else 0

    def free_slots(self) -> int:
        return sum(self.room(c) for c in self.children)

    def distribute(self, claims: Iterable[Claim]) -> list[Claim]:
        """Send claimed rows to the children with room; returns any left over."""
        todo = list(claims)
        for child in sorted(self.children, key=lambda c: len(c.outstanding)):
            n = self.room(child)
            if n and todo:
                batch, todo = todo[:n], todo[n:]
                try:
                    child.send(batch)
                except (OSError, ValueError):
                    todo = batch + todo  # it died as we wrote: its sentinel says so next
        return todo

    def claims(self) -> list[Claim]:
        return [claim for c in self.children for claim in c.outstanding.values()]

    def retiring(self, child: Child) -> bool:
        limit = self.worker.max_tasks_per_child
        return limit is not None and child.sent >= limit and not child.busy
