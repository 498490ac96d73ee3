"""Settings of the benchmark project. The database comes from BENCH_DB.

BENCH_DB: postgres (default), mysql or sqlite; the server URLs default to the local
servers (BENCH_POSTGRES_URL, BENCH_MYSQL_URL, BENCH_SQLITE_PATH).
BENCH_CONN_MAX_AGE: seconds, or "none" for persistent connections (Celery's fair setting).
BENCH_HARNESS=1 (run.py only) adds every database under its own alias as well.
"""

from __future__ import annotations

import os
import tempfile
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
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
# Defaults of the package, stated so the JSON records what was measured.
DBWORKER = {"LEASE_SECONDS": 30, "POLL_SECONDS": 0.25, "MAX_POLL_SECONDS": 10}
LOGGING = {"version": 1, "disable_existing_loggers": False}

# Celery (benchproject/celery_app.py reads CELERY_*).
CELERY_BROKER_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/15")
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_DEFAULT_QUEUE = "dbworker_bench"
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
# MariaDB has no partial indexes; the package knows (migration 0002) and uses a plain one.
SILENCED_SYSTEM_CHECKS = ["models.W037"]
