"""Printing: the tables shown at the end of a run."""

from __future__ import annotations

from typing import Any

from .common import GROUP
from .drain import ENQUEUE_SAMPLES
from .flow import KEYS, RATE


def fmt(v: Any, suffix: str = "") -> str:
    return "-" if v is None else f"{v:,}{suffix}" if isinstance(v, int) else f"{v:,.1f}{suffix}" \
        if isinstance(v, float) else str(v)


def two(v: float | None) -> str:
    """A ratio, to two decimals (fmt gives one)."""
    return "-" if v is None else f"{v:.2f}"


W = 76  # width of the tables' first column


def print_table(report: dict[str, Any]) -> None:
    s, cfg = report["summary"], report["config"]
    print()
    print(f"django-dbworker benchmark {report['date']}  ({report['mode']}, "
          f"{cfg['repeats']} repeat(s), medians)")
    print(f"machine: {report['machine'].get('cpu', '?')}, {report['machine']['cpus']} cpus")
    print()
    for section, show in (("drain", print_drain), ("pickup", print_pickup),
                          ("history", print_history), ("poison", print_poison),
                          ("flow", print_flow), ("scale_out", print_scale_out),
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


def poison_row_words(row: dict[str, Any]) -> tuple[str, str]:
    """The poison row when --drain exited (over the repeats), and after the follow-up run."""
    seen = row["poison_row_at_drain_end"]
    statuses = sorted({x["status"] for x in seen})
    crashes = sorted({x["crashes"] for x in seen})
    span = f"{crashes[0]}" if len(crashes) == 1 else f"{crashes[0]}-{crashes[-1]}"
    at_end = f"{'/'.join(statuses)}, {span} crash(es)" if seen else "-"
    after = row.get("poison_row_after")
    then = (f"{after['status']} after {after['crashes']} crashes" if after
            else "failed already" if statuses == ["failed"] else "-")
    return at_end, then


def print_poison(rows: dict[str, Any], cfg: dict[str, Any]) -> None:
    print(f"Poison row ({cfg['poison_jobs']:,} rows drained, the first one killing its child "
          f"every time vs none; medians of {cfg['poison_repeats']} pairs; the other rows' "
          "jobs/s, seconds until they all finished, longest pause between handler starts)")
    print(f"  {'database / concurrency':<30}{'clean j/s':>10}{'poison j/s':>11}{'ratio':>7}"
          f"{'pairs':>7}{'clean s':>9}{'poison s':>10}{'ratio':>7}{'1st start s':>13}"
          f"{'pause ms':>11}"
          f"  {'poison row at drain end':<28}then")
    for name, row in rows.items():
        at_end, then = poison_row_words(row)
        pause = (f"{fmt(ms(row.get('clean_longest_gap_s')))}/"
                 f"{fmt(ms(row.get('poison_longest_gap_s')))}")
        first = (f"{fmt(row.get('clean_first_start_s'))}/"
                 f"{fmt(row.get('poison_first_start_s'))}")
        print(f"  {name:<30}{fmt(row['clean_jobs_per_s']):>10}{fmt(row['poison_jobs_per_s']):>11}"
              f"{two(row['ratio']):>7}{two(row.get('pair_ratio_median')):>7}"
              f"{fmt(row['clean_done_s']):>9}{fmt(row['poison_done_s']):>10}"
              f"{two(row['done_s_ratio']):>7}{first:>13}{pause:>11}  {at_end:<28}{then}")
        if row["others_not_finished"] or row["duplicates"]:
            print(f"  {'':<30}  {row['others_not_finished']} other rows not finished, "
                  f"{row['duplicates']} ran twice")
    print("  (ratio: of the medians; pairs: median of each pair's ratio, the arms of a pair run "
          "one after the other; s ratio: poison / clean seconds, above 1 = slower;\n"
          "   1st start s, pause ms: the first other row's handler start after runworkers' "
          "start, the longest wait between two handler starts, clean/poison)")


def print_flow(rows: dict[str, Any], cfg: dict[str, Any]) -> None:
    print(f"Flow control: rate \"{RATE}\" across 2 runworkers for {cfg['flow_seconds']:g} s "
          "(claim times: each claim's Execution.started_at, the database's clock; rows/s = rows / first "
          "to last claim; busiest = most rows claimed in any window [t, t+1 s))")
    print(f"  {'database':<16}{'claimed':>9}{'rows/s':>9}{'of limit':>10}{'busiest 1 s':>13}"
          f"{'within limit':>14}{'longest pause s':>17}{'coordinators':>14}{'ran twice':>11}")
    for name, row in rows.items():
        r = row["rate"]
        within = "yes" if r["within_limit"] else "NO: EXCEEDED" if r["claimed"] else "no claims"
        print(f"  {name:<16}{fmt(r['claimed']):>9}{fmt(r['achieved_per_s']):>9}"
              f"{two(r['of_limit']):>10}{fmt(r['busiest_window']):>13}{within:>14}"
              f"{two(r['longest_pause_s']):>17}{r['coordinators_claiming']:>14}"
              f"{fmt(r['ran_twice']):>11}")
        if any(code is not None for code in r["exit_codes_before_stop"]):
            print(f"  {'':<16}  a coordinator exited early: {r['exit_codes_before_stop']}")
    cost = next(iter(rows.values()))["claim_cost"]
    print()
    print(f"Flow control: claim cost, {cost['claims']} claims of {cost['claim_limit']} rows in "
          f"one process (ms per claim); {cost['keys']:,} keys each with one WORKING row, so "
          "every claimable row of a limited worker is throttled and its claims take none")
    print(f"  {'database / worker':<36}{'rows':>9}{'claimable':>11}{'p50 ms':>9}{'p95 ms':>9}"
          f"{'taken':>8}{'p50 vs smaller':>16}")
    for name, row in rows.items():
        for a in row["claim_cost"]["arms"]:
            held = "" if a.get("held_keys", KEYS) == KEYS else \
                f"  (only {a['held_keys']} keys held: not all throttled)"
            print(f"  {name + ' / ' + a['limits']:<36}{fmt(a['rows']):>9}"
                  f"{fmt(a['claimable']):>11}{a['p50_ms']:>9.2f}{a['p95_ms']:>9.2f}"
                  f"{fmt(a['taken']):>8}{two(a.get('p50_vs_smaller')):>16}{held}")


def ms(seconds: float | None) -> int | None:
    return None if seconds is None else round(seconds * 1000)


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
