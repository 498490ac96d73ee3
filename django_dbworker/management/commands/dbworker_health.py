"""``manage.py dbworker_health``: an exec probe. Exits 0 when healthy, 1 (one line per
problem) when a worker has no live coordinator, or its oldest pending row is older than
``--max-pending-age``."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_dbworker import conf
from django_dbworker.admin.dashboard import Dashboard, format_age
from django_dbworker.registration.registry import registry
from django_dbworker.store import clock


class Command(BaseCommand):
    help = ("Exit non-zero when a worker has no live coordinator, or pending rows wait "
            "longer than --max-pending-age.")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--worker", action="append", dest="workers", metavar="NAME",
                            help="Check only this worker (repeatable). Default: all registered.")
        parser.add_argument("--max-pending-age", type=float, metavar="SECONDS",
                            help="Unhealthy when a claimable row has waited longer than this.")

    def handle(self, *args: Any, **options: Any) -> None:
        names = [registry[n].name for n in options["workers"]] if options["workers"] else list(registry)
        database = conf.value("DATABASE")
        d = Dashboard.collect(database, clock.now(database))
        served = {w for c in d.coordinators if c.live for w in c.workers}
        by_name = {w.name: w for w in d.workers}
        problems = []
        for name in names:
            w = by_name.get(name)
            if name not in served:
                problems.append(f"worker {name}: no live coordinator runs it")
            limit = options["max_pending_age"]
            if w is not None and limit is not None and w.oldest_waiting is not None and (
                    w.oldest_waiting.total_seconds() > limit):
                problems.append(f"worker {name}: the oldest pending row has waited "
                                f"{format_age(w.oldest_waiting)} (over {limit:g}s)")
        if problems:
            raise CommandError("unhealthy: " + "; ".join(problems))
        self.stdout.write(f"healthy: {len(names)} worker(s) served by "
                          f"{sum(c.live for c in d.coordinators)} live coordinator(s)")
