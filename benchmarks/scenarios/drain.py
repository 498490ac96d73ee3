"""Drain throughput: the no-queue ceiling, dbworker, Celery, the tasks backends and Procrastinate."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from .common import (
    CELERY_DB_REUSE_MAX,
    DB_NAMES,
    GROUP,
    QUEUE,
    Cfg,
    System,
    Tree,
    analyze,
    celery_worker,
    manage,
    processes_rss,
    purge_queue,
    queue_jobs,
    reset,
    runworkers,
    summarize_drain,
    version,
    wait_for_count,
)


# -- scenarios --------------------------------------------------------------------------
def drain_dbworker(db: str, n: int, cfg: Cfg, worker: str = "bench") -> dict[str, Any]:
    reset(db)
    queue_jobs(db, n, worker)
    analyze(db)
    t0 = time.monotonic()
    tree = runworkers(db, worker, drain=True, log=cfg.log)
    code = tree.wait(cfg.timeout)
    wall = time.monotonic() - t0
    tree.stop()
    result = summarize_drain(db, "dbworker", n, wall)
    result.update(exit_code=code, rss=tree.rss())
    return result


def drain_celery(n: int, cfg: Cfg, reuse: bool) -> dict[str, Any]:
    from benchapp.tasks import handle_job

    db = "postgres"
    reset(db)
    purge_queue()
    pks = queue_jobs(db, n)
    analyze(db)
    t = time.monotonic()
    for pk in pks:
        handle_job.apply_async((pk,), queue=QUEUE)
    publish = time.monotonic() - t
    t0 = time.monotonic()
    tree = celery_worker(reuse, cfg.log)
    ok = wait_for_count(db, "celery", n, cfg.timeout, tree)
    wall = time.monotonic() - t0
    tree.stop()
    purge_queue()
    result = summarize_drain(db, "celery", n, wall)
    result.update(completed=ok, publish_s=round(publish, 3), rss=tree.rss())
    return result


def drain_started(db: str, system: str, n: int, cfg: Cfg,
                  start: Callable[[], list[Tree]]) -> dict[str, Any]:
    """Start processes on queued work, wait until all n Effect rows exist, stop them."""
    t0 = time.monotonic()
    trees = start()
    ok = wait_for_count(db, system, n, cfg.timeout, *trees)
    wall = time.monotonic() - t0
    for tree in trees:
        tree.stop()
    result = summarize_drain(db, system, n, wall)
    result.update(completed=ok, rss=processes_rss(trees))
    return result


NOQUEUE_START_DELAY = 3.0  # s: both processes set up and connected, then start together


def drain_noqueue(db: str, n: int, cfg: Cfg, group: int) -> dict[str, Any]:
    """The ceiling: the job's own work in 2 plain processes, `group` jobs per transaction."""
    reset(db)
    queue_jobs(db, n)
    analyze(db)
    start_at = time.time() + NOQUEUE_START_DELAY

    def start() -> list[Tree]:
        return [manage(db, ["bench_noqueue", "--group", str(group), "--shard", str(i),
                            "--shards", "2", "--start-at", repr(start_at)], cfg.log)
                for i in range(2)]

    result = drain_started(db, "noqueue", n, cfg, start)
    result.update(group=group, wall_s=round(result["wall_s"] - NOQUEUE_START_DELAY, 3))
    return result


def drain_tasks_backend(n: int, cfg: Cfg) -> dict[str, Any]:
    """Our django.tasks backend: n tasks of the job enqueued, one `runworkers --queue
    bench --drain` (2 children, TASKS OPTIONS CONCURRENCY)."""
    from benchapp.task_jobs import handle_job
    from django.db import transaction

    db, system = "postgres", "dbworker-tasks"
    reset(db)
    pks = queue_jobs(db, n)
    enqueue_ms = timed_enqueues(handle_job, pks, system)
    with transaction.atomic(using=db):
        for pk in pks[len(enqueue_ms):]:
            handle_job.enqueue(pk, system)
    analyze(db)
    result = drain_started(db, system, n, cfg, lambda: [
        manage(db, ["runworkers", "--queue", "bench", "--drain", "-v0"], cfg.log)])
    return {**result, **enqueue_summary(enqueue_ms)}


ENQUEUE_SAMPLES = 500


def timed_enqueues(task: Any, pks: list[int], system: str) -> list[float]:
    """The first ENQUEUE_SAMPLES enqueues one by one, each its own transaction (as a view
    outside atomic() would call it): how long the call takes, in ms."""
    samples = []
    for pk in pks[:ENQUEUE_SAMPLES]:
        started = time.perf_counter()
        task.enqueue(pk, system)
        samples.append((time.perf_counter() - started) * 1000)
    return samples


def enqueue_summary(samples: list[float]) -> dict[str, Any]:
    ordered = sorted(samples)
    return {"enqueue_ms": {"n": len(ordered), "p50": round(statistics.median(ordered), 3),
                           "p95": round(ordered[int(len(ordered) * 0.95) - 1], 3)}}


def drain_tasks_db(n: int, cfg: Cfg) -> dict[str, Any]:
    """django-tasks-db: n tasks enqueued on its backend, two `db_worker --batch`
    processes (one task at a time each), persistent connections."""
    from benchapp.task_jobs import handle_job
    from django.db import transaction

    db, system = "postgres", "tasksdb"
    reset(db)
    pks = queue_jobs(db, n)
    task = handle_job.using(backend="tasksdb")
    enqueue_ms = timed_enqueues(task, pks, system)
    with transaction.atomic(using=db):
        for pk in pks[len(enqueue_ms):]:
            task.enqueue(pk, system)
    analyze(db)
    args = ["db_worker", "--backend", "tasksdb", "--queue-name", "bench", "--batch",
            "--no-startup-delay", "--no-reload", "-v0"]
    result = drain_started(db, system, n, cfg, lambda: [
        manage(db, args, cfg.log, BENCH_CONN_MAX_AGE="none") for _ in range(2)])
    return {**result, **enqueue_summary(enqueue_ms)}


PROCRASTINATE_WORKERS, PROCRASTINATE_CONCURRENCY = 2, 1


def drain_procrastinate(n: int, cfg: Cfg) -> dict[str, Any]:
    """Procrastinate (Django integration): n jobs deferred in one batch, worker processes
    `manage.py procrastinate worker --one-shot`, persistent connections."""
    from benchapp.procrastinate_tasks import handle_job

    db, system = "postgres", "procrastinate"
    reset(db)
    pks = queue_jobs(db, n)
    handle_job.batch_defer(*({"job_id": pk} for pk in pks))
    analyze(db)
    args = ["procrastinate", "worker", "--queues", "bench", "--one-shot",
            "--concurrency", str(PROCRASTINATE_CONCURRENCY)]
    return drain_started(db, system, n, cfg, lambda: [
        manage(db, args, cfg.log, BENCH_CONN_MAX_AGE="none")
        for _ in range(PROCRASTINATE_WORKERS)])


# -- the drain's systems ----------------------------------------------------------------
def drain_systems(db: str, cfg: Cfg) -> list[System]:
    """The no-queue ceiling and dbworker on every database; the peers on PostgreSQL."""
    n, name = cfg.drain_jobs, DB_NAMES[db]
    systems = [
        System(f"no queue {name}, {GROUP} jobs/transaction", db,
               lambda: drain_noqueue(db, n, cfg, GROUP), ceiling=True),
        System(f"no queue {name}, 1 job/transaction", db, lambda: drain_noqueue(db, n, cfg, 1)),
        System(f"dbworker {name}", db, lambda: drain_dbworker(db, n, cfg)),
        # Flow control (docs/flow-control.md): the same drain with per_key=1 over 1,000 keys.
        System(f"dbworker {name}, per_key=1 over 1,000 keys", db,
               lambda: drain_dbworker(db, n, cfg, worker="bench_keyed")),
    ]
    if db != "postgres":
        return systems
    systems.append(System(celery_label(), db, lambda: drain_celery(n, cfg, reuse=True),
                          needs="celery"))
    if not cfg.quick:
        systems.append(System(celery_label(reuse=False), db,
                              lambda: drain_celery(n, cfg, reuse=False), needs="celery"))
    return systems + [
        System(tasks_label(), db, lambda: drain_tasks_backend(n, cfg)),
        System(procrastinate_label(), db, lambda: drain_procrastinate(n, cfg),
               needs="procrastinate"),
        System(f"django-tasks-db {version('django-tasks-db')}, PostgreSQL, 2 db_worker", db,
               lambda: drain_tasks_db(n, cfg), needs="django_tasks_db"),
    ]


def celery_label(reuse: bool = True) -> str:
    setting = (f"CELERY_DB_REUSE_MAX={CELERY_DB_REUSE_MAX}" if reuse
               else "connection per task (DB_REUSE_MAX unset)")
    return f"Celery {version('celery')} + Redis, PostgreSQL, {setting}"


def tasks_label() -> str:
    return "django-dbworker tasks backend, PostgreSQL"


def procrastinate_label() -> str:
    return (f"Procrastinate {version('procrastinate')}, PostgreSQL, {PROCRASTINATE_WORKERS} "
            f"workers x concurrency {PROCRASTINATE_CONCURRENCY}")

def peer_config() -> dict[str, str]:
    """How each system is run: recorded in the JSON (config.peers), see docs/benchmarks.md."""
    return {
        "noqueue": f"2 processes (manage.py bench_noqueue), each every other Job row, "
                   f"{GROUP} jobs per transaction (the ceiling) or 1; started together",
        "dbworker": "runworkers --worker bench --concurrency bench=2 --drain (package defaults)",
        "celery": f"celery worker -P prefork -c 2, Redis broker, results ignored, "
                  f"CELERY_DB_REUSE_MAX={CELERY_DB_REUSE_MAX}, CONN_MAX_AGE=None",
        "dbworker_tasks": "TASKS backend django_dbworker.tasks.DatabaseBackend, OPTIONS "
                          "CONCURRENCY=2, runworkers --queue bench --drain",
        "procrastinate": f"procrastinate.contrib.django, {PROCRASTINATE_WORKERS} x manage.py "
                         f"procrastinate worker --one-shot --concurrency "
                         f"{PROCRASTINATE_CONCURRENCY}, CONN_MAX_AGE=None",
        "django_tasks_db": "2 x manage.py db_worker --batch --no-startup-delay (default "
                           "--interval 1), CONN_MAX_AGE=None",
    }
