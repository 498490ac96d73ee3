"""The attempt a handler runs in, as the handler's code can ask for it."""

from __future__ import annotations

import os
from contextvars import ContextVar
from dataclasses import dataclass

from .protocol import Delivery


@dataclass(frozen=True, slots=True)
class Attempt:
    """The attempt a handler runs in (see ``current_attempt``)."""

    execution_id: int
    number: int  # 1 for the first attempt (attempts count again after Unfinished())
    worker_id: str  # the coordinator's host:pid, as in claimed_by


_current: ContextVar[Attempt | None] = ContextVar("dbworker_attempt", default=None)


def current_attempt() -> Attempt:
    """The attempt the running handler is in (inside a child only)."""
    attempt = _current.get()
    if attempt is None:
        raise RuntimeError("current_attempt() is for code that a child runs as a handler")
    return attempt


def enter(row: Delivery) -> None:
    from ..coordinator.identity import host

    _current.set(Attempt(row.execution_id, row.attempt, f"{host()}:{os.getppid()}"))


