"""The watchman: work whose holder is gone becomes claimable again.

Two ways a holder goes: a coordinator on this machine that is no longer running (its
heartbeat says which pid it was; its leases are ended at once), and a lease that ran out
anywhere (the machine, its network or its process went away). Either way the retry
policy decides what the interrupted attempt becomes, and a holder that wakes up later
cannot commit: its claim token no longer matches.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable

from ..registration.registry import Worker
from ..store.bridge import Bridge

logger = logging.getLogger("django_dbworker.coordinator")


class Watchman:
    def __init__(self, bridge: Bridge, workers: Iterable[Worker], host: str, namespace: str,
                 count: Callable[[str, str, int], None], wake: Callable[[str], None]) -> None:
        self.bridge = bridge
        self.workers = list(workers)
        self.host = host
        self.namespace = namespace
        self.count = count  # (worker, event, n): the stats line and the metrics
        self.wake = wake

    def run(self, coordinator_id: int | None) -> None:
        dead = self.bridge.expire_claims_of_dead(self.host, self.namespace, coordinator_id,
                                                 pid_alive)
        if dead:
            logger.warning("Coordinator process(es) %s of this host are gone; their claims "
                           "are released now, without waiting for their leases",
                           ", ".join(map(str, dead)))
        for w in self.workers:
            recovered = self.bridge.recover_expired(w)
            if recovered:
                self.count(w.name, "recovered", recovered)
                logger.warning("Worker %s: %d claim(s) had expired leases (their holder "
                               "stopped renewing them); they are claimable again", w.name,
                               recovered)
                self.wake(w.name)


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this machine (a zombie counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True
