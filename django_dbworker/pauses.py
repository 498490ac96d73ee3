"""Pausing a worker: every coordinator stops claiming its rows (running handlers finish),
until it is resumed. The one code path for the admin, the commands and your code.

A pause is a ``WorkerPause`` row. On PostgreSQL the NOTIFY that ``pause()`` and
``resume()`` send wakes every coordinator to read the (tiny) table at once; elsewhere the
change probe (every ``PROBE_SECONDS``) sees its count and latest time change. Coordinators
also read it every ``MAX_POLL_SECONDS``, in case.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from django.db import IntegrityError, connections, transaction

from . import conf
from .models import WorkerPause
from .registration.registry import registry
from .store import clock
from .vendors import PAUSE_NOTICE, for_connection

if TYPE_CHECKING:
    from .coordinator.wakeups import Wakeups
    from .store.bridge import Bridge

# The coordinator's logger: pauses are news of the coordinator's, where operators look.
logger = logging.getLogger("django_dbworker.coordinator")


def _tell_coordinators(database: str) -> None:
    """On PostgreSQL, wake every coordinator to look at the pauses (at commit)."""
    connection = connections[database]
    statement = for_connection(connection).notify_sql(PAUSE_NOTICE)
    if statement:
        with connection.cursor() as cursor:
            cursor.execute(*statement)


def pause(worker: str, by: str = "", reason: str = "") -> bool:
    """Pause ``worker`` (a registered name); True if it was running, False if paused."""
    name = registry[worker].name  # an unknown name fails, naming the known ones
    database = conf.value("DATABASE")
    try:
        with transaction.atomic(using=database):
            WorkerPause.objects.using(database).create(
                worker=name, paused_by=by[:255], reason=reason, paused_at=clock.now(database))
            _tell_coordinators(database)
    except IntegrityError:
        return False
    return True


def resume(worker: str) -> bool:
    """Resume ``worker``; True if it was paused."""
    name = registry[worker].name
    database = conf.value("DATABASE")
    with transaction.atomic(using=database):
        deleted, _ = WorkerPause.objects.using(database).filter(worker=name).delete()
        if deleted:
            _tell_coordinators(database)
    return bool(deleted)


def paused() -> dict[str, WorkerPause]:
    """Paused worker name -> its pause."""
    return {p.worker: p for p in WorkerPause.objects.using(conf.value("DATABASE"))}


class PausedWorkers:
    """A coordinator's view of the pauses: which of its workers claim nothing new.

    ``refresh()`` reads them (through the coordinator's bridge) and logs each change;
    a resumed worker is woken to claim at once.
    """

    def __init__(self, bridge: Bridge, wakeups: Wakeups) -> None:
        self._bridge = bridge
        self._wakeups = wakeups
        self._names: set[str] = set()

    def __contains__(self, worker: str) -> bool:
        return worker in self._names

    def refresh(self) -> bool:
        """Read the pauses (True once done: through DatabaseHealth.call, None means the
        read failed)."""
        paused = self._bridge.paused_workers() & set(self._wakeups.backoff)
        for name in sorted(paused - self._names):
            logger.warning("Worker %s is paused: no new claims (running handlers finish)", name)
        for name in sorted(self._names - paused):
            logger.warning("Worker %s is resumed", name)
            self._wakeups.wake(name)
        self._names = paused
        return True
