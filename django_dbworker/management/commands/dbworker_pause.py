"""``manage.py dbworker_pause NAME [--reason TEXT]``: every coordinator stops claiming
the worker's rows (running handlers finish) until ``dbworker_resume NAME``."""

from __future__ import annotations

import getpass
import socket
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_dbworker.pauses import pause
from django_dbworker.registration.registry import UnknownWorker


class Command(BaseCommand):
    help = "Pause a worker: coordinators claim none of its rows until it is resumed."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("worker", metavar="NAME")
        parser.add_argument("--reason", default="", help="Shown on the dashboard.")

    def handle(self, *args: Any, **options: Any) -> None:
        who = f"{getpass.getuser()}@{socket.gethostname()} (manage.py)"
        try:
            done = pause(options["worker"], by=who, reason=options["reason"])
        except UnknownWorker as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"Worker {options['worker']} " + ("paused." if done else "was paused already."))
