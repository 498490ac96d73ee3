"""Shared helpers of the scenarios: set-up, database reset, queueing jobs, effect counts, process trees."""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent.parent  # benchmarks/ (this file is in benchmarks/scenarios/)
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
TABLES = ["benchapp_effect", "benchapp_job", "benchapp_orderedjob", "benchapp_poisonjob",
          "benchapp_keyedjob", "benchapp_ratejob", "benchapp_rateclaim", "benchapp_fairjob",
          "django_dbworker_flowlock", "django_dbworker_ratelog",
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
    from benchapp.models import FairJob, Job, KeyedJob, OrderedJob, RateJob

    return {"bench_ordered": OrderedJob, "bench_keyed": KeyedJob, "bench_rate": RateJob,
            "bench_fair": FairJob}.get(worker, Job)


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
SCHEDSTAT = os.path.exists("/proc/self/schedstat")  # Linux: the scheduler's nanoseconds


def _schedstat_seconds(pid: int) -> float:
    """On-CPU seconds of the live threads of ``pid`` (0 once it is gone)."""
    total = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return 0.0
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except FileNotFoundError:
            pass  # the thread ended meanwhile
    return total / 1e9


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
        """CPU time of the tree's processes. On Linux from /proc/PID/schedstat (the
        scheduler's nanoseconds: an idle process that wakes 25 times a second uses a few
        10 ms clock ticks in 5 s, too few to count in ticks), else psutil's ticks."""
        import psutil

        total = 0.0
        for p in self.members():
            if SCHEDSTAT:  # (one unit for every sample: never ticks for some of them)
                total += _schedstat_seconds(p.pid)
                continue
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


def runworkers(db: str, worker: str, *, drain: bool, log: Path, concurrency: int = 2,
               **env: str) -> Tree:
    args = [sys.executable, str(HERE / "manage.py"), "runworkers", "--worker", worker,
            "--concurrency", f"{worker}={concurrency}", "-v0"]
    if drain:
        args.append("--drain")
    return Tree(args, env_for(db, **env), log)


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


def processes_rss(trees: list[Tree]) -> dict[str, Any]:
    """Peers that run N worker processes (no coordinator): the largest one's RSS."""
    rss = [t.rss() for t in trees]
    if len(rss) == 1:
        return rss[0]
    return {"child_mb_max": max((r.get("coordinator_mb_max", 0.0) for r in rss), default=None)}


# -- the tables' systems (drain and pickup) --------------------------------------------
DB_NAMES = {"postgres": "PostgreSQL", "mysql": "MariaDB/MySQL", "sqlite": "SQLite"}


@dataclass
class System:
    """One row of the drain table: how to run it once, and the peer package it needs."""

    label: str
    db: str
    run: Callable[[], dict[str, Any]]
    needs: str | None = None  # module of an optional peer
    ceiling: bool = False  # the grouped no-queue row: the others are fractions of it


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


class Cfg(argparse.Namespace):
    log: Path
    idle_seconds: float
    timeout: float
