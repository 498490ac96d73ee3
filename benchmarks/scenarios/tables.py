"""Printing: the tables shown at the end of a run."""

from __future__ import annotations

from typing import Any

from .common import GROUP
from .drain import ENQUEUE_SAMPLES


def fmt(v: Any, suffix: str = "") -> str:
    return "-" if v is None else f"{v:,}{suffix}" if isinstance(v, int) else f"{v:,.1f}{suffix}" \
        if isinstance(v, float) else str(v)


W = 76  # width of the tables' first column


def print_table(report: dict[str, Any]) -> None:
    s, cfg = report["summary"], report["config"]
    print()
    print(f"django-dbworker benchmark {report['date']}  ({report['mode']}, "
          f"{cfg['repeats']} repeat(s), medians)")
    print(f"machine: {report['machine'].get('cpu', '?')}, {report['machine']['cpus']} cpus")
    print()
    for section, show in (("drain", print_drain), ("pickup", print_pickup),
                          ("history", print_history), ("scale_out", print_scale_out),
                          ("memory", print_memory)):
        if s.get(section):  # a partial run (--only) leaves the others out
            show(s[section], cfg)
            print()


def print_drain(rows: dict[str, Any], cfg: dict[str, Any]) -> None:
    print(f"Drain throughput ({cfg['drain_jobs']:,} jobs queued, concurrency 2; 'of ceiling' "
          f"= jobs/s / the same database's no queue, {GROUP} jobs/transaction)")
    print(f"  {'system':<{W}}{'jobs/s':>10}{'of ceiling':>12}{'ran twice':>11}"
          f"{'coord RSS MB':>14}{'child RSS MB':>14}")
    for name, row in rows.items():
        if row.get("not_run"):
            print(f"  {name:<{W}}  {row['not_run']}")
            continue
        share = row.get("of_ceiling")
        print(f"  {name:<{W}}{fmt(row['jobs_per_s']):>10}"
              f"{'-' if share is None else f'{share:.2f}x':>12}{fmt(row['duplicates']):>11}"
              f"{fmt(row.get('coordinator_mb')):>14}{fmt(row.get('child_mb')):>14}")
        if row.get("enqueue_ms_p50") is not None:
            print(f"  {'':<{W}}  enqueue() call p50 {row['enqueue_ms_p50']:.2f} ms, "
                  f"p95 {row['enqueue_ms_p95']:.2f} ms ({ENQUEUE_SAMPLES} calls, "
                  "each its own transaction)")


def print_pickup(rows: dict[str, Any], cfg: dict[str, Any]) -> None:
    print(f"Pickup latency ({cfg['pickup_samples']} single inserts, warm idle workers; "
          "'after idle': one more insert after the idle CPU stretch)")
    print(f"  {'system':<{W}}{'p50 ms':>10}{'p95 ms':>10}{'max ms':>10}{'idle CPU %':>12}"
          f"{'after idle ms':>15}")
    for name, row in rows.items():
        if row.get("not_run"):
            print(f"  {name:<{W}}  {row['not_run']}")
            continue
        print(f"  {name:<{W}}{fmt(row['p50_ms']):>10}{fmt(row['p95_ms']):>10}"
              f"{fmt(row['max_ms']):>10}{fmt(row['idle_cpu_percent']):>12}"
              f"{fmt(row.get('after_idle_ms')):>15}")


def print_history(rows: dict[str, Any], cfg: dict[str, Any]) -> None:
    runs = f", medians of {cfg['history_repeats']}" if cfg.get("history_repeats") else ""
    print(f"History ({cfg['history_new']:,} new rows; {cfg['history_rows']:,} finished rows vs "
          f"none{runs})")
    print(f"  {'database / worker':<38}{'empty j/s':>10}{'history j/s':>13}{'ratio':>8}")
    for name, row in rows.items():
        print(f"  {name:<38}{fmt(row['empty']):>10}{fmt(row['history']):>13}"
              f"{fmt(row['ratio']):>8}")


def print_scale_out(rows: dict[str, Any], cfg: dict[str, Any]) -> None:
    print(f"Scale-out on PostgreSQL ({cfg['scale_jobs']:,} jobs, N warm runworkers, "
          "concurrency 2 each)")
    print(f"  {'processes':<38}{'jobs/s':>10}{'ran twice':>11}{'finished':>10}"
          f"{'CPU busy %':>12}")
    for name, row in rows.items():
        print(f"  {name:<38}{fmt(row['jobs_per_s']):>10}{fmt(row['duplicates']):>11}"
              f"{fmt(row['finished']):>10}{fmt(row.get('cpu_busy_percent')):>12}")


def print_memory(m: dict[str, Any], cfg: dict[str, Any]) -> None:
    print(f"Memory over one drain of {cfg['memory_jobs']:,} jobs on PostgreSQL "
          "(RSS MB, early = 10-20% into the run)")
    print(f"  {'process':<38}{'early':>10}{'end':>10}{'growth':>10}")
    print(f"  {'coordinator':<38}{fmt(m['coordinator_mb_early']):>10}"
          f"{fmt(m['coordinator_mb_end']):>10}{fmt(m['coordinator_growth_mb']):>10}")
    print(f"  {'largest child':<38}{fmt(m['child_mb_early']):>10}"
          f"{fmt(m['child_mb_end']):>10}{fmt(m['child_growth_mb']):>10}")
    print(f"  ({fmt(m['jobs_per_s'])} jobs/s, {m['done']:,} done, {m['duplicates']} ran twice)")
