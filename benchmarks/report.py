#!/usr/bin/env python
"""Markdown tables from a benchmark JSON (default: the newest full run in results/).

    python benchmarks/report.py                 # print them
    python benchmarks/report.py --write         # replace the results block in docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DOC = HERE.parent / "docs" / "benchmarks.md"
START, END = "<!-- results:start -->", "<!-- results:end -->"


FULL_RUN = re.compile(r"^(\d{4}-\d{2}-\d{2})(?:-(\d+))?\.json$")  # not -quick, -partial


def newest_full_run(results: Path) -> Path:
    """The newest complete full run: results/<date>[-N].json with the latest date and N."""
    runs = [(m[1], int(m[2] or 1), p) for p in results.glob("*.json")
            if (m := FULL_RUN.match(p.name))]
    if not runs:
        raise SystemExit(f"No full run in {results}: run `make bench` first.")
    return max(runs)[2]


def num(v: Any, digits: int = 0) -> str:
    if v is None:
        return "-"
    return f"{v:,.{digits}f}"


def mb(v: Any) -> str:
    return "-" if v is None else f"{v:,.0f} MB"


def peers(cfg: dict[str, Any]) -> list[str]:
    """How each system was run (config.peers of the JSON), as a list."""
    how = cfg.get("peers") or {}
    return [*(f"- {name}: {text}" for name, text in how.items()), ""] if how else []


def tables(report: dict[str, Any], source: str) -> str:
    s, cfg = report["summary"], report["config"]
    out = [f"Run of {report['date']}, `{report['mode']}` mode, medians of {cfg['repeats']} "
           f"(JSON: `{source}`).", "", machine_line(report), ""]
    if cfg.get("peers"):
        out += ["How each system ran:", "", *peers(cfg)]
    for section, table in (("drain", drain_table), ("pickup", pickup_table),
                           ("history", history_table), ("poison", poison_table),
                           ("scale_out", scale_table),
                           ("memory", memory_table)):
        if s.get(section):  # a partial run (--only) has only some
            out += [*table(s[section], cfg), ""]
    return "\n".join(out).rstrip("\n") + "\n"


def machine_line(report: dict[str, Any]) -> str:
    m, servers = report["machine"], report.get("servers", {})
    autovacuum = (f" (autovacuum {servers['postgres_autovacuum']})"
                  if "postgres_autovacuum" in servers else "")
    return (
        f"Machine: {m.get('cpus')} vCPU {m.get('cpu', '')}, {m.get('mem_gb')} GB, "
        f"Python {m.get('python')}, Django {m.get('django')}, "
        f"PostgreSQL {servers.get('postgres', '?').split(' on ')[0].replace('PostgreSQL ', '')}"
        f"{autovacuum}, "
        f"MariaDB {servers.get('mysql', '?').split('-')[0]}, SQLite {servers.get('sqlite', '?')}, "
        f"Celery {m.get('celery', '-')}, Procrastinate {m.get('procrastinate', '-')}, "
        f"django-tasks-db {m.get('django-tasks-db', '-')}; load average at start "
        f"{', '.join(f'{x:.1f}' for x in m.get('loadavg_at_start', []))}.")


def drain_table(rows: dict[str, Any], cfg: dict[str, Any]) -> list[str]:
    out = [f"**Drain** ({cfg['drain_jobs']:,} jobs queued before the workers start, "
           "concurrency 2; *of ceiling*: jobs/s as a fraction of the same database's "
           "*no queue, 16 jobs/transaction* row)", "",
           "| system | jobs/s | of ceiling | runs | ran twice | coordinator RSS | child RSS |",
           "|---|---:|---:|---|---:|---:|---:|"]
    for name, row in rows.items():
        if row.get("not_run"):
            out.append(f"| {name} | {row['not_run']} | | | | | |")
            continue
        runs = " / ".join(num(x) for x in row["all_jobs_per_s"])
        share = row.get("of_ceiling")
        out.append(f"| {name} | {num(row['jobs_per_s'])} | "
                   f"{'-' if share is None else f'{share:.2f}x'} | {runs} | "
                   f"{row['duplicates']} | {mb(row.get('coordinator_mb'))} | "
                   f"{mb(row.get('child_mb'))} |")
    return out


def pickup_table(rows: dict[str, Any], cfg: dict[str, Any]) -> list[str]:
    out = [f"**Pickup** ({cfg['pickup_samples']} single inserts into warm idle workers; "
           "row committed -> handler starts; after idle: one more insert after the idle CPU "
           "stretch)", "",
           "| system | p50 | p95 | max | idle CPU | after idle |",
           "|---|---:|---:|---:|---:|---:|"]
    for name, row in rows.items():
        if row.get("not_run"):
            out.append(f"| {name} | {row['not_run']} | | | | |")
            continue
        out.append(f"| {name} | {num(row['p50_ms'], 1)} ms | {num(row['p95_ms'], 1)} ms | "
                   f"{num(row['max_ms'], 1)} ms | {num(row['idle_cpu_percent'], 1)} % | "
                   f"{after_idle(row)} |")
    return out


def after_idle(row: dict[str, Any]) -> str:
    """Runs before this column existed have no such figure: say so, not "-"."""
    if "after_idle_ms" not in row:
        return "not measured"
    return f"{num(row['after_idle_ms'], 1)} ms"


def history_table(rows: dict[str, Any], cfg: dict[str, Any]) -> list[str]:
    runs = f"; medians of {cfg['history_repeats']}" if cfg.get("history_repeats") else ""
    out = [f"**History** ({cfg['history_new']:,} new rows drained with "
           f"{cfg['history_rows']:,} finished rows in history vs none{runs})", "",
           "| database / worker | empty, jobs/s | with history, jobs/s | ratio |",
           "|---|---:|---:|---:|"]
    for name, row in rows.items():
        out.append(f"| {name} | {num(row['empty'])} | {num(row['history'])} | "
                   f"{num(row['ratio'], 2)} |")
    return out


def poison_table(rows: dict[str, Any], cfg: dict[str, Any]) -> list[str]:
    out = [f"**Poison row** ({cfg['poison_jobs']:,} rows drained by `runworkers --drain`, the "
           "first of them killing its child every time vs none; the other rows' jobs/s, "
           "seconds from start until they all finished and until the first of them started, "
           "and the longest pause between two handler starts; medians of "
           f"{cfg['poison_repeats']} pairs, the arms of a pair run one after the other; "
           "*pairs*: each pair's ratio and their median)", "",
           "| database / concurrency | no poison, jobs/s | poison, jobs/s | ratio | pairs | "
           "no poison, s | poison, s | ratio | first start | longest pause | "
           "poison row at drain end | then |",
           "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---|---|"]
    for name, row in rows.items():
        at_end, then = poison_words(row)
        pairs = " / ".join(num(x, 2) for x in row["pair_ratios"])
        if row.get("pair_ratio_median") is not None:
            pairs = f"{num(row['pair_ratio_median'], 2)} ({pairs})"
        pause = " -> ".join(num(row.get(k) and row[k] * 1000) + " ms"
                            for k in ("clean_longest_gap_s", "poison_longest_gap_s"))
        first = " -> ".join(num(row.get(k), 1) + " s"
                            for k in ("clean_first_start_s", "poison_first_start_s"))
        out.append(f"| {name} | {num(row['clean_jobs_per_s'])} | "
                   f"{num(row['poison_jobs_per_s'])} | {num(row['ratio'], 2)} | {pairs} | "
                   f"{num(row['clean_done_s'], 1)} | {num(row['poison_done_s'], 1)} | "
                   f"{num(row['done_s_ratio'], 2)} | {first} | {pause} | {at_end} | {then} |")
    return out


def poison_words(row: dict[str, Any]) -> tuple[str, str]:
    """The poison row when --drain exited (over the repeats), and after the follow-up run."""
    seen = row["poison_row_at_drain_end"]
    if not seen:
        return "-", "-"
    crashes = sorted({x["crashes"] for x in seen})
    span = f"{crashes[0]}" if len(crashes) == 1 else f"{crashes[0]}-{crashes[-1]}"
    at_end = f"{' / '.join(sorted({x['status'] for x in seen}))}, {span} crash(es)"
    after = row.get("poison_row_after")
    return at_end, (f"{after['status']} after {after['crashes']} crashes" if after else "-")


def scale_table(rows: dict[str, Any], cfg: dict[str, Any]) -> list[str]:
    out = [f"**Scale-out** on PostgreSQL ({cfg['scale_jobs']:,} jobs, N warm `runworkers` "
           "processes, concurrency 2 each)", "",
           "| processes | jobs/s | ran twice | finished | machine CPU busy |",
           "|---|---:|---:|---:|---:|"]
    for name, row in rows.items():
        out.append(f"| {name.split()[0]} | {num(row['jobs_per_s'])} | {row['duplicates']} | "
                   f"{num(row['finished'])} | {num(row.get('cpu_busy_percent'))} % |")
    return out


def memory_table(mem: dict[str, Any], cfg: dict[str, Any]) -> list[str]:
    return [f"**Memory** over one drain of {cfg.get('memory_jobs', 0):,} jobs on "
            f"PostgreSQL ({num(mem['jobs_per_s'])} jobs/s, {mem['duplicates']} ran twice)",
            "", "| process | RSS 10-20 % into the run | RSS at the end | growth |",
            "|---|---:|---:|---:|",
            f"| coordinator | {mem['coordinator_mb_early']} MB | {mem['coordinator_mb_end']} MB"
            f" | {mem['coordinator_growth_mb']} MB |",
            f"| largest child | {mem['child_mb_early']} MB | {mem['child_mb_end']} MB | "
            f"{mem['child_growth_mb']} MB |"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", nargs="?", help="a results file (default: the newest full run)")
    parser.add_argument("--write", action="store_true", help=f"update {DOC.name}")
    args = parser.parse_args()
    path = Path(args.json or newest_full_run(HERE / "results")).resolve()
    source = path.relative_to(HERE.parent) if path.is_relative_to(HERE.parent) else path
    text = tables(json.loads(path.read_text()), str(source))
    if not args.write:
        print(text)
        return 0
    doc = DOC.read_text()
    pattern = re.compile(re.escape(START) + ".*?" + re.escape(END), re.S)
    if not pattern.search(doc):
        raise SystemExit(f"{DOC} has no {START} ... {END} block to replace")
    DOC.write_text(pattern.sub(lambda _: f"{START}\n{text}{END}", doc))
    print(f"updated {DOC}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
