"""What must hold before a coordinator claims anything; each failure names its fix."""

from __future__ import annotations

from collections.abc import Sequence

from django.core.exceptions import ImproperlyConfigured
from django.db import connections

from ..registration.registry import Worker
from ..vendors import for_connection
from .triggers import missing_triggers


def check_can_start(database: str, workers: Sequence[Worker]) -> None:
    """Raise ImproperlyConfigured, with the fix, if ``workers`` cannot run on ``database``."""
    for_connection(connections[database]).check_supported()
    for w in workers:
        if w.handler.__module__ == "__main__":
            raise ImproperlyConfigured(
                f"Worker {w.name!r}: handler {w.handler.__qualname__} lives in __main__, "
                "which children cannot import; move it into a module (e.g. workers.py)."
            )
    missing = missing_triggers(database, workers)
    if missing:
        raise ImproperlyConfigured(
            f"Triggers missing for worker(s) {', '.join(missing)}: run "
            "`python manage.py migrate` (it installs the triggers of every registered "
            "worker), then start runworkers again."
        )
