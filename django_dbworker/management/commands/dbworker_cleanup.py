"""``manage.py dbworker_cleanup [--dry-run]``: delete the executions of workers that are no
longer registered (a removed worker's rows would otherwise stay pending for ever)."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser
from django.db.models import Count

from django_dbworker import conf
from django_dbworker.models import Execution
from django_dbworker.registry import registry


class Command(BaseCommand):
    help = "Delete executions of workers that are no longer registered."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--dry-run", action="store_true", help="Only say what would go.")

    def handle(self, *args: Any, **options: Any) -> None:
        # Not rows a coordinator still holds (one running code from before the change).
        leftovers = (Execution.objects.using(conf.value("DATABASE"))
                     .exclude(worker__in=list(registry)).exclude(status="working"))
        counts = dict(leftovers.values_list("worker").annotate(n=Count("*")).order_by("worker"))
        if not counts:
            self.stdout.write("Nothing to clean up: every execution belongs to a registered worker.")
            return
        for name, n in counts.items():
            verb = "would delete" if options["dry_run"] else "deleting"
            self.stdout.write(f"{verb} {n} execution(s) of worker {name} (not registered)")
        if not options["dry_run"]:
            leftovers.delete()
