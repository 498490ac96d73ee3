"""The statuses an Execution row moves through, and which of them claims and waits read."""

from __future__ import annotations

from enum import StrEnum


class ExecutionStatus(StrEnum):
    PENDING = "pending"  # the source row exists, no handler has run yet
    WORKING = "working"  # claimed: a handler holds a lease on it
    UNFINISHED = "unfinished"  # the handler returned Unfinished(), or a retry waits
    FINISHED = "finished"  # done for good
    FAILED = "failed"  # the handler raised; waits for reset_failed()

    @property
    def claimable(self) -> bool:
        return self in CLAIMABLE


CLAIMABLE = (ExecutionStatus.PENDING, ExecutionStatus.UNFINISHED)
# Statuses in which a row may wait for next_attempt_at: a retry, a deferred task, or a
# finished row that runs again after rerun_every.
WAITING = (ExecutionStatus.PENDING, ExecutionStatus.UNFINISHED, ExecutionStatus.FINISHED)
