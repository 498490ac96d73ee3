"""What a handler returns: ``Finished()`` (done) or ``Unfinished()`` (run it again from
the start, without using up a retry)."""

from __future__ import annotations

from dataclasses import dataclass

from .status import ExecutionStatus


@dataclass(frozen=True, slots=True)
class Finished:
    """The row is done: it is never claimed again."""

    status = ExecutionStatus.FINISHED


@dataclass(frozen=True, slots=True)
class Unfinished:
    """More to do: the row is claimable again (while eligible) and the handler starts over."""

    status = ExecutionStatus.UNFINISHED


Outcome = Finished | Unfinished
