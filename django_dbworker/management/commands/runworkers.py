"""``manage.py runworkers``: parses arguments, hands over to a Coordinator."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_dbworker.coordinator.loop import Coordinator
from django_dbworker.registration.options import METRICS_HOST, WAIT_FOR_DATABASE_SECONDS
from django_dbworker.registration.registry import UnknownWorker
from django_dbworker.vendors import UnsupportedDatabase

LEVELS = {0: logging.WARNING, 1: logging.INFO, 2: logging.DEBUG, 3: logging.DEBUG}


def concurrency_pair(text: str) -> tuple[str, int]:
    name, sep, number = text.partition("=")
    if not name or not sep or not number.isdigit() or int(number) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: use NAME=N with a worker name and N >= 1, e.g. ocr=4")
    return name, int(number)


def selected(workers: list[str] | None, queues: list[str] | None) -> list[str] | None:
    """The worker names to run: --worker names plus the workers of --queue queues."""
    if not queues:
        return workers
    from django_dbworker.tasks.queues import queue_workers

    found = queue_workers(queues)
    unknown = sorted(set(queues) - {w.queue for w in found})
    if unknown:
        known = sorted({w.queue for w in queue_workers()}) or ["none"]
        raise ImproperlyConfigured(
            f"No task queue named {', '.join(map(repr, unknown))}. Queues of "
            f"django_dbworker.tasks.DatabaseBackend in TASKS: {', '.join(known)}.")
    return [*(workers or []), *(w.name for w in found)]


class Command(BaseCommand):
    help = "Claim and run background work for the registered workers until stopped."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--worker", action="append", dest="workers", metavar="NAME",
                            help="Run only this worker (repeatable). Default: all registered.")
        parser.add_argument("--queue", action="append", dest="queues", metavar="NAME",
                            help="Run this task queue (repeatable), next to the --worker ones; "
                                 "with only --queue, run no row workers. Default: everything.")
        parser.add_argument("--concurrency", action="append", default=[], metavar="NAME=N",
                            type=concurrency_pair,
                            help="Override a worker's concurrency, e.g. --concurrency ocr=4.")
        parser.add_argument("--drain", action="store_true",
                            help="Exit once this process's handlers are done and nothing is "
                                 "claimable.")
        parser.add_argument("--shutdown-timeout", type=float, default=None, metavar="SECONDS",
                            help="After a first SIGTERM/SIGINT, wait this long for running "
                                 "handlers before terminating them (default: wait).")
        parser.add_argument("--status-interval", type=float, default=60.0, metavar="SECONDS",
                            help="Log a status line this often (default 60).")
        parser.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                            help="Serve Prometheus /metrics, /healthz and /readyz on this port.")
        parser.add_argument("--metrics-host", default=METRICS_HOST, metavar="ADDRESS",
                            help=f"The address --metrics-port listens on (default {METRICS_HOST}: "
                                 "every interface, for Prometheus and Kubernetes probes from "
                                 "outside; the endpoints are read-only and unauthenticated, "
                                 "so use 127.0.0.1 when only this machine scrapes).")
        parser.add_argument("--no-schedules", action="store_false", dest="schedules",
                            help="Enqueue no schedule's slots here (run schedules on other "
                                 "machines only). Any number of coordinators may enqueue them: "
                                 "each slot is enqueued once.")
        parser.add_argument("--wait-for-database", type=float, default=WAIT_FOR_DATABASE_SECONDS,
                            metavar="SECONDS",
                            help="At start, wait this long for a database that does not "
                                 f"answer yet (default {WAIT_FOR_DATABASE_SECONDS:.0f}; 0: "
                                 "do not wait).")

    def execute(self, *args: Any, **options: Any) -> Any:
        # Django's system checks (run before handle) connect to the database: wait for it
        # first, so a database that starts after the workers is waited for, in one line
        # per attempt, instead of ending in a traceback.
        from django.db import connections

        from django_dbworker import conf
        from django_dbworker.coordinator.outage import wait_for_database
        from django_dbworker.vendors import for_connection

        self._configure_logging(options.get("verbosity", 1))
        alias = conf.value("DATABASE")
        try:
            if alias in connections:
                for_connection(connections[alias])  # an unsupported one: the checks say so
                wait_for_database(alias, options.get("wait_for_database") or 0.0)
        except UnsupportedDatabase:
            pass
        except ImproperlyConfigured as exc:
            raise CommandError(str(exc)) from None
        return super().execute(*args, **options)

    def handle(self, *args: Any, **options: Any) -> None:
        self._configure_logging(options["verbosity"])
        try:
            coordinator = Coordinator(
                selected(options["workers"], options["queues"]),
                concurrency=dict(options["concurrency"]),
                shutdown_timeout=options["shutdown_timeout"],
                status_interval=options["status_interval"],
                wait_for_database=options["wait_for_database"],
                schedules=options["schedules"],
                metrics_port=options["metrics_port"],
                metrics_host=options["metrics_host"],
            )
            if options["drain"]:
                with self._signals(coordinator):
                    stats = coordinator.drain()
                self.stdout.write(f"Drained: {coordinator.stats_line()}")
                if stats["lost"] or stats["crashed"]:
                    self.stderr.write("Some claims were lost or children crashed; see the log.")
            else:
                with self._signals(coordinator):
                    coordinator.run()
        except (ImproperlyConfigured, UnknownWorker, UnsupportedDatabase) as exc:
            raise CommandError(str(exc)) from None

    def _configure_logging(self, verbosity: int) -> None:
        logger = logging.getLogger("django_dbworker")
        logger.setLevel(LEVELS.get(verbosity, logging.DEBUG))
        if not logger.handlers and not logging.getLogger().handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
            logger.addHandler(handler)

    class _signals:
        """First SIGTERM/SIGINT: graceful stop; second: terminate. Restores the previous
        handlers on exit."""

        def __init__(self, coordinator: Coordinator) -> None:
            self.coordinator = coordinator
            self.previous: dict[int, Any] = {}

        def __enter__(self) -> None:
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.previous[sig] = signal.signal(sig, self._handle)

        def _handle(self, signum: int, frame: Any) -> None:
            logging.getLogger("django_dbworker.coordinator").warning(
                "Received %s%s", signal.Signals(signum).name,
                ": terminating handlers" if self.coordinator.stopping else
                ": finishing running handlers (send again to terminate them)")
            self.coordinator.request_stop()

        def __exit__(self, *exc: Any) -> None:
            for sig, handler in self.previous.items():
                signal.signal(sig, handler)
