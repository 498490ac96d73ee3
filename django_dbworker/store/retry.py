"""The retry policy: what a failed attempt becomes. One answer, whoever asks.

A child asks when a handler raised; the coordinator asks when it killed a handler past its
timeout, when a child died while running a row, and when it recovers a row whose lease
expired (its holder is gone). All of them get their decision from the same object.

A decision says *how long* a retry waits, never *when*: whoever writes it turns the delay
into a time on the database's clock (``now() + delay``), the clock that leases and due
times are compared with, so two hosts whose clocks differ agree on when a retry is due.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from ..status import ExecutionStatus

# A row whose process dies while its handler runs this many times in a row ends FAILED,
# whatever max_attempts says (the worker option max_crashes changes it): a row that
# kills its child every time is quarantined, not retried at the head of the line.
MAX_CRASHES = 3
# A back-off never grows past a year: beyond, the time would overflow the database's
# interval types (2 ** attempts grows fast), and nobody waits that long for a retry.
MAX_DELAY_SECONDS = 366 * 24 * 3600.0


@dataclass(frozen=True, slots=True)
class RetryDecision:
    status: ExecutionStatus  # UNFINISHED (retried after ``delay``) or FAILED (final)
    # Seconds from now (the database's now) until the retry is due; None: claimable at
    # once (UNFINISHED) or never again (FAILED).
    delay: float | None
    # Whether the attempt counts as a failed one (metrics: retried or failed). Not so for
    # an interruption without max_attempts: the row is simply claimable again.
    failed_attempt: bool = True

    @property
    def retried(self) -> bool:
        return self.status == ExecutionStatus.UNFINISHED


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """``max_attempts`` None: a failure is final. Otherwise attempt *n + 1* waits
    ``backoff * 2 ** (n - 1)`` seconds, scaled by a random factor in [0.5, 1] (jitter, so
    rows that failed together do not all come back together)."""

    max_attempts: int | None = None
    backoff: float = 10.0
    max_crashes: int = MAX_CRASHES

    def delay(self, attempts: int) -> float:
        # (The exponent capped too: 2.0 ** 1024 is no float.)
        step = min(self.backoff * (2 ** min(max(attempts - 1, 0), 64)), MAX_DELAY_SECONDS)
        return step * random.uniform(0.5, 1.0)

    def after_failure(self, attempts: int) -> RetryDecision:
        """The handler raised (or ran past its timeout). ``attempts``: how many attempts
        have been made, the failed one included."""
        if self.max_attempts is not None and attempts < self.max_attempts:
            return RetryDecision(ExecutionStatus.UNFINISHED, self.delay(attempts))
        return RetryDecision(ExecutionStatus.FAILED, None)

    def after_crash(self, attempts: int, crashes: int) -> RetryDecision:
        """The row's process died while its handler ran (killed, os._exit, a segfault):
        ``crashes`` times in a row now, this one included. It ends FAILED at
        ``max_crashes``; before that it waits its back-off (the crash count's, or with
        ``max_attempts`` the attempt's, which also ends it at ``max_attempts``), so the
        rows behind it run meanwhile."""
        if crashes >= self.max_crashes:
            return RetryDecision(ExecutionStatus.FAILED, None)
        if self.max_attempts is not None:
            return self.after_failure(attempts)
        return RetryDecision(ExecutionStatus.UNFINISHED, self.delay(crashes))

    def after_interruption(self, attempts: int, crashes: int | None = None) -> RetryDecision:
        """The attempt was cut short from outside, with no sign that the row caused it:
        its lease expired (its coordinator or machine went away), the database failed
        under it. Work is never lost to that: without ``max_attempts`` the row is
        claimable again at once; with it, the attempt counts like a failure. ``crashes``
        (where it counts as one: a connection that broke under the handler) ends it
        FAILED at ``max_crashes``, as a handler that breaks its own connection every
        time would otherwise loop."""
        if crashes is not None and crashes >= self.max_crashes:
            return RetryDecision(ExecutionStatus.FAILED, None)
        if self.max_attempts is None:
            return RetryDecision(ExecutionStatus.UNFINISHED, None, failed_attempt=False)
        return self.after_failure(attempts)
