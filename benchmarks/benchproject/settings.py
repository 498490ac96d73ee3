"""Settings of the benchmark project. The database comes from BENCH_DB.

BENCH_DB: postgres (default), mysql or sqlite; the server URLs default to the local
servers (BENCH_POSTGRES_URL, BENCH_MYSQL_URL, BENCH_SQLITE_PATH).
BENCH_CONN_MAX_AGE: seconds, or "none" for persistent connections (what the peers run with).
BENCH_CELERY_DB_REUSE_MAX: Celery's CELERY_DB_REUSE_MAX (default 1,000,000; 0: unset).
BENCH_HARNESS=1 (run.py only) adds every database under its own alias as well.

The peers (Celery, Procrastinate, django-tasks-db) are optional: their apps and settings
are added only when their packages are importable (pip install -r benchmarks/requirements.txt).
"""

from __future__ import annotations

import os
import tempfile
from importlib.util import find_spec
from pathlib import Path
from urllib.parse import unquote, urlsplit

DB = os.environ.get("BENCH_DB", "postgres")
POSTGRES_URL = os.environ.get("BENCH_POSTGRES_URL", "postgresql://root@127.0.0.1:5432/dbworker_bench")
MYSQL_URL = os.environ.get("BENCH_MYSQL_URL", "mysql://root@127.0.0.1:3306/dbworker_bench")
SQLITE_PATH = os.environ.get("BENCH_SQLITE_PATH",
                             str(Path(tempfile.gettempdir()) / "dbworker_bench.sqlite3"))
_age = os.environ.get("BENCH_CONN_MAX_AGE", "0")
CONN_MAX_AGE = None if _age.lower() == "none" else int(_age)


def from_url(url: str, engine: str) -> dict:
    parts = urlsplit(url)
    return {
        "ENGINE": engine,
        "NAME": parts.path.lstrip("/"),
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": parts.hostname or "",
        "PORT": str(parts.port or ""),
        "CONN_MAX_AGE": CONN_MAX_AGE,
    }


DBS = {
    "postgres": from_url(POSTGRES_URL, "django.db.backends.postgresql"),
    "mysql": {**from_url(MYSQL_URL, "django.db.backends.mysql"),
              "OPTIONS": {"charset": "utf8mb4"}},
    "sqlite": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": SQLITE_PATH,
        "CONN_MAX_AGE": CONN_MAX_AGE,
        # WAL is set once on the file by run.py (it persists); IMMEDIATE: see vendors.py.
        "OPTIONS": {"transaction_mode": "IMMEDIATE", "timeout": 20},
    },
}
DATABASES = {"default": dict(DBS[DB])}
if os.environ.get("BENCH_HARNESS"):
    DATABASES.update({alias: dict(d) for alias, d in DBS.items()})

SECRET_KEY = "benchmark-only"
USE_TZ = True
INSTALLED_APPS = ["django.contrib.contenttypes", "django_dbworker", "benchapp"]
# Procrastinate's schema is PostgreSQL only: its app exists in the PostgreSQL processes.
HAVE_PROCRASTINATE = DB == "postgres" and find_spec("procrastinate") is not None
HAVE_TASKS_DB = find_spec("django_tasks_db") is not None
if HAVE_PROCRASTINATE:
    INSTALLED_APPS.append("procrastinate.contrib.django")
if HAVE_TASKS_DB:
    INSTALLED_APPS.append("django_tasks_db")
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
# Defaults of the package, stated so the JSON records what was measured.
DBWORKER = {"LEASE_SECONDS": 30, "POLL_SECONDS": 0.25, "MAX_POLL_SECONDS": 10}
LOGGING = {"version": 1, "disable_existing_loggers": False}

# django.tasks: our backend ("default", queue "bench", 2 children per runworkers) and
# django-tasks-db ("tasksdb", run by two `db_worker` processes). benchapp/task_jobs.py.
TASKS = {"default": {"BACKEND": "django_dbworker.tasks.DatabaseBackend", "QUEUES": ["bench"],
                     "OPTIONS": {"CONCURRENCY": 2}}}
if HAVE_TASKS_DB:
    TASKS["tasksdb"] = {"BACKEND": "django_tasks_db.DatabaseBackend", "QUEUES": ["bench"]}

# Procrastinate: its Django integration on the default database; tasks in
# benchapp/procrastinate_tasks.py (benchapp/tasks.py is Celery's).
PROCRASTINATE_AUTODISCOVER_MODULE_NAME = "procrastinate_tasks"

# Celery (benchproject/celery_app.py reads CELERY_*).
CELERY_BROKER_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/15")
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_DEFAULT_QUEUE = "dbworker_bench"
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
# Without it Celery's Django fixup closes the database connection before and after every
# task, whatever CONN_MAX_AGE says: reuse it, Celery's documented way to keep connections.
CELERY_DB_REUSE_MAX = int(os.environ.get("BENCH_CELERY_DB_REUSE_MAX", "1000000")) or None
# MariaDB has no partial indexes; the package knows (migration 0002) and uses a plain one.
SILENCED_SYSTEM_CHECKS = ["models.W037"]
