"""When a worker's pool may claim next: at once after work, doubling waits while idle."""

from __future__ import annotations

# Where no NOTIFY wakes the coordinator, it looks for changes every PROBE_SECONDS (on its
# timer, or in MariaDB's server: see .changewait), and after this long without a change
# half as often: each look costs a wake-up and a query (about 0.3 ms of CPU on a small
# VM), which at PROBE_SECONDS kept an idle coordinator above 1 % of a core. A change
# brings the full rate back at once.
QUIET_SECONDS = 1.0
QUIET_FACTOR = 2.0


class Backoff:
    def __init__(self, first: float, most: float) -> None:
        self.first, self.most = first, most
        self.delay = first
        self.next_at = 0.0
        # The last claim found nothing, and nothing has happened since that could have
        # made a row claimable (drain exits when every worker is exhausted and idle).
        self.exhausted = False

    def found_work(self) -> None:
        self.delay, self.next_at, self.exhausted = self.first, 0.0, False

    def found_nothing(self, now: float) -> None:
        self.next_at = now + self.delay
        self.delay = min(self.delay * 2, self.most)
        self.exhausted = True

    def wake(self) -> None:
        """Something changed (a row was inserted, a handler finished): claim again now."""
        self.delay, self.next_at, self.exhausted = self.first, 0.0, False

    def wait_until(self, at: float) -> None:
        """Rows are there, but may not be claimed before ``at`` (a rate's next token): no
        claim until then, and not idle (drain waits for them)."""
        self.delay, self.next_at, self.exhausted = self.first, at, False
