"""``manage.py dbworker_resume NAME``: coordinators claim the worker's rows again."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_dbworker.pauses import resume
from django_dbworker.registration.registry import UnknownWorker


class Command(BaseCommand):
    help = "Resume a paused worker."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("worker", metavar="NAME")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            done = resume(options["worker"])
        except UnknownWorker as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"Worker {options['worker']} " + ("resumed." if done else "was not paused."))
