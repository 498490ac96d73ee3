#!/usr/bin/env python
"""django-dbworker benchmark, side by side with its peers, in one run.

    python benchmarks/run.py            # full: medians of 3, 5,000-job drains
    python benchmarks/run.py --quick    # fewer jobs, one repeat (a smoke test)
    make bench                          # installs benchmarks/requirements.txt first

Scenarios (see docs/benchmarks.md and benchmarks/README.md for the method): drain
throughput (N jobs queued before the workers start) on PostgreSQL, MariaDB/MySQL and
SQLite, against a no-queue ceiling (the job's own work in 2 plain processes, 16 or 1 jobs
per transaction) on each, and on PostgreSQL the peers: Celery + Redis (CELERY_DB_REUSE_MAX
set), our django.tasks backend, Procrastinate, django-tasks-db (each optional: "not run"
when its package is missing); pickup latency (row committed -> handler starts, warm idle
workers) and idle CPU; history ratio (5,000 new rows with 100,000 finished rows in history
vs none, medians of 5, default ordering and a filtered/ordered eligible()); poison row
(10,000 rows with one whose handler kills its child every time vs none, concurrency 1 and
2, every database, medians of 5 pairs); flow control (a rate of 50/s across 2 coordinators
for 60 s, its busiest 1-second window; the claim's cost with 100,000 rows all throttled by
per_key=1, plain and fair, against 10,000 and against no limit, every database); scale-out
(1, 2, 4 `runworkers` processes on PostgreSQL, duplicates checked); RSS of coordinator and
children.
Prints a table and writes benchmarks/results/<date>[-N][-quick][-partial].json (N: the
day's second, third... run); results live only in these dated files.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from scenarios import drain
from scenarios.common import (
    ALL_DBS,
    DB_NAMES,
    HERE,
    RESULTS,
    ROOT,
    Cfg,
    create_databases,
    ensure_deps,
    migrate,
    run_system,
)
from scenarios.drain import drain_systems, peer_config
from scenarios.flow import RATE, claim_cost, rate_accuracy
from scenarios.history import history
from scenarios.memory import memory
from scenarios.pickup import pickup_systems
from scenarios.poison import poison
from scenarios.scale import scale_out
from scenarios.summary import machine, server_versions, summarize
from scenarios.tables import print_table

SCENARIOS = ("drain", "pickup", "history", "poison", "flow", "scale", "memory")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer jobs, one repeat (< 2 min)")
    parser.add_argument("--repeats", type=int, help="runs per measurement (median)")
    parser.add_argument("--drain-jobs", type=int)
    parser.add_argument("--pickup-samples", type=int)
    parser.add_argument("--idle-seconds", type=float,
                        help="idle stretch after the pickup samples (idle CPU, then one insert)")
    parser.add_argument("--history-rows", type=int)
    parser.add_argument("--history-new", type=int)
    parser.add_argument("--history-repeats", type=int,
                        help="runs of each history pair (median; default 5, quick 1)")
    parser.add_argument("--poison-jobs", type=int,
                        help="rows per poison-scenario drain, the poison row included "
                             "(default 10,000, quick 2,000)")
    parser.add_argument("--poison-repeats", type=int,
                        help="pairs (poison row / none) per database and concurrency "
                             "(median; default 5, quick 1)")
    parser.add_argument("--flow-seconds", type=float,
                        help="seconds the rate-limited worker runs, after its first claim "
                             "(default 60, quick 10)")
    parser.add_argument("--flow-rows", type=int,
                        help="throttled backlog of the claim-cost measurement, also run at "
                             "a tenth of it (default 100,000, quick 10,000)")
    parser.add_argument("--scale-jobs", type=int)
    parser.add_argument("--memory-jobs", type=int)
    parser.add_argument("--databases", default=",".join(ALL_DBS),
                        help="comma-separated subset of postgres,mysql,sqlite")
    parser.add_argument("--only", default=",".join(SCENARIOS),
                        help=f"comma-separated subset of {','.join(SCENARIOS)}")
    parser.add_argument("--systems", default="", metavar="WORDS",
                        help="comma-separated words: run only the drain and pickup systems "
                             "whose label contains one of them (e.g. 'tasks backend,no queue')")
    parser.add_argument("--procrastinate", default="2x1", metavar="WORKERSxCONCURRENCY",
                        help="Procrastinate worker processes x --concurrency of each "
                             "(default 2x1: see docs/benchmarks.md)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds one drain may take before it is stopped")
    cfg = parser.parse_args(namespace=Cfg())
    quick = cfg.quick
    cfg.repeats = cfg.repeats or (1 if quick else 3)
    cfg.drain_jobs = cfg.drain_jobs or (400 if quick else 5000)
    cfg.pickup_samples = cfg.pickup_samples or (25 if quick else 200)
    cfg.idle_seconds = cfg.idle_seconds or (1.0 if quick else 5.0)
    cfg.history_rows = cfg.history_rows or (10_000 if quick else 100_000)
    # 5,000 rows and 5 repeats: a 1,000-row drain lasts a quarter of a second, and its
    # ratio swung by 15 % from one repeat to the next, more than any cost of history.
    cfg.history_new = cfg.history_new or (250 if quick else 5000)
    cfg.history_repeats = cfg.history_repeats or (1 if quick else 5)
    cfg.poison_jobs = cfg.poison_jobs or (2000 if quick else 10_000)
    cfg.poison_repeats = cfg.poison_repeats or (1 if quick else 5)
    cfg.flow_seconds = cfg.flow_seconds or (10.0 if quick else 60.0)
    cfg.flow_rows = cfg.flow_rows or (10_000 if quick else 100_000)
    cfg.scale_jobs = cfg.scale_jobs or (400 if quick else 5000)
    cfg.memory_jobs = cfg.memory_jobs or (5000 if quick else 100_000)
    only = set(cfg.only.split(","))
    # Module globals of scenarios.drain, read there and by scenarios.pickup.
    drain.PROCRASTINATE_WORKERS, drain.PROCRASTINATE_CONCURRENCY = map(int, cfg.procrastinate.split("x"))

    ensure_deps()
    sys.path[:0] = [str(HERE), str(ROOT)]
    os.environ.update(DJANGO_SETTINGS_MODULE="benchproject.settings", BENCH_HARNESS="1",
                      BENCH_DB="postgres")
    import django

    django.setup()
    RESULTS.mkdir(exist_ok=True)
    cfg.log = Path(tempfile.gettempdir()) / "dbworker_bench-last-run.log"
    cfg.log.write_text("")
    started = time.monotonic()
    dbs = [d for d in create_databases() if d in cfg.databases.split(",")]
    for db in dbs:
        migrate(db)
    report: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "mode": "quick" if quick else "full",
        "config": {k: getattr(cfg, k) for k in ("repeats", "drain_jobs", "pickup_samples", "idle_seconds",
                                                 "history_rows", "history_new", "history_repeats",
                                                 "poison_jobs", "poison_repeats",
                                                 "flow_seconds", "flow_rows",
                                                 "scale_jobs", "memory_jobs")},
        "machine": machine(), "servers": server_versions(dbs),
    }
    from django.conf import settings

    report["config"]["dbworker_settings"] = settings.DBWORKER
    report["config"]["peers"] = peer_config()
    raw: dict[str, Any] = {"drain": {}, "not_run": {}, "pickup": {}, "history": {},
                           "poison": {}, "flow": {}, "scale_out": {}, "memory": []}

    def step(label: str) -> None:
        print(f"[{time.monotonic() - started:6.1f}s] {label}", flush=True)

    # Interleaved: each repeat runs every system once, in turn.
    for r in range(cfg.repeats):
        if "drain" in only:
            for db in dbs:
                for system in chosen(drain_systems(db, cfg), cfg.systems):
                    run_system(system, "drain", raw, step, r)
        if "pickup" in only:
            for db in dbs:
                for system in chosen(pickup_systems(db, cfg), cfg.systems):
                    run_system(system, "pickup", raw, step, r)
        if "scale" in only and "postgres" in dbs:
            for n in (1, 2, 4):
                step(f"scale-out x{n} (run {r + 1})")
                raw["scale_out"].setdefault(f"{n} process(es)", []).append(
                    scale_out(n, cfg.scale_jobs, cfg))
    if "history" in only:
        for r in range(cfg.history_repeats):
            for db in dbs if not quick else [d for d in dbs if d == "postgres"] or dbs[:1]:
                for worker in ("bench", "bench_ordered"):
                    label = (f"{DB_NAMES[db]} / "
                             f"{'default order' if worker == 'bench' else 'filter+order_by'}")
                    pair = raw["history"].setdefault(label, {"empty": [], "history": []})
                    arms = [(0, "empty"), (cfg.history_rows, "history")]
                    # Each repeat swaps which arm runs first: a drift of the machine
                    # during the pair (a neighbour, the page cache) then favours neither.
                    for past, key in arms if r % 2 == 0 else arms[::-1]:
                        step(f"history {label}, {past} finished rows (run {r + 1})")
                        pair[key].append(history(db, worker, cfg.history_new, past, cfg))
    if "poison" in only:
        for r in range(cfg.poison_repeats):
            for db in dbs:
                for concurrency in (1, 2):
                    label = f"{DB_NAMES[db]} / concurrency {concurrency}"
                    pair = raw["poison"].setdefault(label, {"clean": [], "poison": []})
                    arms = [(False, "clean"), (True, "poison")]
                    # As for history: the arms swap order from one pair to the next.
                    for poisoned, key in arms if r % 2 == 0 else arms[::-1]:
                        step(f"poison {label}, {'one poison row' if poisoned else 'none'} "
                             f"(run {r + 1})")
                        # The first pair also follows the poison row to FAILED (untimed).
                        result = poison(db, cfg.poison_jobs, concurrency, poisoned, cfg,
                                        follow=r == 0)
                        result["db"] = db
                        pair[key].append(result)
    if "flow" in only:
        # Once per database: a 60-second rate run is its own repeat (every window in it
        # is checked), and each claim-cost figure is the median of 200 claims.
        for db in dbs:
            entry = raw["flow"].setdefault(DB_NAMES[db], {"db": db})
            step(f"flow {DB_NAMES[db]}: rate {RATE} for {cfg.flow_seconds:g} s, 2 coordinators")
            entry["rate"] = rate_accuracy(db, cfg)
            step(f"flow {DB_NAMES[db]}: claim cost, {cfg.flow_rows:,} throttled rows")
            entry["claim_cost"] = claim_cost(db, cfg)
    if "memory" in only and "postgres" in dbs:
        step(f"memory: one drain of {cfg.memory_jobs:,} jobs")
        raw["memory"].append(memory(cfg.memory_jobs, cfg))
    report["summary"] = summarize(raw)
    report["runs"] = raw
    report["elapsed_s"] = round(time.monotonic() - started, 1)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    # Only a complete full run is named by its date alone (report.py shows the newest
    # of those); a run never replaces an earlier one's file.
    partial = (only != set(SCENARIOS)
               or len(dbs) < len(ALL_DBS) or bool(cfg.systems))
    kind = f"{'-quick' if quick else ''}{'-partial' if partial else ''}"
    dated, n = RESULTS / f"{stamp}{kind}.json", 1
    while dated.exists():
        n += 1
        dated = RESULTS / f"{stamp}-{n}{kind}.json"
    dated.write_text(json.dumps(report, indent=2) + "\n")
    print_table(report)
    print(f"elapsed {report['elapsed_s']}s; JSON: {dated}")
    return 0


def chosen(systems: list[Any], words: str) -> list[Any]:
    """The systems whose label holds one of the comma-separated words (all when none)."""
    wanted = [w.strip().lower() for w in words.split(",") if w.strip()]
    return [s for s in systems if not wanted or any(w in s.label.lower() for w in wanted)]


if __name__ == "__main__":
    sys.exit(main())
