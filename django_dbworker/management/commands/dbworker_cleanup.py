"""``manage.py dbworker_cleanup``: delete what is left of workers that are gone.

A worker that is no longer registered leaves its executions behind: pending rows that no
coordinator will ever claim, and its history. The command says what it will do first,
worker by worker, then asks (``--no-input`` for scripts, ``--dry-run`` to only say it).

What it never does:

- touch a worker that a live coordinator serves, even if this process's settings do not
  know it (a settings file that differs between two processes must not cost work);
- delete finished or failed executions unless ``--include-history`` says so: were the
  worker registered again, ``migrate`` would make their rows pending and run them again;
- delete a WORKING row (a coordinator running older code holds it).

A gone worker's flow-control rows (``FlowLock``, ``RateLog``) go with its executions, or
alone when it has none left, unless a live coordinator serves it or one of its rows is
WORKING.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connections
from django.db.models import Count

from django_dbworker import conf
from django_dbworker.models import CoordinatorHeartbeat, Execution
from django_dbworker.registration.registry import registry
from django_dbworker.status import ExecutionStatus
from django_dbworker.vendors import for_connection

# Deleted unless a live coordinator serves the worker: rows that only wait for a claim.
WAITING = [ExecutionStatus.PENDING.value, ExecutionStatus.UNFINISHED.value]
# Deleted with --include-history only.
HISTORY = [ExecutionStatus.FINISHED.value, ExecutionStatus.FAILED.value]


class Command(BaseCommand):
    help = ("Delete executions of workers that are no longer registered (and that no live "
            "coordinator serves): say what, then ask.")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--dry-run", action="store_true",
                            help="Only say what would be deleted.")
        parser.add_argument("--include-history", action="store_true",
                            help="Delete finished and failed executions too. If the worker is "
                                 "registered again later, migrate makes those rows pending "
                                 "and they run again.")
        parser.add_argument("--no-input", "--noinput", action="store_false", dest="interactive",
                            help="Do not ask for confirmation.")

    def handle(self, *args: Any, **options: Any) -> None:
        database = conf.value("DATABASE")
        executions = Execution.objects.using(database)
        counts: dict[str, dict[str, int]] = {}
        for worker, status, n in (executions.exclude(worker__in=list(registry))
                                  .values_list("worker", "status").annotate(n=Count("*"))
                                  .order_by("worker", "status")):
            counts.setdefault(worker, {})[status] = n
        flow = flow_rows(database)
        if not counts and not flow:
            self.stdout.write("Nothing to clean up: every execution belongs to a registered "
                              "worker.")
            return
        served = live_coordinators(database)
        flow_plan = self._flow_plan(flow, counts, served)
        if not counts:
            self._delete_flow(database, flow_plan, options)
            return
        statuses = WAITING + (HISTORY if options["include_history"] else [])
        plan: dict[str, int] = {}
        for worker, by_status in counts.items():
            listed = ", ".join(f"{n} {status}" for status, n in sorted(by_status.items()))
            if worker in served:
                self.stdout.write(f"worker {worker} ({listed}): not registered here, but live "
                                  f"coordinator(s) {', '.join(served[worker])} run it: "
                                  "left alone.")
                continue
            doomed = sum(n for status, n in by_status.items() if status in statuses)
            kept = {s: n for s, n in by_status.items() if s not in statuses}
            line = f"worker {worker} ({listed}): deletes {doomed}"
            if kept:
                line += "; keeps " + ", ".join(f"{n} {s}" for s, n in sorted(kept.items()))
                if any(s in HISTORY for s in kept):
                    line += " (history: --include-history deletes it)"
            self.stdout.write(line + ".")
            if doomed:
                plan[worker] = doomed
        if not plan:
            if flow_plan:
                self._delete_flow(database, flow_plan, options)
            else:
                self.stdout.write("Nothing to delete.")
            return
        total = sum(plan.values())
        if options["dry_run"]:
            self.stdout.write(f"Dry run: would delete {total} execution(s); nothing changed.")
            return
        if options["interactive"] and not _confirmed(total):
            raise CommandError("Cleanup cancelled: nothing deleted.")
        # Each worker again, with the statuses in the statement: a row that changed status
        # since the count (a coordinator claimed it) is left alone; and the coordinators
        # again, after the question: one may have started meanwhile.
        served = live_coordinators(database)
        deleted = 0
        for worker in plan:
            if worker in served:
                self.stdout.write(f"worker {worker}: a coordinator started running it "
                                  f"({', '.join(served[worker])}): left alone.")
                continue
            deleted += executions.filter(worker=worker, status__in=statuses).delete()[0]
        self.stdout.write(f"Deleted {deleted} execution(s).")
        self._delete_flow(database, flow_plan, {**options, "interactive": False})

    def _flow_plan(self, flow: dict[str, int], counts: dict[str, dict[str, int]],
                   served: dict[str, list[str]]) -> list[str]:
        """The gone workers whose flow-control rows (FlowLock, RateLog) go: not served by a
        live coordinator, and none of their rows WORKING (an older coordinator that still
        claims them would count under those locks)."""
        doomed = []
        for worker, n in sorted(flow.items()):
            if worker in served or counts.get(worker, {}).get(ExecutionStatus.WORKING.value):
                self.stdout.write(f"worker {worker}: keeps its {n} flow-control row(s) (a "
                                  "coordinator may still claim its rows).")
                continue
            self.stdout.write(f"worker {worker}: deletes its {n} flow-control row(s) "
                              "(FlowLock, RateLog).")
            doomed.append(worker)
        return doomed

    def _delete_flow(self, database: str, workers: list[str], options: dict[str, Any]) -> None:
        from django_dbworker.models import FlowLock, RateLog

        if not workers:
            return
        if options["dry_run"]:
            self.stdout.write("Dry run: nothing changed.")
            return
        if options["interactive"] and not _confirmed_flow(len(workers)):
            raise CommandError("Cleanup cancelled: nothing deleted.")
        deleted = sum(model.objects.using(database).filter(worker__in=workers).delete()[0]
                      for model in (FlowLock, RateLog))
        self.stdout.write(f"Deleted {deleted} flow-control row(s).")


def flow_rows(database: str) -> dict[str, int]:
    """Unregistered workers with flow-control rows (FlowLock, RateLog): how many each."""
    from django_dbworker.models import FlowLock, RateLog

    found: dict[str, int] = {}
    for model in (FlowLock, RateLog):
        for worker, n in (model.objects.using(database).exclude(worker__in=list(registry))
                          .values_list("worker").annotate(n=Count("*")).order_by()):
            found[worker] = found.get(worker, 0) + n
    return found


def live_coordinators(database: str) -> dict[str, list[str]]:
    """Worker name -> the live coordinators (host:pid) that run it, judged on the
    database's clock (heartbeats are written with it)."""
    now = for_connection(connections[database]).current_time()
    since = now - timedelta(seconds=float(conf.value("LEASE_SECONDS")))
    served: dict[str, list[str]] = {}
    for c in CoordinatorHeartbeat.objects.using(database).filter(heartbeat_at__gte=since):
        for name in filter(None, c.workers.split(",")):
            served.setdefault(name, []).append(f"{c.host}:{c.pid}")
    return served


def _confirmed_flow(workers: int) -> bool:
    try:
        answer = input(f"Delete the flow-control rows of {workers} worker(s)? Type 'yes' to "
                       "continue: ")
    except (EOFError, OSError):  # no terminal: nobody said yes
        return False
    return answer.strip().lower() == "yes"


def _confirmed(total: int) -> bool:
    try:
        answer = input(f"Delete {total} execution(s)? Type 'yes' to continue: ")
    except (EOFError, OSError):  # no terminal (or stdin captured): nobody said yes
        return False
    return answer.strip().lower() == "yes"
