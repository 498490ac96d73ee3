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
    a task as well, it is sent right after that commit). Then measure idle CPU."""
    from benchapp.models import Job

    reset(db)
    trees, announce = pickup_workers(db, system, cfg)
    committed: dict[int, float] = {}
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
        for tree in trees:
            tree.sample()
    finally:
        for tree in trees:
            tree.stop()
    first = min(committed)
    lat = sorted((started - committed[job_id]) * 1000 for job_id, started, _ in effects(db, system)
                 if job_id != first)
    return {
        "samples": samples, "done": len(lat),
        "p50_ms": round(percentile(lat, 50), 2) if lat else None,
        "p95_ms": round(percentile(lat, 95), 2) if lat else None,
        "max_ms": round(lat[-1], 2) if lat else None,
        "idle_cpu_percent": round(idle_cpu, 2),
        "rss": processes_rss(trees),
    }


def pickup_systems(db: str, cfg: Cfg) -> list[System]:
    """dbworker on every database; on PostgreSQL the push-based peers and our tasks."""
    def run(system: str) -> Callable[[], dict[str, Any]]:
        return lambda: pickup(db, system, cfg.pickup_samples, 0.05 if cfg.quick else 0.1,
                              1.0 if cfg.quick else 5.0, cfg)

    systems = [System(f"dbworker {DB_NAMES[db]}", db, run("dbworker"))]
    if db != "postgres":
        return systems
    return systems + [
        System(celery_label(), db, run("celery"), needs="celery"),
        System(tasks_label(), db, run("dbworker-tasks")),
        System(procrastinate_label(), db, run("procrastinate"), needs="procrastinate"),
    ]
