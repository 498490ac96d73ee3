"""``manage.py prune_tasks``: delete finished and failed task rows older than an age."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction

from django_dbworker import conf
from django_dbworker.status import ExecutionStatus
from django_dbworker.store import clock


class Command(BaseCommand):
    help = ("Delete tasks (django_dbworker.tasks.DatabaseBackend) that finished or failed "
            "more than --older-than DAYS ago, with their executions.")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--older-than", type=float, required=True, metavar="DAYS",
                            help="Age in days (fractions allowed) of the tasks to delete.")
        parser.add_argument("--status", choices=["finished", "failed", "both"], default="both",
                            help="Which ended tasks to delete (default both).")
        parser.add_argument("--queue", action="append", dest="queues", metavar="NAME",
                            help="Only tasks of this queue (repeatable).")
        parser.add_argument("--dry-run", action="store_true",
                            help="Say how many would be deleted, delete nothing.")

    def handle(self, *args: Any, **options: Any) -> None:
        from django_dbworker.models import Execution, Task, TaskUniqueKey

        if options["older_than"] < 0:
            raise CommandError("--older-than must be a number of days >= 0, e.g. 30")
        statuses = {"finished": [ExecutionStatus.FINISHED], "failed": [ExecutionStatus.FAILED],
                    "both": [ExecutionStatus.FINISHED, ExecutionStatus.FAILED]}[options["status"]]
        database = conf.value("DATABASE")
        cutoff = clock.now(database) - timedelta(days=options["older_than"])
        # Ended tasks only: a READY or RUNNING task is never pruned, however old.
        ended = Execution.objects.using(database).filter(
            worker__startswith="tasks.", status__in=statuses, finished_at__lt=cutoff)
        tasks = Task.objects.using(database).filter(finished_at__lt=cutoff)
        if options["queues"]:
            tasks = tasks.filter(queue_name__in=options["queues"])
        ids = list(ended.values_list("source_id", flat=True))
        total = 0
        # Keys are read, then deleted in batches: the delete trigger removes each task's
        # execution with it, and the unique keys the tasks held go too (nothing is left
        # dangling). A key an enqueue has just moved to a new task is not the pruned
        # task's any more, and stays.
        for i in range(0, len(ids), 500):
            batch = tasks.filter(pk__in=ids[i:i + 500])
            if options["dry_run"]:
                total += batch.count()
                continue
            with transaction.atomic(using=database):
                pks = list(batch.values_list("pk", flat=True))
                total += batch.delete()[0]
                TaskUniqueKey.objects.using(database).filter(task_id__in=pks).delete()
        verb = "Would delete" if options["dry_run"] else "Deleted"
        self.stdout.write(f"{verb} {total} task(s) that ended before {cutoff:%Y-%m-%d %H:%M} UTC.")
