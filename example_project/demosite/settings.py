"""Settings of the example project.

SQLite in a file next to this project by default (``example_project/db.sqlite3``).
``DBWORKER_DEMO_DATABASE_URL=postgresql://user@host:5432/name`` switches to PostgreSQL;
``DBWORKER_DEMO_SQLITE_PATH`` moves the SQLite file (the tests use a temporary one).
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import unquote, urlsplit

BASE_DIR = Path(__file__).resolve().parent.parent

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "example-project-not-for-production")
DEBUG = True
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]


def database_from_url(url: str) -> dict[str, object]:
    parts = urlsplit(url)
    if parts.scheme not in ("postgres", "postgresql"):
        raise ValueError(
            f"DBWORKER_DEMO_DATABASE_URL={url!r}: use postgresql://user:password@host:port/name"
        )
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": parts.path.lstrip("/"),
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": parts.hostname or "",
        "PORT": str(parts.port or ""),
    }


if os.environ.get("DBWORKER_DEMO_DATABASE_URL"):
    DATABASES = {"default": database_from_url(os.environ["DBWORKER_DEMO_DATABASE_URL"])}
else:
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            # A file, not :memory: -- the workers' child processes open it too.
            "NAME": os.environ.get("DBWORKER_DEMO_SQLITE_PATH", str(BASE_DIR / "db.sqlite3")),
            # BEGIN IMMEDIATE: a request that reads and then writes waits for the write
            # lock instead of failing with "database is locked" while a handler commits.
            "OPTIONS": {"transaction_mode": "IMMEDIATE", "timeout": 20},
        }
    }

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_dbworker",
    "uploads",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "demosite.urls"
WSGI_APPLICATION = "demosite.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True  # django-dbworker requires it (system check django_dbworker.E010)
TIME_ZONE = "UTC"
STATIC_URL = "static/"

# Every key is optional; these are the defaults, spelled out for the reader.
DBWORKER = {
    "LEASE_SECONDS": 30,
    "POLL_SECONDS": 0.25,
    "MAX_POLL_SECONDS": 10,
}

# How long each step of the "analyze" handler pretends to work. demo.py sets it for the
# live part so that the list page shows rows moving through their statuses.
DEMO_STEP_SECONDS = float(os.environ.get("DEMO_STEP_SECONDS", "0"))

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"short": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "short"}},
    "loggers": {"django_dbworker": {"handlers": ["console"], "level": "INFO"}},
}
