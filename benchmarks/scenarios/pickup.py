"""Pickup latency (row committed -> handler starts, warm idle workers) and idle CPU."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

from . import drain
from .common import (
    DB_NAMES,
    QUEUE,
    Cfg,
    System,
    Tree,
    celery_worker,
    effects,
    manage,
    processes_rss,
    purge_queue,
    reset,
    runworkers,
    wait_for_count,
)
from .drain import celery_label, procrastinate_label, tasks_label
from .summary import percentile


def pickup_workers(db: str, system: str, cfg: Cfg) -> tuple[list[Tree], Callable[[int], Any]]:
    """The warm idle workers of `system`, and what tells them about a committed Job row
    (nothing for dbworker: the row's trigger does)."""
    if system == "celery":
        from benchapp.tasks import handle_job

        purge_queue()
        return [celery_worker(True, cfg.log)], lambda pk: handle_job.apply_async((pk,), queue=QUEUE)
    if system == "procrastinate":
        from benchapp.procrastinate_tasks import handle_job as deferred

        args = ["procrastinate", "worker", "--queues", "bench",
                "--concurrency", str(drain.PROCRASTINATE_CONCURRENCY)]
        return ([manage(db, args, cfg.log, BENCH_CONN_MAX_AGE="none")
                 for _ in range(drain.PROCRASTINATE_WORKERS)], lambda pk: deferred.defer(job_id=pk))
    if system == "dbworker-tasks":
        from benchapp.task_jobs import handle_job as task

        return ([manage(db, ["runworkers", "--queue", "bench", "-v0"], cfg.log)],
                lambda pk: task.enqueue(pk, system))
    return [runworkers(db, "bench", drain=False, log=cfg.log)], lambda pk: None


def pickup(db: str, system: str, samples: int, gap: float, idle: float,
           cfg: Cfg) -> dict[str, Any]:
    """Insert one row at a time into warm idle workers; latency = handler start -
    commit acknowledged to the inserting client (for the systems that need a message or
    a task as well, it is sent right after that commit). Then measure idle CPU for `idle`
    seconds, and the pickup of one row inserted after that idle stretch."""
    from benchapp.models import Job

    reset(db)
    trees, announce = pickup_workers(db, system, cfg)
    committed: dict[int, float] = {}
    after_idle = -1
    try:
        def insert() -> int:
            job = Job.objects.using(db).create(created_ts=time.time())
            committed[job.pk] = time.time()
            announce(job.pk)
            return job.pk

        insert()  # warm-up: workers started, connections open
        if not wait_for_count(db, system, 1, 120, *trees):
            raise RuntimeError(f"{system} on {db}: warm-up job never ran (see {cfg.log})")
        rng = random.Random(7)
        for _ in range(samples):
            time.sleep(gap * rng.uniform(0.5, 1.5))
            insert()
        wait_for_count(db, system, samples + 1, 30 + samples * 0.05, *trees)
        # Idle CPU: nothing to do for `idle` seconds.
        cpu0, t0 = sum(t.cpu_seconds() for t in trees), time.monotonic()
        time.sleep(idle)
        cpu1 = sum(t.cpu_seconds() for t in trees)
        idle_cpu = (cpu1 - cpu0) / (time.monotonic() - t0) * 100
        # One more row after that idle stretch: a poll back-off that has grown while
        # nothing happened shows here, not in the samples above (0.1 s apart).
        after_idle = insert()
        wait_for_count(db, system, samples + 2, 30, *trees)
        for tree in trees:
            tree.sample()
    finally:
        for tree in trees:
            tree.stop()
    first = min(committed)
    started_at = {job_id: started for job_id, started, _ in effects(db, system)}
    lat = sorted((started - committed[job_id]) * 1000 for job_id, started in started_at.items()
                 if job_id not in (first, after_idle))
    idle_ms = ((started_at[after_idle] - committed[after_idle]) * 1000
               if after_idle in started_at else None)
    return {
        "samples": samples, "done": len(lat),
        "p50_ms": round(percentile(lat, 50), 2) if lat else None,
        "p95_ms": round(percentile(lat, 95), 2) if lat else None,
        "max_ms": round(lat[-1], 2) if lat else None,
        "idle_cpu_percent": round(idle_cpu, 2),
        "idle_seconds": idle,
        "after_idle_ms": round(idle_ms, 2) if idle_ms is not None else None,
        "rss": processes_rss(trees),
    }


def pickup_systems(db: str, cfg: Cfg) -> list[System]:
    """dbworker on every database; on PostgreSQL the push-based peers and our tasks."""
    def run(system: str) -> Callable[[], dict[str, Any]]:
        return lambda: pickup(db, system, cfg.pickup_samples, 0.05 if cfg.quick else 0.1,
                              cfg.idle_seconds, cfg)

    systems = [System(f"dbworker {DB_NAMES[db]}", db, run("dbworker"))]
    if db != "postgres":
        return systems
    return systems + [
        System(celery_label(), db, run("celery"), needs="celery"),
        System(tasks_label(), db, run("dbworker-tasks")),
        System(procrastinate_label(), db, run("procrastinate"), needs="procrastinate"),
    ]
