"""What a coordinator and its children say to each other, and the claims they talk about.

The coordinator sends a child *deliveries*: claimed rows, each under a sequence number
that is unique within that child. The child reports on each delivery by that number, so
a row claimed again before the child's report on its previous run has arrived is two
deliveries, never one (the row is claimable the moment the child commits, and the
child's message may arrive after the next claim).

Everything here is plain data: named tuples cross the pipe (cheap to pickle: a tuple with a
class name), dataclasses stay in the coordinator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

# -- child -> coordinator ------------------------------------------------------------------
READY = "ready"  # (READY, pid): set-up done, send rows
SETUP_FAILED = "setup_failed"  # (SETUP_FAILED, traceback text): the child exits
# (RESULTS, [Result, ...], seconds the group took, {seq: Timing} of the rows that ran)
RESULTS = "results"

# Result kinds, one per delivery.
DONE = "done"  # committed: Result.status is the outcome (finished, unfinished, retried, failed)
LOST = "lost"  # the claim was taken over; nothing was saved
INTERRUPTED = "interrupted"  # the database went away while it ran (Result.error); release the row
SKIPPED = "skipped"  # never started (stopping, revoked, or the database went away first)

# -- the shared slot ------------------------------------------------------------------------
# A child writes it before each handler: (delivery seq, time.monotonic() at start); seq 0
# between handlers. The coordinator reads it for timeouts and to know which row was running
# when a child died; CLOCK_MONOTONIC is system-wide on Linux and macOS. SLOT_REVOKE is the
# coordinator's: set, the child starts none of the rows it holds and reports them SKIPPED.
SLOT_SEQ, SLOT_STARTED, SLOT_REVOKE = 0, 1, 2
SLOT_SIZE = 3


class Delivery(NamedTuple):
    """One claimed row, sent to a child (coordinator -> child)."""

    seq: int  # unique within the child: what its Result names
    execution_id: int
    source_id: str  # the source row's key, as text
    token: str  # the claim token: the child's commit is guarded by it
    attempt: int  # this claim's attempt number


class Result(NamedTuple):
    """What became of one delivery (child -> coordinator). ``detail`` holds what the kind
    has to say, and only two kinds have something: read it as ``status`` or ``error``."""

    kind: str  # DONE, LOST, INTERRUPTED or SKIPPED
    seq: int  # the delivery's
    detail: str | None = None  # DONE: the outcome; INTERRUPTED: the error; else None

    @classmethod
    def done(cls, seq: int, status: str) -> Result:
        return cls(DONE, seq, status)

    @classmethod
    def lost(cls, seq: int) -> Result:
        return cls(LOST, seq)

    @classmethod
    def interrupted(cls, seq: int, error: str) -> Result:
        return cls(INTERRUPTED, seq, error)

    @classmethod
    def skipped(cls, seq: int) -> Result:
        return cls(SKIPPED, seq)

    @property
    def status(self) -> str | None:
        """DONE: what the row's commit made of it (finished, unfinished, retried, failed;
        also the name of the event counted for it); None for other kinds."""
        return self.detail if self.kind == DONE else None

    @property
    def error(self) -> str | None:
        """INTERRUPTED: the database's error, described; None for other kinds."""
        return self.detail if self.kind == INTERRUPTED else None


class Timing(NamedTuple):
    """How a row that ran took its time (child -> coordinator, by delivery seq)."""

    seconds: float  # its handler's
    started_at: float  # when its handler started, as time.time()


@dataclass(frozen=True, slots=True)
class Claim:
    """One claimed row: what a child needs to run it, and what a release restores."""

    execution_id: int
    source_id: str
    token: str
    previous_status: str
    attempt: int  # this claim's attempt number (attempts after the claim)
    ready_at: float | None = None  # when the row became claimable (time.time() scale)
    crashes: int = 0  # times in a row its process died while it ran, before this claim
    worker: str = ""  # the worker's name

    def delivery(self, seq: int) -> Delivery:
        return Delivery(seq, self.execution_id, self.source_id, self.token, self.attempt)
