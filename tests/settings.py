"""Test settings: the database comes from DBWORKER_TEST_DB (sqlite, postgres or mysql).

Server URLs default to the local servers and can be changed with
DBWORKER_TEST_POSTGRES_URL and DBWORKER_TEST_MYSQL_URL.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from urllib.parse import unquote, urlsplit

DB = os.environ.get("DBWORKER_TEST_DB", "sqlite")
POSTGRES_URL = os.environ.get("DBWORKER_TEST_POSTGRES_URL", "postgresql://root@127.0.0.1:5432/test")
MYSQL_URL = os.environ.get("DBWORKER_TEST_MYSQL_URL", "mysql://root@127.0.0.1:3306/test")
SQLITE_DIR = Path(os.environ.get("DBWORKER_TEST_SQLITE_DIR", tempfile.gettempdir()))


def from_url(url: str, engine: str) -> dict:
    parts = urlsplit(url)
    return {
        "ENGINE": engine,
        "NAME": parts.path.lstrip("/"),
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": parts.hostname or "",
        "PORT": str(parts.port or ""),
    }


if DB == "postgres":
    default = from_url(POSTGRES_URL, "django.db.backends.postgresql")
elif DB == "mysql":
    default = from_url(MYSQL_URL, "django.db.backends.mysql")
    default["OPTIONS"] = {"charset": "utf8mb4"}
    default["TEST"] = {"CHARSET": "utf8mb4", "COLLATION": "utf8mb4_unicode_ci"}
elif DB == "sqlite":
    # File-backed: children are other processes and must see the same database.
    default = {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": str(SQLITE_DIR / f"dbworker-{os.environ.get('DBWORKER_TEST_RUN_ID', os.getpid())}.sqlite3"),
        "OPTIONS": {"transaction_mode": "IMMEDIATE", "timeout": 20},
        "TEST": {"NAME": str(SQLITE_DIR / f"dbworker-test-{os.environ.get('DBWORKER_TEST_RUN_ID', os.getpid())}.sqlite3")},
    }
else:
    raise RuntimeError(f"DBWORKER_TEST_DB={DB!r}: use sqlite, postgres or mysql")

# Each test run gets its own test database, so parallel runs (and helpers) never collide.
RUN_ID = os.environ.get("DBWORKER_TEST_RUN_ID", str(os.getpid()))
if DB != "sqlite":
    default.setdefault("TEST", {})["NAME"] = f"test_dbworker_{RUN_ID}"
# Subprocesses started by tests (runworkers) set this to use the test database by name.
if os.environ.get("DBWORKER_TEST_USE_TEST_DB"):
    default["NAME"] = default["TEST"]["NAME"]
DATABASES = {"default": default}
SECRET_KEY = "tests-only"
USE_TZ = True
INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_dbworker",
    "tests.testapp",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
TEMPLATES = [{
    "BACKEND": "django.template.backends.django.DjangoTemplates",
    "DIRS": [],
    "APP_DIRS": True,
    "OPTIONS": {"context_processors": [
        "django.template.context_processors.request",
        "django.contrib.auth.context_processors.auth",
        "django.contrib.messages.context_processors.messages",
    ]},
}]
ROOT_URLCONF = "tests.urls"
STATIC_URL = "/static/"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
# Short leases and polls keep the tests that wait for a lease to expire quick.
DBWORKER: dict[str, object] = {"LEASE_SECONDS": 3, "POLL_SECONDS": 0.05, "MAX_POLL_SECONDS": 0.5}
# The crash tests arm a failpoint in one runworkers process through its environment; the
# package itself reads only the setting (see django_dbworker/processes/failpoints.py).
if os.environ.get("DBWORKER_FAILPOINT"):
    DBWORKER["FAILPOINT"] = os.environ["DBWORKER_FAILPOINT"]
# django.tasks on this app's claims: two backends (aliases), queues with their own options.
TASKS = {
    "default": {
        "BACKEND": "django_dbworker.tasks.DatabaseBackend",
        "QUEUES": ["default", "emails", "retries", "crashes", "capped", "keyed", "fair"],
        "OPTIONS": {
            "CONCURRENCY": 2,
            "QUEUE_OPTIONS": {
                "emails": {"CONCURRENCY": 1, "TIMEOUT": 3},
                "retries": {"CONCURRENCY": 1, "MAX_ATTEMPTS": 3, "RETRY_BACKOFF": 0.01},
                "crashes": {"CONCURRENCY": 1, "MAX_ATTEMPTS": 2, "RETRY_BACKOFF": 1},
                "capped": {"CONCURRENCY": 2, "TOTAL": 1, "RATE": "600/m"},  # test_flow_control, test_rate_limits
                "keyed": {"CONCURRENCY": 2, "PER_KEY": 1},  # tests/test_flow_control.py
                "fair": {"CONCURRENCY": 2, "FAIR": True},  # tests/test_fair_shares.py
            },
        },
    },
    "other": {"BACKEND": "django_dbworker.tasks.DatabaseBackend", "QUEUES": ["default"]},
}
