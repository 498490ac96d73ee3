"""Scale-out: 1, 2, 4 warm `runworkers` processes on PostgreSQL, duplicates checked."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from .common import Cfg, Tree, queue_jobs, reset, runworkers, summarize_drain, wait_for_count


def cpu_times() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine, from /proc/stat (Linux)."""
    try:
        fields = [float(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    except OSError:
        return 0.0, 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def wait_until_idle(trees: list[Tree], timeout: float = 120.0) -> None:
    """Until the started processes (and their children) stop using CPU: set up and idle."""
    deadline = time.monotonic() + timeout
    last = sum(t.cpu_seconds() for t in trees)
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = sum(t.cpu_seconds() for t in trees)
        if all(t.members()[1:] for t in trees) and now - last < 0.05:
            return
        last = now


def scale_out(processes: int, n: int, cfg: Cfg) -> dict[str, Any]:
    """N warm `runworkers` processes (started and idle first, so that start-up is not
    measured), then n jobs inserted in one transaction; PostgreSQL wakes them all."""
    from django_dbworker.models import Execution

    db = "postgres"
    reset(db)
    trees = [runworkers(db, "bench", drain=False, log=cfg.log) for _ in range(processes)]
    try:
        wait_until_idle(trees)
        busy0, total0 = cpu_times()
        t0 = time.monotonic()
        queue_jobs(db, n)
        ok = wait_for_count(db, "dbworker", n, cfg.timeout)
        wall = time.monotonic() - t0
        busy1, total1 = cpu_times()
    finally:
        for t in trees:
            t.stop()
    result = summarize_drain(db, "dbworker", n, wall)
    result.update(processes=processes, completed=ok,
                  machine_cpu_busy_percent=round(100 * (busy1 - busy0) / (total1 - total0), 1)
                  if total1 > total0 else None,
                  finished=Execution.objects.using(db).filter(worker="bench",
                                                              status="finished").count())
    return result
