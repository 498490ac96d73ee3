"""The ``DBWORKER`` settings dict, with its defaults in one place.

Read through :func:`get`, cached and cleared on ``setting_changed`` so that
``override_settings(DBWORKER=...)`` works in tests.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from django.conf import settings
from django.core.signals import setting_changed
from django.dispatch import receiver

DEFAULTS: dict[str, Any] = {
    "DATABASE": "default",
    "LEASE_SECONDS": 30.0,
    "POLL_SECONDS": 0.25,
    "MAX_POLL_SECONDS": 10.0,
    # Where the database cannot notify (MySQL/MariaDB, SQLite, PostgreSQL behind PgBouncer)
    # an idle coordinator asks this often whether rows were inserted (one cheap query).
    "PROBE_SECONDS": 0.02,
    "WORKER_MODULES": None,  # None: autodiscover `workers` in every installed app
    "ENGINE_OPTIONS": {},
    "LISTEN_DATABASE": None,  # alias for LISTEN (None: DATABASE); see docs/deployment.md
    "IDENTITY": None,  # None: the host name (claimed_by and heartbeats say host:pid)
    "SCHEDULES": {},  # name -> {"task": path, "cron" or "every", "args", "kwargs", "catch_up"}
    "FAILPOINT": None,  # crash tests only (see failpoints.py); never set in production
}


@cache
def get() -> dict[str, Any]:
    user = getattr(settings, "DBWORKER", None) or {}
    return {**DEFAULTS, **user} if isinstance(user, dict) else dict(DEFAULTS)


def value(key: str) -> Any:
    return get()[key]


@receiver(setting_changed)
def _clear(*, setting: str, **kwargs: Any) -> None:
    if setting == "DBWORKER":
        get.cache_clear()
