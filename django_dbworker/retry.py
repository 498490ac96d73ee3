"""The retry policy: what a failed attempt becomes. One answer, whoever asks.

A child asks when a handler raised; the coordinator asks when it killed a handler past its
timeout, when a child died while running a row, and when it recovers a row whose lease
expired (its holder is gone). All of them get their decision from the same object.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from .status import ExecutionStatus


@dataclass(frozen=True, slots=True)
class RetryDecision:
    status: ExecutionStatus  # UNFINISHED (retried at next_attempt_at) or FAILED (final)
    next_attempt_at: datetime | None
    # Whether the attempt counts as a failed one (metrics: retried or failed). Not so for
    # an interruption without max_attempts: the row is simply claimable again.
    failed_attempt: bool = True

    @property
    def retried(self) -> bool:
        return self.status == ExecutionStatus.UNFINISHED

    def values(self, now: datetime) -> dict[str, Any]:
        """Execution fields to write with this decision."""
        if self.retried:
            return {"status": self.status.value, "next_attempt_at": self.next_attempt_at}
        return {"status": self.status.value, "next_attempt_at": None, "finished_at": now}


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """``max_attempts`` None: a failure is final. Otherwise attempt *n + 1* waits
    ``backoff * 2 ** (n - 1)`` seconds, scaled by a random factor in [0.5, 1] (jitter, so
    rows that failed together do not all come back together)."""

    max_attempts: int | None = None
    backoff: float = 10.0

    def delay(self, attempts: int) -> float:
        step = self.backoff * (2 ** max(attempts - 1, 0))
        return step * random.uniform(0.5, 1.0)

    def after_failure(self, attempts: int, now: datetime) -> RetryDecision:
        """The handler raised (or ran past its timeout). ``attempts``: how many attempts
        have been made, the failed one included."""
        if self.max_attempts is not None and attempts < self.max_attempts:
            return RetryDecision(ExecutionStatus.UNFINISHED,
                                 now + timedelta(seconds=self.delay(attempts)))
        return RetryDecision(ExecutionStatus.FAILED, None)

    def after_interruption(self, attempts: int, now: datetime) -> RetryDecision:
        """The attempt was cut short from outside: its child died, its lease expired, the
        database went away. Work is never lost to that: without ``max_attempts`` the row
        is claimable again at once; with it, the attempt counts like a failure (so a row
        that kills its child every time ends FAILED instead of looping)."""
        if self.max_attempts is None:
            return RetryDecision(ExecutionStatus.UNFINISHED, None, failed_attempt=False)
        return self.after_failure(attempts, now)
