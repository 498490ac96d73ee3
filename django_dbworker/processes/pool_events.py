"""What the coordinator does with what its pools report: results, deaths, timeouts.

Every outcome is counted (the stats line and the metrics). A row whose handler never
committed goes back through the release queue: as it was when the handler never started,
or with the retry policy's decision when the attempt counts (a timeout, a child that died,
a database error mid-handler).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING

from ..registration.registry import Worker
from . import protocol
from .pool import Died, Event, Pool, Reported, TimedOut

if TYPE_CHECKING:
    from ..coordinator.releases import ReleaseQueue
    from ..coordinator.wakeups import Wakeups
    from ..operations.metrics import Metrics
    from ..store.retry import RetryDecision

logger = logging.getLogger("django_dbworker.coordinator")


class PoolEvents:
    def __init__(self, stats: Counter[str], releases: ReleaseQueue, wakeups: Wakeups) -> None:
        self.stats, self.releases, self.wakeups = stats, releases, wakeups
        self.metrics: Metrics | None = None  # set when the coordinator serves /metrics

    def count(self, worker: str, event: str, n: int = 1) -> None:
        self.stats[event] += n
        if self.metrics is not None:
            self.metrics.count(worker, event, n)

    def handle(self, pool: Pool, events: list[Event]) -> None:
        name = pool.worker.name
        for event in events:
            if isinstance(event, Reported):
                for claim, result, timing in event.results:
                    self._on_result(pool.worker, claim, result)
                    if timing is not None and self.metrics is not None:
                        pickup = (timing.started_at - claim.ready_at if claim is not None
                                  and claim.ready_at is not None else None)
                        self.metrics.observe(name, timing.seconds, pickup)
                # A finished handler may have made rows claimable (here or for another
                # worker, a dependent one): claim again.
                self.wakeups.wake_all()
            elif isinstance(event, Died):
                self.count(name, "crashed")
                if event.running is not None:
                    self.crashed(pool.worker, event.running, event.exit)
                for claim in event.others:
                    self.give_back(claim, name)
                self.wakeups.wake(name)
            elif isinstance(event, TimedOut):
                claim = event.claim
                decision = pool.worker.retry_policy.after_failure(claim.attempt)
                self.count_failure(name, decision)
                self.releases.add(claim, decision, (
                    "TimeoutError",
                    f"The handler ran longer than its timeout of {pool.worker.timeout}s."))
                for claim in event.others:
                    self.give_back(claim, name)
                self.wakeups.wake(name)

    def _on_result(self, worker: Worker, claim: protocol.Claim | None,
                   result: protocol.Result) -> None:
        if claim is None:
            return  # given back already (a revoked row that the child skipped)
        kind = result.kind
        if kind == protocol.DONE:
            self.count(worker.name, str(result.status))
        elif kind == protocol.SKIPPED:
            self.give_back(claim, worker.name)
        elif kind == protocol.LOST:
            self.count(worker.name, "lost")
            logger.warning("Worker %s lost its claim on execution %s: its writes were "
                           "discarded", worker.name, claim.execution_id)
        elif kind == protocol.INTERRUPTED:
            self.count(worker.name, "interrupted")
            logger.warning("Worker %s: database error during execution %s (%s); "
                           "releasing it", worker.name, claim.execution_id, result.error)
            self.interrupted(worker, claim, str(result.error))

    def give_back(self, claim: protocol.Claim, worker: str) -> None:
        """A row whose handler never started (or never reached a commit): as it was."""
        self.count(worker, "released")
        self.releases.add(claim)

    def interrupted(self, worker: Worker, claim: protocol.Claim, detail: str) -> None:
        """The database failed under a running handler (its connection broke). An outage
        is no fault of the row's: it is claimable again at once (with max_attempts, the
        attempt counts). But it counts as a crash in a row: a handler that breaks its own
        connection every time ends FAILED at max_crashes instead of looping."""
        self.count(worker.name, "released")
        crashes = claim.crashes + 1
        decision = worker.retry_policy.after_interruption(claim.attempt, crashes)
        self.count_failure(worker.name, decision)
        if decision.retried or crashes < worker.max_crashes:
            error = ("Interrupted", f"The database failed while the handler ran: {detail}")
        else:
            error = ("Interrupted", f"The database connection broke while the handler ran, "
                                    f"{crashes} times in a row (last: {detail}); it is not "
                                    f"retried again (max_crashes={worker.max_crashes}). Fix "
                                    "the handler, then reset the row.")
        self.releases.add(claim, decision, error, crashed=True)

    def crashed(self, worker: Worker, claim: protocol.Claim, exit: str) -> None:
        """The row's child died while its handler ran: one more crash in a row, and the
        retry policy decides (a back-off, so the rows behind it run meanwhile; FAILED at
        max_crashes)."""
        self.count(worker.name, "released")
        crashes = claim.crashes + 1
        decision = worker.retry_policy.after_crash(claim.attempt, crashes)
        self.count_failure(worker.name, decision)
        if decision.retried:
            error = ("ChildDied", f"The child process died ({exit}) while running the "
                                  f"handler (crash {crashes} of at most {worker.max_crashes} "
                                  "in a row).")
        elif crashes < worker.max_crashes:  # (max_attempts ended it, not the crashes)
            error = ("ChildDied", f"The child process died ({exit}) while running the "
                                  f"handler, in its last attempt (max_attempts="
                                  f"{worker.max_attempts}).")
        else:
            error = ("ChildDied", f"The handler crashed its process {crashes} times in a row "
                                  f"(last: {exit}); it is not retried again (max_crashes="
                                  f"{worker.max_crashes}). Fix the handler, then reset the row.")
            logger.error("Worker %s: execution %s crashed its process %d times in a row; it "
                         "is FAILED (reset it once the handler is fixed)", worker.name,
                         claim.execution_id, crashes)
        self.releases.add(claim, decision, error, crashed=True)

    def count_failure(self, worker: str, decision: RetryDecision) -> None:
        """A failed attempt is counted as retried, or failed when no retry is left."""
        if decision.failed_attempt:
            self.count(worker, "retried" if decision.retried else "failed")
