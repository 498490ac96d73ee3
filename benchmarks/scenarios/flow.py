"""Flow control (issue 37, docs/flow-control.md): how exactly a rate holds across two
coordinators, and what a claim costs when its whole backlog is held back by per_key.

Rate: `bench_rate` (rate="50/s", concurrency 2) over a backlog of 1.5 times what the rate
allows in the period, run by 2 `runworkers` processes started at once, for --flow-seconds
(60; quick 10) after the first claim. Every claim writes its time (the database's clock)
to Execution.started_at, which each handler copies to a RateClaim row while its row is
WORKING (a finished row's started_at is its handler's start instead); a row claimed but
given back when the coordinators stop keeps it. From those times: the rows claimed, rows
/ seconds between the first and the last claim, and the busiest 1-second window
[t, t + 1 s), which must never hold more than 50 rows.

Claim cost: 1,000 keys each with one WORKING row (claimed through a Bridge and left
WORKING), so the other rows of `bench_keyed` (per_key=1) and `bench_fair` (fair=True,
per_key=1) are all throttled; then 200 claims of 16 rows, timed in this process through
one Bridge (each takes nothing), at two backlog sizes (a tenth of --flow-rows, then
--flow-rows: the claim must read indexes, not the throttled rows); beside them the same
claims of `bench` (no limit) over a backlog of --flow-rows, which take rows.
"""

from __future__ import annotations

import datetime as dt
import statistics
import time
from typing import Any

from .common import Cfg, analyze, queue_jobs, reset, runworkers
from .summary import percentile

RATE_WORKER, RATE, RATE_PER_S = "bench_rate", "50/s", 50  # (benchapp/workers.py)
COORDINATORS = 2
BACKLOG_FACTOR = 1.5  # rows queued / rows the rate allows in the period: never runs dry
SECOND_US = 1_000_000  # the rate's period, in the claim times' unit (µs: exact integers)
FIRST_CLAIM_TIMEOUT = 120.0  # s: both coordinators set up and the first claim made

KEYED, FAIR, UNLIMITED = "bench_keyed", "bench_fair", "bench"
LIMITS = {KEYED: "per_key=1", FAIR: "fair, per_key=1", UNLIMITED: "no limit"}
KEYS = 1000
CLAIMS, CLAIM_LIMIT, WARMUP = 200, 16, 5  # timed claims, rows each may take, untimed first
# Rows per claim that makes every key busy: a fair claim is a UNION of one SELECT per row
# it may take, and SQLite allows 500 terms in one.
HOLD_LIMIT = 100
HOLD_LEASE = 3600.0  # s: the held rows stay WORKING through the measurement whatever runs
HOLD_CLAIMER, CLAIMER = "bench:hold", "bench:measure"


# -- rate accuracy ----------------------------------------------------------------------
def rate_accuracy(db: str, cfg: Cfg) -> dict[str, Any]:
    """2 coordinators on a rate-limited backlog for cfg.flow_seconds, then the claim times."""
    from benchapp.models import RateClaim

    reset(db)
    backlog = int(cfg.flow_seconds * RATE_PER_S * BACKLOG_FACTOR)
    queue_jobs(db, backlog, RATE_WORKER)
    analyze(db)
    trees = [runworkers(db, RATE_WORKER, drain=False, log=cfg.log) for _ in range(COORDINATORS)]
    try:
        claimed = wait_for_first_claim(db, min(cfg.timeout, FIRST_CLAIM_TIMEOUT))
        deadline = time.monotonic() + (cfg.flow_seconds if claimed else 0.0)
        # Both must run the whole period: a coordinator that exits early is recorded.
        while time.monotonic() < deadline and all(t.proc.poll() is None for t in trees):
            time.sleep(0.5)
        exit_codes = [t.proc.poll() for t in trees]  # None: still running, as expected
    finally:
        for tree in trees:
            tree.stop()
    times, claimers = claim_times(db)
    ids = list(RateClaim.objects.using(db).values_list("job_id", flat=True))
    return {"worker": RATE_WORKER, "rate": RATE, "seconds": cfg.flow_seconds,
            "backlog": backlog, "coordinators": COORDINATORS,
            "coordinators_claiming": claimers, "exit_codes_before_stop": exit_codes,
            "ran_twice": len(ids) - len(set(ids)), **rate_summary(times)}


def wait_for_first_claim(db: str, timeout: float) -> bool:
    from django_dbworker.models import Execution

    claims = Execution.objects.using(db).filter(worker=RATE_WORKER, started_at__isnull=False)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if claims.exists():
            return True
        time.sleep(0.1)
    return False


def claim_times(db: str) -> tuple[list[int], int]:
    """Every claim time, in µs after the first, sorted: the RateClaim rows of the rows
    that ran, and the Execution.started_at of the rows claimed that did not finish (given
    back, or left WORKING, as the coordinators stopped). And how many coordinators
    claimed rows that ran (claimed_by stays when a row finishes)."""
    from benchapp.models import RateClaim

    from django_dbworker.models import Execution

    executions = Execution.objects.using(db).filter(worker=RATE_WORKER)
    claimed = [*RateClaim.objects.using(db).values_list("claimed_at", flat=True),
               *executions.filter(started_at__isnull=False).exclude(status="finished")
               .values_list("started_at", flat=True)]
    claimers = executions.filter(status="finished").values("claimed_by").distinct().count()
    if not claimed:
        return [], claimers
    first = min(claimed)
    return sorted((t - first) // dt.timedelta(microseconds=1) for t in claimed), claimers


def busiest_window(times: list[int], width: int = SECOND_US) -> tuple[int, int]:
    """The most claims in any window [t, t + width) over sorted times, and the index of
    the first claim of such a window. A window can slide right until it starts at a
    claim without losing one, so the windows starting at claims are all there is to
    check; j, the first claim at or past the window's end, only moves forward."""
    best = at = j = 0
    for i, start in enumerate(times):
        while j < len(times) and times[j] < start + width:
            j += 1
        if j - i > best:
            best, at = j - i, i
    return best, at


def rate_summary(times: list[int]) -> dict[str, Any]:
    """Rows claimed, rows / s between the first and last claim (which may pass the limit
    by one window's rows over the span: the limit binds windows, not the span), the
    busiest window against the limit, and the longest pause between two claims."""
    busiest, at = busiest_window(times)
    pause, pause_at = max(((b - a, a - times[0]) for a, b in zip(times, times[1:], strict=False)),
                          default=(0, 0))
    span = (times[-1] - times[0]) / SECOND_US if len(times) > 1 else 0.0
    achieved = len(times) / span if span > 0 else None
    return {"claimed": len(times), "span_s": round(span, 3),
            "achieved_per_s": None if achieved is None else round(achieved, 2),
            "of_limit": None if achieved is None else round(achieved / RATE_PER_S, 3),
            "busiest_window": busiest,
            "busiest_window_at_s": round(times[at] / SECOND_US, 3) if times else None,
            "within_limit": bool(times) and busiest <= RATE_PER_S,
            # The longest wait between two claims: a rate that waits for its next token
            # waits at most a period (1 s); longer, the coordinators stopped claiming.
            "longest_pause_s": round(pause / SECOND_US, 3),
            "longest_pause_at_s": round(pause_at / SECOND_US, 3),  # after the first claim
            # Pauses longer than a period: how often the coordinators stopped claiming.
            "pauses_over_1s": sum(1 for a, b in zip(times, times[1:], strict=False)
                                  if b - a > SECOND_US)}


# -- claim cost -------------------------------------------------------------------------
def claim_cost(db: str, cfg: Cfg) -> dict[str, Any]:
    """The throttled claims at a tenth of cfg.flow_rows (at least 2 rows a key), then with
    rows added up to cfg.flow_rows (still every key held); then the unlimited claims."""
    from django_dbworker.store.bridge import Bridge

    large = cfg.flow_rows
    small = max(large // 10, 2 * KEYS)
    sizes = (small, large) if large > small else (large,)  # (--flow-rows 2,000 or less)
    reset(db)
    bridge = Bridge(db, lease_seconds=HOLD_LEASE)
    arms: list[dict[str, Any]] = []
    holds: dict[str, dict[str, int]] = {}  # (made once: the rows added later stay throttled)
    try:
        queued = 0
        for size in sizes:
            for worker in (KEYED, FAIR):
                queue_keyed(db, worker, queued, size - queued)
            if not queued:
                holds = {w: hold_every_key(bridge, db, w) for w in (KEYED, FAIR)}
            queued = size
            analyze(db)  # (on PostgreSQL also VACUUM: the claimed rows' dead index entries)
            for worker in (KEYED, FAIR):
                arms.append({**arm(db, worker, size), **holds[worker],
                             **timed_claims(bridge, worker)})
        queue_jobs(db, large, UNLIMITED)
        analyze(db)
        arms.append({**arm(db, UNLIMITED, large), **timed_claims(bridge, UNLIMITED)})
    finally:
        bridge.close()
    for later in arms:  # the larger backlog's median over the smaller one's, per worker
        earlier = next((a for a in arms if a["worker"] == later["worker"]
                        and a["rows"] < later["rows"]), None)
        if earlier and earlier["p50_ms"]:
            later["p50_vs_smaller"] = round(later["p50_ms"] / earlier["p50_ms"], 2)
    return {"claims": CLAIMS, "claim_limit": CLAIM_LIMIT, "keys": KEYS, "arms": arms}


def queue_keyed(db: str, worker: str, start: int, n: int) -> None:
    """n rows (the triggers make each PENDING work, its key in flow_key), row i of key
    i % KEYS: every key has rows from the first thousand on."""
    from django.db import transaction

    from .common import model_for

    model = model_for(worker)
    with transaction.atomic(using=db):
        for first in range(start, start + n, 2000):
            model.objects.using(db).bulk_create(
                [model(created_ts=time.time(), priority=i % KEYS)
                 for i in range(first, min(first + 2000, start + n))], batch_size=2000)


def hold_every_key(bridge: Any, db: str, worker: str) -> dict[str, int]:
    """Claim (and leave WORKING) one row of every key, HOLD_LIMIT keys a claim, until a
    claim takes nothing; returns how many rows and keys are then WORKING (KEYS each)."""
    from django_dbworker.models import Execution
    from django_dbworker.registration.registry import registry

    for _ in range(2 * KEYS // HOLD_LIMIT):  # (bounded: KEYS // HOLD_LIMIT claims are due)
        if not bridge.claim(registry[worker], HOLD_LIMIT, HOLD_CLAIMER):
            break
    held = Execution.objects.using(db).filter(worker=worker, status="working")
    return {"held": held.count(), "held_keys": held.values("flow_key").distinct().count()}


def arm(db: str, worker: str, rows: int) -> dict[str, Any]:
    """What one measurement claims from: its rows, and how many of them are claimable
    (all throttled, for a limited worker: every key is at its limit)."""
    from django_dbworker.models import Execution

    claimable = Execution.objects.using(db).filter(worker=worker, claimable_worker__isnull=False)
    return {"worker": worker, "limits": LIMITS[worker], "rows": rows,
            "claimable": claimable.count()}


def timed_claims(bridge: Any, worker: str) -> dict[str, Any]:
    """CLAIMS claims of CLAIM_LIMIT rows, each timed around Bridge.claim (what a
    coordinator's claim costs, its Python included), after WARMUP untimed ones (the
    statements are built on the first)."""
    from django_dbworker.registration.registry import registry

    w = registry[worker]
    for _ in range(WARMUP):
        bridge.claim(w, CLAIM_LIMIT, CLAIMER)
    samples, taken = [], 0
    for _ in range(CLAIMS):
        started = time.perf_counter()
        taken += len(bridge.claim(w, CLAIM_LIMIT, CLAIMER))
        samples.append((time.perf_counter() - started) * 1000)
    samples.sort()
    return {"taken": taken, "p50_ms": round(statistics.median(samples), 3),
            "p95_ms": round(percentile(samples, 95), 3), "max_ms": round(samples[-1], 3)}
