"""``manage.py dbworker_status [--json]``: counts per worker and status, the oldest pending
row's age, failures in the last hour, paused workers, live coordinators. The same few
indexed queries as the admin dashboard, whatever the size of the history."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from django_dbworker import conf
from django_dbworker.admin.dashboard import Dashboard, format_age
from django_dbworker.status import ExecutionStatus
from django_dbworker.store import clock


class Command(BaseCommand):
    help = "Show counts per worker and status, oldest pending age, recent failures and coordinators."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--json", action="store_true", help="Print one JSON object.")

    def handle(self, *args: Any, **options: Any) -> None:
        now = clock.now(conf.value("DATABASE"))
        d = Dashboard.collect(conf.value("DATABASE"), now)
        report = {
            "time": now.isoformat(),
            "workers": {w.name: {
                "registered": w.registered,
                "counts": {s.value: w.counts.get(s.value, 0) for s in ExecutionStatus},
                "finished_is_at_least": w.finished_capped,
                "oldest_pending_seconds": None if w.oldest_waiting is None
                else round(w.oldest_waiting.total_seconds(), 1),
                "failed_last_hour": w.failed_last_hour,
                "expired_leases": w.expired_leases,
                "paused": None if w.pause is None else {
                    "by": w.pause.paused_by, "at": w.pause.paused_at.isoformat(),
                    "reason": w.pause.reason},
            } for w in d.workers},
            "coordinators": [{"host": c.host, "pid": c.pid, "workers": c.workers,
                              "started_at": c.started_at.isoformat(),
                              "heartbeat_at": c.heartbeat_at.isoformat(), "live": c.live}
                             for c in d.coordinators],
        }
        if options["json"]:
            self.stdout.write(json.dumps(report, indent=2))
            return
        statuses = [s.value for s in ExecutionStatus]
        header = f"{'worker':<28}" + "".join(f"{s:>11}" for s in statuses)
        self.stdout.write(header + f"{'oldest pending':>16}{'failed 1h':>11}")
        for w in d.workers:
            cells = "".join(f"{w.counts.get(s, 0):>10}{'+' if s == 'finished' and w.finished_capped else ' '}"
                            for s in statuses)
            age = format_age(w.oldest_waiting) if w.oldest_waiting is not None else "-"
            flags = "  (paused)" if w.pause else ("" if w.registered else "  (not registered)")
            self.stdout.write(f"{w.name:<28}{cells}{age:>16}{w.failed_last_hour:>11}{flags}")
        live = [c for c in d.coordinators if c.live]
        self.stdout.write(f"\n{len(live)} live coordinator(s)")
        for c in live:
            self.stdout.write(f"  {c.host}:{c.pid}  since {c.started_at:%Y-%m-%d %H:%M:%S}  "
                              f"{', '.join(c.workers)}")
