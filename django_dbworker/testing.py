"""Run pending work in the test's own process and transaction.

A ``django.test.TestCase`` wraps each test in a transaction no other process can see, so
a coordinator's children cannot run your test's rows. ``run_pending()`` claims and runs
them here instead, through the very code a child runs (savepoints, the guarded outcome
write, the retry policy), inside the test's transaction::

    from django_dbworker.testing import run_pending

    class OcrTests(TestCase):
        def test_ocr(self):
            doc = Document.objects.create(uploaded=True)
            stats = run_pending("ocr")
            self.assertEqual(execution_status("ocr", doc), ExecutionStatus.FINISHED)

With pytest-django, the ``dbworker`` fixture does the same: ``dbworker.run("ocr")``.
Task queues are workers too: ``run_pending("tasks.default.default")`` runs enqueued tasks.
Callbacks registered with ``transaction.on_commit()`` (such as ``task_finished``) run only
when the test's transaction commits (``TestCase.captureOnCommitCallbacks`` runs them).
"""

from __future__ import annotations

import os
import secrets
from collections import Counter, deque
from typing import Any

from django.db import transaction

from . import conf
from .processes import protocol
from .registration.registry import Worker, registry
from .status import ExecutionStatus
from .store import transitions
from .store.session import OnDjango

__all__ = ["run_pending"]


class _Flag:
    value = 0


def run_pending(*workers: str, rounds: int = 100, include_waiting: bool = False) -> Counter[str]:
    """Run what is claimable for ``workers`` (names; default: every registered worker)
    until nothing is, or ``rounds`` passes went by; rows made claimable by a run (a
    dependent worker, ``Unfinished()``) run in later passes. ``include_waiting``: rows
    waiting for a retry or a ``run_after`` run too, without waiting. Returns counts by
    outcome (``finished``, ``unfinished``, ``failed``, ``retried``, ``lost``)."""
    chosen = [registry[name] for name in (workers or list(registry))]
    database = conf.value("DATABASE")
    stats: Counter[str] = Counter()
    for _ in range(rounds):
        ran = sum(_run_worker(w, database, stats, include_waiting) for w in chosen)
        if not ran:
            break
    return stats


def _claimable(worker: Worker, database: str, include_waiting: bool) -> list[Any]:
    from .api import source_key
    from .models import Execution

    executions = Execution.objects.using(database).filter(worker=worker.name)
    if include_waiting:
        executions = executions.filter(status__in=[ExecutionStatus.PENDING,
                                                   ExecutionStatus.UNFINISHED])
    else:
        with transaction.atomic(using=database):
            while transitions.promote(OnDjango(database), worker.name):
                pass
        executions = executions.filter(claimable_worker=worker.name)
    by_key = {e.source_id: e for e in executions.order_by("-priority" if worker.prioritized
                                                          else "id", "id")}
    if worker.eligible is None:
        return list(by_key.values())
    eligible = worker.eligible_queryset().using(database).values_list("pk", flat=True)
    return [by_key[k] for k in (source_key(worker, pk) for pk in eligible) if k in by_key]


def _run_worker(worker: Worker, database: str, stats: Counter[str], include_waiting: bool) -> int:
    from .processes.child import run_group

    rows = _claimable(worker, database, include_waiting)
    if not rows:
        return 0
    token = secrets.token_hex(16)
    with transaction.atomic(using=database):
        transitions.claim_rows(OnDjango(database), [e.pk for e in rows], token,
                               f"test:{os.getpid()}", conf.value("LEASE_SECONDS"))
    pending = deque(protocol.Claim(e.pk, e.source_id, token, e.status, e.attempts + 1)
                    .delivery(seq) for seq, e in enumerate(rows, 1))
    slot = [0.0] * protocol.SLOT_SIZE
    while pending:
        for result in run_group(worker, database, pending, slot, _Flag()):
            stats[result.status or result.kind] += 1  # (DONE: the outcome)
    return len(rows)
