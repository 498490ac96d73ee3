"""The no-queue ceiling: this process's share of the Job rows (every `--shards`-th one,
from `--shard`), run with no queue at all, `--group` jobs per transaction. Waits until
`--start-at` (time.time()) so that all shards start together, set up and connected."""

from __future__ import annotations

import time
from typing import Any

from django.core.management.base import BaseCommand
from django.db import connection, transaction

from benchapp.job import run_job
from benchapp.models import Job


class Command(BaseCommand):
    help = __doc__

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--group", type=int, default=16)
        parser.add_argument("--shard", type=int, default=0)
        parser.add_argument("--shards", type=int, default=1)
        parser.add_argument("--start-at", type=float, default=0.0)

    def handle(self, *, group: int, shard: int, shards: int, start_at: float,
               **_: Any) -> None:
        pks = list(Job.objects.order_by("pk").values_list("pk", flat=True))[shard::shards]
        connection.ensure_connection()
        late = time.time() - start_at
        if late > 0:
            self.stderr.write(f"bench_noqueue shard {shard}: ready {late:.2f}s after start")
        time.sleep(max(0.0, -late))
        for i in range(0, len(pks), group):
            with transaction.atomic():
                for pk in pks[i:i + group]:
                    run_job("noqueue", pk)
