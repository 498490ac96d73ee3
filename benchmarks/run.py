#!/usr/bin/env python
"""django-dbworker benchmark, side by side with its peers, in one run.

    python benchmarks/run.py            # full: medians of 3, 5,000-job drains
    python benchmarks/run.py --quick    # fewer jobs, one repeat (a smoke test)
    make bench                          # installs benchmarks/requirements.txt first

Scenarios (see docs/benchmarks.md and benchmarks/README.md for the method): drain
throughput (N jobs queued before the workers start) on PostgreSQL, MariaDB/MySQL and
SQLite, against a no-queue ceiling (the job's own work in 2 plain processes, 16 or 1 jobs
per transaction) on each, and on PostgreSQL the peers: Celery + Redis (CELERY_DB_REUSE_MAX
set), our django.tasks backend, Procrastinate, django-tasks-db (each optional: "not run"
when its package is missing); pickup latency (row committed -> handler starts, warm idle
workers) and idle CPU; history ratio (1,000 new rows with 100,000 finished rows in history
vs none, default ordering and a filtered/ordered eligible()); scale-out (1, 2, 4
`runworkers` processes on PostgreSQL, duplicates checked); RSS of coordinator and children.
Prints a table and writes benchmarks/results/<date>[-quick][-partial].json; a complete full
run also writes results/latest.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
REQUIREMENTS = HERE / "requirements.txt"
# The harness needs psutil (installed when missing); each peer is optional: module -> pip.
PEERS = {"celery": "celery[redis]", "procrastinate": "procrastinate[django]",
         "django_tasks_db": "django-tasks-db"}
GROUP = 16  # rows per transaction in our children, and in the grouped no-queue ceiling
ALL_DBS = ("postgres", "mysql", "sqlite")
QUEUE = "dbworker_bench"


# -- set-up -----------------------------------------------------------------------------
def ensure_deps() -> None:
    """psutil, installed into this interpreter's venv when missing; the peers come from
    benchmarks/requirements.txt (`make bench` installs it)."""
    if find_spec("psutil") is None:
        print("Installing benchmark dependency: psutil", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "psutil>=5.9"], check=True)


def missing_peer(module: str) -> str | None:
    """None if the peer's package is importable, else the message printed for it."""
    if find_spec(module) is not None:
        return None
    return f"not run: install {PEERS[module]} (pip install -r {REQUIREMENTS.relative_to(ROOT)})"


def version(dist: str) -> str:
    import importlib.metadata as md

    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "?"


def env_for(db: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(DJANGO_SETTINGS_MODULE="benchproject.settings", BENCH_DB=db,
               PYTHONPATH=os.pathsep.join([str(HERE), str(ROOT), env.get("PYTHONPATH", "")]))
    env.pop("BENCH_HARNESS", None)
    env.update(extra)
    return env


def create_databases() -> list[str]:
    """(Re)create the benchmark databases, empty, so every run starts from the package's
    current migrations; returns the reachable ones."""
    from django.conf import settings

    reachable = ["sqlite"]
    for suffix in ("", "-wal", "-shm"):
        Path(settings.DBS["sqlite"]["NAME"] + suffix).unlink(missing_ok=True)
    pg = settings.DBS["postgres"]
    try:
        import psycopg

        with psycopg.connect(host=pg["HOST"], port=pg["PORT"] or 5432, user=pg["USER"],
                             password=pg["PASSWORD"] or None, dbname="postgres",
                             autocommit=True, connect_timeout=3) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{pg["NAME"]}" WITH (FORCE)')
            conn.execute(f'CREATE DATABASE "{pg["NAME"]}"')
        reachable.append("postgres")
    except Exception as exc:  # noqa: BLE001
        print(f"PostgreSQL unavailable, skipped: {exc}")
    my = settings.DBS["mysql"]
    try:
        import MySQLdb

        conn = MySQLdb.connect(host=my["HOST"], port=int(my["PORT"] or 3306), user=my["USER"],
                               password=my["PASSWORD"], connect_timeout=3)
        conn.cursor().execute(f"DROP DATABASE IF EXISTS `{my['NAME']}`")
        conn.cursor().execute(f"CREATE DATABASE `{my['NAME']}` "
                              "CHARACTER SET utf8mb4 COLLATE utf8mb4_unicode_ci")
        conn.close()
        reachable.append("mysql")
    except Exception as exc:  # noqa: BLE001
        print(f"MariaDB/MySQL unavailable, skipped: {exc}")
    return [db for db in ALL_DBS if db in reachable]


def migrate(db: str) -> None:
    # A separate process: `default` is this database there, so post_migrate installs
    # the triggers of the registered workers on it.
    subprocess.run([sys.executable, str(HERE / "manage.py"), "migrate", "-v0"],
                   env=env_for(db), check=True, cwd=HERE)
    if db == "sqlite":
        from django.db import connections

        with connections["sqlite"].cursor() as c:
            c.execute("PRAGMA journal_mode=WAL")  # persists in the file


# -- database helpers (harness side, Django ORM on the alias of each database) -----------
TABLES = ["benchapp_effect", "benchapp_job", "benchapp_orderedjob",
          "django_dbworker_execution", "django_dbworker_coordinatorheartbeat"]


# The tasks and the peers' tables, on PostgreSQL (only there do the tasks and peers run).
PEER_TABLES = ["django_dbworker_task", "django_tasks_db_dbtaskresult", "procrastinate_jobs",
               "procrastinate_events", "procrastinate_periodic_defers", "procrastinate_workers"]


def reset(db: str) -> None:
    from django.db import connections

    with connections[db].cursor() as c:
        if db == "postgres":
            present = set(connections[db].introspection.table_names(c))
            tables = TABLES + [t for t in PEER_TABLES if t in present]
            c.execute(f"TRUNCATE {', '.join(tables)} RESTART IDENTITY CASCADE")
        elif db == "mysql":
            for t in TABLES:
                c.execute(f"TRUNCATE TABLE {t}")
        else:
            for t in sorted(TABLES, key=lambda t: not t.startswith("django_dbworker")):
                c.execute(f"DELETE FROM {t}")  # Execution first: delete triggers find nothing
            c.execute("DELETE FROM sqlite_sequence")
    analyze(db)


def analyze(db: str) -> None:
    from django.db import connections

    with connections[db].cursor() as c:
        if db == "postgres":
            c.execute("VACUUM ANALYZE")
        elif db == "mysql":
            c.execute(f"ANALYZE TABLE {', '.join(TABLES)}")
            c.fetchall()
            wait_for_purge(c)
        else:
            c.execute("ANALYZE")


def wait_for_purge(cursor: Any, limit: float = 120.0) -> None:
    """InnoDB removes old row versions (from making the history) in the background, as
    VACUUM does on PostgreSQL: wait until it has, so it does not run during a measurement.
    A long-lived database has done this long ago."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        cursor.execute("SHOW ENGINE INNODB STATUS")
        status = cursor.fetchone()[2]
        length = next((int(line.split()[-1]) for line in status.splitlines()
                       if line.startswith("History list length")), 0)
        if length < 1000:
            return
        time.sleep(0.5)


def model_for(worker: str) -> Any:
    from benchapp.models import Job, OrderedJob

    return OrderedJob if worker == "bench_ordered" else Job


def queue_jobs(db: str, n: int, worker: str = "bench") -> list[int]:
    """bulk_create n rows (the triggers make each one PENDING work); returns the pks."""
    from django.db import transaction

    model = model_for(worker)
    rng = random.Random(n)
    with transaction.atomic(using=db):
        for start in range(0, n, 2000):
            model.objects.using(db).bulk_create(
                [model(created_ts=time.time(), priority=rng.randrange(1000))
                 for _ in range(min(2000, n - start))], batch_size=2000)
    return list(model.objects.using(db).order_by().values_list("pk", flat=True))


def make_history(db: str, n: int, worker: str) -> None:
    """n finished rows: bulk_create, then one UPDATE of their Execution rows."""
    from django.utils import timezone

    from django_dbworker.models import Execution

    queue_jobs(db, n, worker)
    Execution.objects.using(db).filter(worker=worker).update(
        status="finished", finished_at=timezone.now(), attempts=1)


def effects(db: str, system: str) -> list[tuple[int, float, int]]:
    from benchapp.models import Effect

    return list(Effect.objects.using(db).filter(system=system)
                .values_list("job_id", "started_at", "pid"))


def effect_count(db: str, system: str) -> int:
    from benchapp.models import Effect

    return Effect.objects.using(db).filter(system=system).count()


def summarize_drain(db: str, system: str, n: int, wall: float) -> dict[str, Any]:
    rows = effects(db, system)
    starts = sorted(r[1] for r in rows)
    ids = [r[0] for r in rows]
    span = starts[-1] - starts[0] if len(starts) > 1 else 0.0
    return {
        "jobs": n,
        "done": len(rows),
        "duplicates": len(ids) - len(set(ids)),
        "jobs_per_s": round((len(starts) - 1) / span, 1) if span > 0 else None,
        "span_s": round(span, 3),
        "wall_s": round(wall, 3),
        "processes": len({r[2] for r in rows}),
    }


# -- processes --------------------------------------------------------------------------
class Tree:
    """A started process plus RSS / CPU sampling of it and its children (psutil)."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        import psutil

        self.log = log.open("ab")
        self.proc = subprocess.Popen(args, env=env, cwd=HERE, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.ps = psutil.Process(self.proc.pid)
        self.samples: list[tuple[float, float, list[float]]] = []

    def members(self) -> list[Any]:
        import psutil

        try:
            return [self.ps, *self.ps.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def sample(self) -> None:
        import psutil

        try:
            main = self.ps.memory_info().rss / 2**20
            kids = []
            for c in self.ps.children(recursive=True):
                try:
                    kids.append(c.memory_info().rss / 2**20)
                except psutil.NoSuchProcess:
                    pass
            self.samples.append((time.monotonic(), main, kids))
        except psutil.NoSuchProcess:
            pass

    def cpu_seconds(self) -> float:
        import psutil

        total = 0.0
        for p in self.members():
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        return total

    def rss(self) -> dict[str, Any]:
        s = [x for x in self.samples if x[2]] or self.samples
        if not s:
            return {}
        return {
            "coordinator_mb_first": round(s[0][1], 1), "coordinator_mb_last": round(s[-1][1], 1),
            "coordinator_mb_max": round(max(x[1] for x in s), 1),
            "child_mb_first": [round(k, 1) for k in s[0][2]],
            "child_mb_last": [round(k, 1) for k in s[-1][2]],
            "child_mb_max": round(max((max(x[2]) for x in s if x[2]), default=0.0), 1),
        }

    def wait(self, timeout: float, every: float = 0.25) -> int | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.sample()
            code = self.proc.poll()
            if code is not None:
                return code
            time.sleep(every)
        return None

    def stop(self, timeout: float = 15.0) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()


def runworkers(db: str, worker: str, *, drain: bool, log: Path) -> Tree:
    args = [sys.executable, str(HERE / "manage.py"), "runworkers", "--worker", worker,
            "--concurrency", f"{worker}=2", "-v0"]
    if drain:
        args.append("--drain")
    return Tree(args, env_for(db), log)


CELERY_DB_REUSE_MAX = 1_000_000  # passed to benchproject.settings (BENCH_CELERY_DB_REUSE_MAX)


def celery_worker(reuse: bool, log: Path) -> Tree:
    """Celery prefork, 2 children, persistent connections (CONN_MAX_AGE=None); with
    `reuse`, CELERY_DB_REUSE_MAX set, without which the Django fixup closes the
    connection around every task."""
    args = [sys.executable, "-m", "celery", "-A", "benchproject.celery_app", "worker",
            "-P", "prefork", "-c", "2", "-Q", QUEUE, "--without-gossip", "--without-mingle",
            "--without-heartbeat", "-l", "WARNING"]
    return Tree(args, env_for("postgres", BENCH_CONN_MAX_AGE="none",
                              BENCH_CELERY_DB_REUSE_MAX=str(CELERY_DB_REUSE_MAX if reuse else 0)),
                log)


def manage(db: str, args: list[str], log: Path, **env: str) -> Tree:
    return Tree([sys.executable, str(HERE / "manage.py"), *args], env_for(db, **env), log)


def purge_queue() -> None:
    import redis
    from django.conf import settings

    redis.Redis.from_url(settings.CELERY_BROKER_URL).delete(QUEUE)


def wait_for_count(db: str, system: str, n: int, timeout: float, *trees: Tree | None) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for tree in trees:
            if tree is not None:
                tree.sample()
        if effect_count(db, system) >= n:
            return True
        time.sleep(0.1)
    return False


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


def processes_rss(trees: list[Tree]) -> dict[str, Any]:
    """Peers that run N worker processes (no coordinator): the largest one's RSS."""
    rss = [t.rss() for t in trees]
    if len(rss) == 1:
        return rss[0]
    return {"child_mb_max": max((r.get("coordinator_mb_max", 0.0) for r in rss), default=None)}


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
                "--concurrency", str(PROCRASTINATE_CONCURRENCY)]
        return ([manage(db, args, cfg.log, BENCH_CONN_MAX_AGE="none")
                 for _ in range(PROCRASTINATE_WORKERS)], lambda pk: deferred.defer(job_id=pk))
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


def history(db: str, worker: str, new: int, past: int, cfg: Cfg) -> dict[str, Any]:
    reset(db)
    if past:
        make_history(db, past, worker)
    t = time.monotonic()
    queue_jobs(db, new, worker)
    analyze(db)
    setup = time.monotonic() - t
    tree = runworkers(db, worker, drain=True, log=cfg.log)
    t0 = time.monotonic()
    code = tree.wait(cfg.timeout)
    wall = time.monotonic() - t0
    tree.stop()
    result = summarize_drain(db, "dbworker", new, wall)
    result.update(history=past, exit_code=code, setup_s=round(setup, 2))
    return result


def cpu_times() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine, from /proc/stat (Linux)."""
    try:
        fields = [float(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    except OSError:
        return 0.0, 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def wait_until_idle(trees: list[Tree], timeout: float = 120.0) -> None:
    """Until the started processes (and their children) stop using CPU: set up and idle."""
    deadline = time.monotonic() + timeout
    last = sum(t.cpu_seconds() for t in trees)
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = sum(t.cpu_seconds() for t in trees)
        if all(t.members()[1:] for t in trees) and now - last < 0.05:
            return
        last = now


def scale_out(processes: int, n: int, cfg: Cfg) -> dict[str, Any]:
    """N warm `runworkers` processes (started and idle first, so that start-up is not
    measured), then n jobs inserted in one transaction; PostgreSQL wakes them all."""
    from django_dbworker.models import Execution

    db = "postgres"
    reset(db)
    trees = [runworkers(db, "bench", drain=False, log=cfg.log) for _ in range(processes)]
    try:
        wait_until_idle(trees)
        busy0, total0 = cpu_times()
        t0 = time.monotonic()
        queue_jobs(db, n)
        ok = wait_for_count(db, "dbworker", n, cfg.timeout)
        wall = time.monotonic() - t0
        busy1, total1 = cpu_times()
    finally:
        for t in trees:
            t.stop()
    result = summarize_drain(db, "dbworker", n, wall)
    result.update(processes=processes, completed=ok,
                  machine_cpu_busy_percent=round(100 * (busy1 - busy0) / (total1 - total0), 1)
                  if total1 > total0 else None,
                  finished=Execution.objects.using(db).filter(worker="bench",
                                                              status="finished").count())
    return result


def memory(n: int, cfg: Cfg) -> dict[str, Any]:
    """One long drain on PostgreSQL with RSS sampled throughout: the coordinator's and
    each child's resident memory early in the run (10-20% of it) against its end."""
    db = "postgres"
    reset(db)
    queue_jobs(db, n)
    analyze(db)
    tree = runworkers(db, "bench", drain=True, log=cfg.log)
    code = tree.wait(cfg.timeout, every=0.5)
    tree.stop()
    samples = [x for x in tree.samples if x[2]]
    if len(samples) < 10:
        return {"jobs": n, "exit_code": code, "error": "too few samples"}
    t0, t1 = samples[0][0], samples[-1][0]
    early = [x for x in samples if t0 + 0.1 * (t1 - t0) <= x[0] <= t0 + 0.2 * (t1 - t0)]
    late = [x for x in samples if x[0] >= t0 + 0.9 * (t1 - t0)]

    def mb(xs: list[Any], pick: Any) -> float:
        return round(statistics.median(pick(x) for x in xs), 1)

    result = summarize_drain(db, "dbworker", n, t1 - t0)
    result.update(
        exit_code=code,
        coordinator_mb_early=mb(early, lambda x: x[1]),
        coordinator_mb_end=mb(late, lambda x: x[1]),
        child_mb_early=mb(early, lambda x: max(x[2])),
        child_mb_end=mb(late, lambda x: max(x[2])),
    )
    result["coordinator_growth_mb"] = round(
        result["coordinator_mb_end"] - result["coordinator_mb_early"], 1)
    result["child_growth_mb"] = round(result["child_mb_end"] - result["child_mb_early"], 1)
    return result


# -- the drain's systems ----------------------------------------------------------------
DB_NAMES = {"postgres": "PostgreSQL", "mysql": "MariaDB/MySQL", "sqlite": "SQLite"}


@dataclass
class System:
    """One row of the drain table: how to run it once, and the peer package it needs."""

    label: str
    db: str
    run: Callable[[], dict[str, Any]]
    needs: str | None = None  # module of an optional peer
    ceiling: bool = False  # the grouped no-queue row: the others are fractions of it


def drain_systems(db: str, cfg: Cfg) -> list[System]:
    """The no-queue ceiling and dbworker on every database; the peers on PostgreSQL."""
    n, name = cfg.drain_jobs, DB_NAMES[db]
    systems = [
        System(f"no queue {name}, {GROUP} jobs/transaction", db,
               lambda: drain_noqueue(db, n, cfg, GROUP), ceiling=True),
        System(f"no queue {name}, 1 job/transaction", db, lambda: drain_noqueue(db, n, cfg, 1)),
        System(f"dbworker {name}", db, lambda: drain_dbworker(db, n, cfg)),
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


def run_system(system: System, kind: str, raw: dict[str, Any], step: Callable[[str], None],
               repeat: int) -> None:
    """Run one system once into raw[kind], or note (and print, once) why it cannot."""
    missing = system.needs and missing_peer(system.needs)
    not_run = raw["not_run"].setdefault(kind, {})
    if missing:
        if system.label not in not_run:
            print(f"  {kind} {system.label}: {missing}", flush=True)
        not_run[system.label] = missing
        return
    step(f"{kind} {system.label} (run {repeat + 1})")
    result = system.run()
    result.update(db=system.db, ceiling=system.ceiling)
    raw[kind].setdefault(system.label, []).append(result)

# -- reporting --------------------------------------------------------------------------
def percentile(values: list[float], p: float) -> float:
    if len(values) == 1:
        return values[0]
    k = (len(values) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def median_of(runs: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in runs if r.get(key) is not None]
    return round(statistics.median(vals), 2) if vals else None


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version(),
                            "cpus": os.cpu_count()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        info["mem_gb"] = round(int(Path("/proc/meminfo").read_text().split()[1]) / 2**20, 1)
        info["loadavg_at_start"] = os.getloadavg()
    except OSError:
        pass
    import importlib.metadata as md

    for pkg in ("django", "psycopg", "mysqlclient", "celery", "redis", "procrastinate",
                "django-tasks-db"):
        try:
            info[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return info


def server_versions(dbs: list[str]) -> dict[str, str]:
    from django.db import connections

    out = {}
    for db in dbs:
        with connections[db].cursor() as c:
            c.execute("SELECT sqlite_version()" if db == "sqlite" else "SELECT version()")
            out[db] = str(c.fetchone()[0])
    return out


def fmt(v: Any, suffix: str = "") -> str:
    return "-" if v is None else f"{v:,}{suffix}" if isinstance(v, int) else f"{v:,.1f}{suffix}" \
        if isinstance(v, float) else str(v)


W = 76  # width of the tables' first column


def print_table(report: dict[str, Any]) -> None:
    s, cfg = report["summary"], report["config"]
    print()
    print(f"django-dbworker benchmark {report['date']}  ({report['mode']}, "
          f"{cfg['repeats']} repeat(s), medians)")
    print(f"machine: {report['machine'].get('cpu', '?')}, {report['machine']['cpus']} cpus")
    print()
    for section, show in (("drain", print_drain), ("pickup", print_pickup),
                          ("history", print_history), ("scale_out", print_scale_out),
                          ("memory", print_memory)):
        if s.get(section):  # a partial run (--only) leaves the others out
            show(s[section], cfg)
            print()


def print_drain(rows: dict[str, Any], cfg: dict[str, Any]) -> None:
    print(f"Drain throughput ({cfg['drain_jobs']:,} jobs queued, concurrency 2; 'of ceiling' "
          f"= jobs/s / the same database's no queue, {GROUP} jobs/transaction)")
    print(f"  {'system':<{W}}{'jobs/s':>10}{'of ceiling':>12}{'ran twice':>11}"
          f"{'coord RSS MB':>14}{'child RSS MB':>14}")
    for name, row in rows.items():
        if row.get("not_run"):
            print(f"  {name:<{W}}  {row['not_run']}")
            continue
        share = row.get("of_ceiling")
        print(f"  {name:<{W}}{fmt(row['jobs_per_s']):>10}"
              f"{'-' if share is None else f'{share:.2f}x':>12}{fmt(row['duplicates']):>11}"
              f"{fmt(row.get('coordinator_mb')):>14}{fmt(row.get('child_mb')):>14}")
        if row.get("enqueue_ms_p50") is not None:
            print(f"  {'':<{W}}  enqueue() call p50 {row['enqueue_ms_p50']:.2f} ms, "
                  f"p95 {row['enqueue_ms_p95']:.2f} ms ({ENQUEUE_SAMPLES} calls, "
                  "each its own transaction)")


def print_pickup(rows: dict[str, Any], cfg: dict[str, Any]) -> None:
    print(f"Pickup latency ({cfg['pickup_samples']} single inserts, warm idle workers)")
    print(f"  {'system':<{W}}{'p50 ms':>10}{'p95 ms':>10}{'max ms':>10}{'idle CPU %':>12}")
    for name, row in rows.items():
        if row.get("not_run"):
            print(f"  {name:<{W}}  {row['not_run']}")
            continue
        print(f"  {name:<{W}}{fmt(row['p50_ms']):>10}{fmt(row['p95_ms']):>10}"
              f"{fmt(row['max_ms']):>10}{fmt(row['idle_cpu_percent']):>12}")


def print_history(rows: dict[str, Any], cfg: dict[str, Any]) -> None:
    print(f"History ({cfg['history_new']:,} new rows; {cfg['history_rows']:,} finished rows vs "
          "none)")
    print(f"  {'database / worker':<38}{'empty j/s':>10}{'history j/s':>13}{'ratio':>8}")
    for name, row in rows.items():
        print(f"  {name:<38}{fmt(row['empty']):>10}{fmt(row['history']):>13}"
              f"{fmt(row['ratio']):>8}")


def print_scale_out(rows: dict[str, Any], cfg: dict[str, Any]) -> None:
    print(f"Scale-out on PostgreSQL ({cfg['scale_jobs']:,} jobs, N warm runworkers, "
          "concurrency 2 each)")
    print(f"  {'processes':<38}{'jobs/s':>10}{'ran twice':>11}{'finished':>10}"
          f"{'CPU busy %':>12}")
    for name, row in rows.items():
        print(f"  {name:<38}{fmt(row['jobs_per_s']):>10}{fmt(row['duplicates']):>11}"
              f"{fmt(row['finished']):>10}{fmt(row.get('cpu_busy_percent')):>12}")


def print_memory(m: dict[str, Any], cfg: dict[str, Any]) -> None:
    print(f"Memory over one drain of {cfg['memory_jobs']:,} jobs on PostgreSQL "
          "(RSS MB, early = 10-20% into the run)")
    print(f"  {'process':<38}{'early':>10}{'end':>10}{'growth':>10}")
    print(f"  {'coordinator':<38}{fmt(m['coordinator_mb_early']):>10}"
          f"{fmt(m['coordinator_mb_end']):>10}{fmt(m['coordinator_growth_mb']):>10}")
    print(f"  {'largest child':<38}{fmt(m['child_mb_early']):>10}"
          f"{fmt(m['child_mb_end']):>10}{fmt(m['child_growth_mb']):>10}")
    print(f"  ({fmt(m['jobs_per_s'])} jobs/s, {m['done']:,} done, {m['duplicates']} ran twice)")


def summarize_drains(drains: dict[str, list[dict[str, Any]]],
                     not_run: dict[str, str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Medians per system, each also as a fraction of its database's grouped no-queue
    ceiling (`of_ceiling`); the systems that did not run, with the reason."""
    out: dict[str, Any] = {}
    for name, runs in drains.items():
        rss = [r.get("rss") or {} for r in runs]
        out[name] = {
            "db": runs[0].get("db"),
            "jobs_per_s": median_of(runs, "jobs_per_s"),
            "all_jobs_per_s": [r["jobs_per_s"] for r in runs],
            "duplicates": sum(r["duplicates"] for r in runs),
            "done": min(r["done"] for r in runs),
            "coordinator_mb": max((x.get("coordinator_mb_max", 0) for x in rss), default=None)
            or None,
            "child_mb": max((x.get("child_mb_max", 0) for x in rss), default=None) or None,
        }
        if runs[0].get("enqueue_ms"):  # the task backends: how long one enqueue() call takes
            out[name]["enqueue_ms_p50"] = median_of([r["enqueue_ms"] for r in runs], "p50")
            out[name]["enqueue_ms_p95"] = median_of([r["enqueue_ms"] for r in runs], "p95")
    ceiling = {runs[0]["db"]: {"system": name, "jobs_per_s": out[name]["jobs_per_s"]}
               for name, runs in drains.items() if runs[0].get("ceiling")}
    for row in out.values():
        top = ceiling.get(row["db"], {}).get("jobs_per_s")
        row["of_ceiling"] = round(row["jobs_per_s"] / top, 2) \
            if top and row["jobs_per_s"] else None
    for name, reason in not_run.items():
        out.setdefault(name, {"jobs_per_s": None, "not_run": reason})
    return out, ceiling


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"drain": {}, "pickup": {}, "history": {}, "scale_out": {}}
    if raw.get("memory"):
        out["memory"] = raw["memory"][-1]  # one long run: it is its own repeat
    not_run = raw.get("not_run", {})
    out["drain"], out["ceiling"] = summarize_drains(raw["drain"], not_run.get("drain", {}))
    for name, runs in raw["pickup"].items():
        out["pickup"][name] = {k: median_of(runs, k) for k in
                               ("p50_ms", "p95_ms", "max_ms", "idle_cpu_percent")}
    for name, reason in not_run.get("pickup", {}).items():
        out["pickup"].setdefault(name, {"not_run": reason})
    for name, pair in raw["history"].items():
        empty = median_of(pair["empty"], "jobs_per_s")
        full = median_of(pair["history"], "jobs_per_s")
        out["history"][name] = {"empty": empty, "history": full,
                                "ratio": round(full / empty, 2) if empty and full else None}
    for name, runs in raw["scale_out"].items():
        out["scale_out"][name] = {
            "jobs_per_s": median_of(runs, "jobs_per_s"),
            "duplicates": sum(r["duplicates"] for r in runs),
            "finished": min(r["finished"] for r in runs),
            "cpu_busy_percent": median_of(runs, "machine_cpu_busy_percent"),
        }
    return out


class Cfg(argparse.Namespace):
    log: Path
    timeout: float


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer jobs, one repeat (< 2 min)")
    parser.add_argument("--repeats", type=int, help="runs per measurement (median)")
    parser.add_argument("--drain-jobs", type=int)
    parser.add_argument("--pickup-samples", type=int)
    parser.add_argument("--history-rows", type=int)
    parser.add_argument("--history-new", type=int)
    parser.add_argument("--scale-jobs", type=int)
    parser.add_argument("--memory-jobs", type=int)
    parser.add_argument("--databases", default=",".join(ALL_DBS),
                        help="comma-separated subset of postgres,mysql,sqlite")
    parser.add_argument("--only", default="drain,pickup,history,scale,memory",
                        help="comma-separated subset of drain,pickup,history,scale,memory")
    parser.add_argument("--procrastinate", default="2x1", metavar="WORKERSxCONCURRENCY",
                        help="Procrastinate worker processes x --concurrency of each "
                             "(default 2x1: see docs/benchmarks.md)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds one drain may take before it is stopped")
    cfg = parser.parse_args(namespace=Cfg())
    quick = cfg.quick
    cfg.repeats = cfg.repeats or (1 if quick else 3)
    cfg.drain_jobs = cfg.drain_jobs or (400 if quick else 5000)
    cfg.pickup_samples = cfg.pickup_samples or (25 if quick else 200)
    cfg.history_rows = cfg.history_rows or (10_000 if quick else 100_000)
    cfg.history_new = cfg.history_new or (250 if quick else 1000)
    cfg.scale_jobs = cfg.scale_jobs or (400 if quick else 5000)
    cfg.memory_jobs = cfg.memory_jobs or (5000 if quick else 100_000)
    only = set(cfg.only.split(","))
    global PROCRASTINATE_WORKERS, PROCRASTINATE_CONCURRENCY
    PROCRASTINATE_WORKERS, PROCRASTINATE_CONCURRENCY = map(int, cfg.procrastinate.split("x"))

    ensure_deps()
    sys.path[:0] = [str(HERE), str(ROOT)]
    os.environ.update(DJANGO_SETTINGS_MODULE="benchproject.settings", BENCH_HARNESS="1",
                      BENCH_DB="postgres")
    import django

    django.setup()
    RESULTS.mkdir(exist_ok=True)
    cfg.log = Path(tempfile.gettempdir()) / "dbworker_bench-last-run.log"
    cfg.log.write_text("")
    started = time.monotonic()
    dbs = [d for d in create_databases() if d in cfg.databases.split(",")]
    for db in dbs:
        migrate(db)
    report: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "mode": "quick" if quick else "full",
        "config": {k: getattr(cfg, k) for k in ("repeats", "drain_jobs", "pickup_samples",
                                                 "history_rows", "history_new", "scale_jobs", "memory_jobs")},
        "machine": machine(), "servers": server_versions(dbs),
    }
    from django.conf import settings

    report["config"]["dbworker_settings"] = settings.DBWORKER
    report["config"]["peers"] = peer_config()
    raw: dict[str, Any] = {"drain": {}, "not_run": {}, "pickup": {}, "history": {},
                           "scale_out": {}, "memory": []}

    def step(label: str) -> None:
        print(f"[{time.monotonic() - started:6.1f}s] {label}", flush=True)

    # Interleaved: each repeat runs every system once, in turn.
    for r in range(cfg.repeats):
        if "drain" in only:
            for db in dbs:
                for system in drain_systems(db, cfg):
                    run_system(system, "drain", raw, step, r)
        if "pickup" in only:
            for db in dbs:
                for system in pickup_systems(db, cfg):
                    run_system(system, "pickup", raw, step, r)
        if "history" in only:
            for db in dbs if not quick else [d for d in dbs if d == "postgres"] or dbs[:1]:
                for worker in ("bench", "bench_ordered"):
                    label = (f"{DB_NAMES[db]} / "
                             f"{'default order' if worker == 'bench' else 'filter+order_by'}")
                    pair = raw["history"].setdefault(label, {"empty": [], "history": []})
                    for past, key in ((0, "empty"), (cfg.history_rows, "history")):
                        step(f"history {label}, {past} finished rows (run {r + 1})")
                        pair[key].append(history(db, worker, cfg.history_new, past, cfg))
        if "scale" in only and "postgres" in dbs:
            for n in (1, 2, 4):
                step(f"scale-out x{n} (run {r + 1})")
                raw["scale_out"].setdefault(f"{n} process(es)", []).append(
                    scale_out(n, cfg.scale_jobs, cfg))
    if "memory" in only and "postgres" in dbs:
        step(f"memory: one drain of {cfg.memory_jobs:,} jobs")
        raw["memory"].append(memory(cfg.memory_jobs, cfg))
    report["summary"] = summarize(raw)
    report["runs"] = raw
    report["elapsed_s"] = round(time.monotonic() - started, 1)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    # latest.json is the latest complete full run: a quick or partial run (--only,
    # --databases) writes only its dated file.
    partial = only != {"drain", "pickup", "history", "scale", "memory"} or len(dbs) < len(ALL_DBS)
    dated = RESULTS / f"{stamp}{'-quick' if quick else ''}{'-partial' if partial else ''}.json"
    paths = [dated] if partial or quick else [dated, RESULTS / "latest.json"]
    for path in paths:
        path.write_text(json.dumps(report, indent=2) + "\n")
    print_table(report)
    print(f"elapsed {report['elapsed_s']}s; JSON: {', '.join(map(str, paths))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
