"""Poison row: N rows drained with one row whose handler kills its child every time, vs none.

Both arms drain N `PoisonJob` rows with `runworkers --worker bench_poison --drain` at
concurrency 1 or 2 (the job of `bench`: one Effect row through the ORM). In the poison
arm the first row, first in claim order, calls os._exit(3) in its handler. Measured: the
other rows' jobs/s (first to last handler start, as the drain scenario computes it), the
time from starting `runworkers` until the last other row finished and until the first
one started, and the longest pause between two handler starts. `--drain` exits once
nothing is claimable, while the poison row waits for its back-off (retry_backoff, the
package's default 10 s): its status, crashes and last claim then are recorded. Then,
untimed and once per database and concurrency, `runworkers` runs on with a small
retry_backoff until the poison row ends FAILED (max_crashes), which is recorded too.
"""

from __future__ import annotations

import os
import random
import time
from typing import Any

from .common import Cfg, analyze, effects, reset, runworkers, summarize_drain

WORKER = "bench_poison"
SYSTEM = "poison"  # Effect.system of its handler
# retry_backoff (s) of the untimed run that follows a poison row to FAILED: the retry the
# measured run wrote (5-10 s, or 10-20 s after a second crash) is due first, then each
# crash waits 0.1-0.2 s, 0.2-0.4 s.
CONFIRM_BACKOFF = "0.2"
CONFIRM_TIMEOUT = 90.0


def queue_poison_jobs(db: str, n: int, poisoned: bool) -> int:
    """n rows in one transaction (the triggers make each one PENDING work); the first one,
    first in claim order (claims go in the order the Execution rows were made), is the
    poison row when `poisoned`. Returns the first row's pk."""
    from benchapp.models import PoisonJob
    from django.db import transaction

    rng = random.Random(n)
    with transaction.atomic(using=db):
        first = PoisonJob.objects.using(db).create(
            created_ts=time.time(), priority=rng.randrange(1000), poison=poisoned)
        for start in range(1, n, 2000):
            PoisonJob.objects.using(db).bulk_create(
                [PoisonJob(created_ts=time.time(), priority=rng.randrange(1000))
                 for _ in range(min(2000, n - start))], batch_size=2000)
    return first.pk


def poison_row(db: str, pk: int, started: float | None = None) -> dict[str, Any]:
    """The poison row's Execution as it stands: status, crashes, error, how long until its
    retry is due and, given runworkers' start, when its last attempt was claimed (the
    harness's clock against the database's: the same machine)."""
    from django_dbworker.models import Execution

    e = Execution.objects.using(db).get(worker=WORKER, source_id=str(pk))
    due = e.next_attempt_at.timestamp() - time.time() if e.next_attempt_at else None
    row = {"status": e.status, "crashes": e.crashes, "attempts": e.attempts,
           "error_type": e.error_type, "error_message": e.error_message,
           "retry_due_in_s": None if due is None else round(due, 2)}
    if started is not None and e.started_at is not None:
        row["last_claimed_s"] = round(e.started_at.timestamp() - started, 3)
    return row


def follow_to_failed(db: str, pk: int, concurrency: int, cfg: Cfg) -> dict[str, Any]:
    """Untimed: run `runworkers` (not --drain: it would exit, nothing being claimable)
    with a small retry_backoff until the poison row is FAILED or CONFIRM_TIMEOUT passes."""
    t0 = time.monotonic()
    tree = runworkers(db, WORKER, drain=False, log=cfg.log, concurrency=concurrency,
                      BENCH_POISON_RETRY_BACKOFF=CONFIRM_BACKOFF)
    try:
        while time.monotonic() - t0 < CONFIRM_TIMEOUT:
            if poison_row(db, pk)["status"] == "failed" or tree.proc.poll() is not None:
                break
            time.sleep(0.2)
    finally:
        tree.stop()
    return {**poison_row(db, pk), "seconds": round(time.monotonic() - t0, 1),
            "retry_backoff": float(CONFIRM_BACKOFF)}


def poison(db: str, n: int, concurrency: int, poisoned: bool, cfg: Cfg,
           follow: bool = False) -> dict[str, Any]:
    """One arm: drain n rows (the first one a poison row when `poisoned`)."""
    from django.db.models import Count, Max

    from django_dbworker.models import Execution

    reset(db)
    first = queue_poison_jobs(db, n, poisoned)
    analyze(db)
    load = os.getloadavg()[0]  # the machine is shared: how busy it was as this run began
    started = time.time()
    t0 = time.monotonic()
    tree = runworkers(db, WORKER, drain=True, log=cfg.log, concurrency=concurrency)
    code = tree.wait(cfg.timeout)
    wall = time.monotonic() - t0
    tree.stop()
    result = summarize_drain(db, SYSTEM, n - int(poisoned), wall)
    starts = sorted(row[1] for row in effects(db, SYSTEM))
    others = Execution.objects.using(db).filter(worker=WORKER)
    if poisoned:
        others = others.exclude(source_id=str(first))
    last = others.filter(status="finished").aggregate(last=Max("finished_at"))["last"]
    result.update(
        rows=n, concurrency=concurrency, poisoned=poisoned, exit_code=code,
        others_status=dict(others.order_by().values_list("status").annotate(n=Count("id"))),
        # Until the last other row finished: its finished_at (the database's clock, on this
        # machine; on PostgreSQL the start of its group's transaction) - runworkers' start.
        others_done_s=round(last.timestamp() - started, 3) if last else None,
        # The first other row's handler start: runworkers' start-up, and in the poison arm
        # at concurrency 1 also the poison row's crash and the replacement child's start.
        first_start_s=round(starts[0] - started, 3) if starts else None,
        # The longest wait between two handler starts: at concurrency 1, the replacement of
        # a child the poison row killed mid-drain (a fresh interpreter, Django set-up).
        longest_gap_s=round(max((b - a for a, b in zip(starts, starts[1:], strict=False)),
                                default=0.0), 3),
        loadavg_1min=round(load, 2), rss=tree.rss())
    if poisoned:
        result["poison_row"] = poison_row(db, first, started)  # when --drain exited
        if follow and result["poison_row"]["status"] != "failed":
            result["poison_row_after"] = follow_to_failed(db, first, concurrency, cfg)
    return result
