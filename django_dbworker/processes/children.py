"""One spawned child as the coordinator holds it: its process, pipe and shared slot, and
the rows it was sent and has not reported on."""

from __future__ import annotations

import logging
import multiprocessing
import signal
import time
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

from ..registration.registry import Worker
from . import protocol
from .protocol import Claim

SPAWN = multiprocessing.get_context("spawn")


class Running(NamedTuple):
    """The handler a child runs now, as its shared slot says."""

    seq: int  # its delivery's
    started: float  # time.monotonic() when it started


class ChildProcess:
    """One spawned child, its pipe and shared slot, and the rows it holds."""

    def __init__(self, worker: Worker, databases: dict[str, str], alias: str,
                 stop: Any) -> None:
        from . import main_guard
        from .child import child_main

        parent_end, child_end = SPAWN.Pipe()
        self.slot = SPAWN.RawArray("d", protocol.SLOT_SIZE)
        self.process = SPAWN.Process(
            target=child_main,
            args=(child_end, worker.name, worker.handler_path, databases, alias, self.slot,
                  stop, logging.getLogger("django_dbworker").getEffectiveLevel()),
            name=f"dbworker-{worker.name}",
        )
        main_guard.start(self.process, worker.handler_path)  # not an unguarded __main__
        child_end.close()
        self.conn: Connection = parent_end
        self.spawned_at = time.monotonic()
        self.ready = False
        self.retiring = False  # told to exit after its rows (max_tasks_per_child)
        # Deliveries it has not reported on, by sequence number, in send order.
        self.outstanding: dict[int, Claim] = {}
        self.sent = 0  # rows given to it (for max_tasks_per_child)
        self._next_seq = 1

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def sentinel(self) -> int:
        return self.process.sentinel

    @property
    def exitcode(self) -> int | None:
        return self.process.exitcode

    @property
    def busy(self) -> bool:
        return bool(self.outstanding)

    def running(self) -> Running | None:
        """The handler running now, if any."""
        seq = int(self.slot[protocol.SLOT_SEQ])
        started = self.slot[protocol.SLOT_STARTED]
        if seq == 0 or int(self.slot[protocol.SLOT_SEQ]) != seq:
            return None  # between handlers (or it just moved on)
        return Running(seq, started)

    def running_claim(self) -> Claim | None:
        running = self.running()
        return None if running is None else self.outstanding.get(running.seq)

    def send(self, claims: list[Claim]) -> None:
        deliveries = []
        for claim in claims:
            deliveries.append(claim.delivery(self._next_seq))
            self._next_seq += 1
        self.conn.send(deliveries)  # raises if the child is gone
        for delivery, claim in zip(deliveries, claims, strict=True):
            self.outstanding[delivery.seq] = claim
        self.sent += len(claims)

    def settle(self, seq: int) -> Claim | None:
        """The child reported on this delivery: it is no longer the child's to release."""
        return self.outstanding.pop(seq, None)

    def revoke_waiting(self) -> list[Claim]:
        """Take back the rows waiting behind the running handler. The flag is set before
        the running delivery is read (the child announces a delivery, then reads the
        flag), so a row is either taken back here or started there, never both."""
        running = self.running()
        if running is None:
            return []
        self.slot[protocol.SLOT_REVOKE] = 1
        if int(self.slot[protocol.SLOT_SEQ]) != running.seq:
            return []  # it moved on: the flag makes it hand back the rest as SKIPPED
        seqs = list(self.outstanding)
        if running.seq not in seqs:
            return []
        # Deliveries sent before the running one and still unreported are done, in its
        # uncommitted group; those after it have not started.
        waiting = seqs[seqs.index(running.seq) + 1:]
        self.sent -= len(waiting)
        return [self.outstanding.pop(seq) for seq in waiting]

    def take_all(self) -> tuple[Claim | None, list[Claim]]:
        """Everything it holds, as (the running row's claim, the others), and forget it."""
        running = self.running_claim()
        others = [c for c in self.outstanding.values() if c is not running]
        self.outstanding.clear()
        return running, others

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

    def reap(self) -> None:
        """After its sentinel fired: the kernel closes a dying process's files a moment
        before the parent can collect its exit status, so wait for that moment."""
        self.process.join(5)

    def close(self) -> None:
        self.conn.close()


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
