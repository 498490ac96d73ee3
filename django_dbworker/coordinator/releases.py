"""Rows a coordinator gives back, and keeps trying to give back until the database takes
them (it may be down, or SQLite's lock held by a running handler). Until then they are
still this coordinator's claims: renewed with the others, and a stop waits for them.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

from ..processes.protocol import Claim
from ..store.bridge import Bridge
from ..store.engine import DATABASE_ERRORS
from ..store.retry import RetryDecision
from .outage import DatabaseHealth

logger = logging.getLogger("django_dbworker.coordinator")


@dataclass(frozen=True, slots=True)
class Release:
    claim: Claim
    decision: RetryDecision | None = None  # None: never started, the attempt is undone
    error: tuple[str, str] | None = None  # (error type, message) to record
    crashed: bool = False  # its process died while it ran


class ReleaseQueue:
    def __init__(self, bridge: Bridge, health: DatabaseHealth) -> None:
        self.bridge = bridge
        self.health = health
        self._pending: deque[Release] = deque()

    def __len__(self) -> int:
        return len(self._pending)

    def claims(self) -> list[Claim]:
        return [r.claim for r in self._pending]

    def add(self, claim: Claim, decision: RetryDecision | None = None,
            error: tuple[str, str] | None = None, *, crashed: bool = False) -> None:
        """Give a held row back now, or as soon as the database takes it."""
        self._pending.append(Release(claim, decision, error, crashed))
        if self.health.down_since is None:  # in an outage only the probe calls
            self.flush()

    def flush(self, patience: float = 0.0) -> None:
        """Retry the releases the database refused, in order; with ``patience`` (seconds,
        at shutdown) keep trying that long before leaving the rest to their leases."""
        deadline = time.monotonic() + patience
        while self._pending:
            release = self._pending[0]
            try:
                self.bridge.release(release.claim, release.decision, release.error,
                                    crashed=release.crashed)
            except DATABASE_ERRORS as exc:
                self.health.failed(exc)
                if time.monotonic() >= deadline:
                    if patience:
                        logger.warning("%d row(s) could not be released; they become "
                                       "claimable when their leases end", len(self._pending))
                    return
                time.sleep(min(self.health.poll_seconds, 1.0))
                continue
            self._pending.popleft()
