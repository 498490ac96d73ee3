#!/usr/bin/env python
"""Markdown tables from a benchmark JSON (default: results/latest.json).

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


def num(v: Any, digits: int = 0) -> str:
    if v is None:
        return "-"
    return f"{v:,.{digits}f}"


def tables(report: dict[str, Any]) -> str:
    s, cfg, m = report["summary"], report["config"], report["machine"]
    servers = report.get("servers", {})
    out = [
        f"Run of {report['date']}, `{report['mode']}` mode, medians of "
        f"{cfg['repeats']} (JSON: `benchmarks/results/latest.json`).",
        "",
        f"Machine: {m.get('cpus')} vCPU {m.get('cpu', '')}, {m.get('mem_gb')} GB, "
        f"Python {m.get('python')}, Django {m.get('django')}, "
        f"PostgreSQL {servers.get('postgres', '?').split(' on ')[0].replace('PostgreSQL ', '')}, "
        f"MariaDB {servers.get('mysql', '?').split('-')[0]}, SQLite {servers.get('sqlite', '?')}, "
        f"Celery {m.get('celery')}; load average at start "
        f"{', '.join(f'{x:.1f}' for x in m.get('loadavg_at_start', []))}.",
        "",
        f"**Drain** ({cfg['drain_jobs']:,} jobs queued before the workers start, concurrency 2)",
        "",
        "| system | jobs/s | runs | coordinator RSS | child RSS |",
        "|---|---:|---|---:|---:|",
    ]
    for name, row in s["drain"].items():
        runs = " / ".join(num(x) for x in row["all_jobs_per_s"])
        out.append(f"| {name} | {num(row['jobs_per_s'])} | {runs} | "
                   f"{num(row.get('coordinator_mb'))} MB | {num(row.get('child_mb'))} MB |")
    out += ["", f"**Pickup** ({cfg['pickup_samples']} single inserts into warm idle workers; "
                "row committed -> handler starts)", "",
            "| system | p50 | p95 | max | idle CPU |", "|---|---:|---:|---:|---:|"]
    for name, row in s["pickup"].items():
        out.append(f"| {name} | {num(row['p50_ms'], 1)} ms | {num(row['p95_ms'], 1)} ms | "
                   f"{num(row['max_ms'], 1)} ms | {num(row['idle_cpu_percent'], 1)} % |")
    out += ["", f"**History** ({cfg['history_new']:,} new rows drained with "
                f"{cfg['history_rows']:,} finished rows in history vs none)", "",
            "| database / worker | empty, jobs/s | with history, jobs/s | ratio |",
            "|---|---:|---:|---:|"]
    for name, row in s["history"].items():
        out.append(f"| {name} | {num(row['empty'])} | {num(row['history'])} | "
                   f"{num(row['ratio'], 2)} |")
    out += ["", f"**Scale-out** on PostgreSQL ({cfg['scale_jobs']:,} jobs, N warm `runworkers` "
                "processes, concurrency 2 each)", "",
            "| processes | jobs/s | ran twice | finished | machine CPU busy |",
            "|---|---:|---:|---:|---:|"]
    for name, row in s["scale_out"].items():
        out.append(f"| {name.split()[0]} | {num(row['jobs_per_s'])} | {row['duplicates']} | "
                   f"{num(row['finished'])} | {num(row.get('cpu_busy_percent'))} % |")
    if s.get("memory"):
        mem = s["memory"]
        out += ["", f"**Memory** over one drain of {cfg.get('memory_jobs', 0):,} jobs on "
                    f"PostgreSQL ({num(mem['jobs_per_s'])} jobs/s, {mem['duplicates']} ran twice)",
                "", "| process | RSS 10-20 % into the run | RSS at the end | growth |",
                "|---|---:|---:|---:|",
                f"| coordinator | {mem['coordinator_mb_early']} MB | {mem['coordinator_mb_end']} MB"
                f" | {mem['coordinator_growth_mb']} MB |",
                f"| largest child | {mem['child_mb_early']} MB | {mem['child_mb_end']} MB | "
                f"{mem['child_growth_mb']} MB |"]
    return "\n".join(out) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", nargs="?", default=str(HERE / "results" / "latest.json"))
    parser.add_argument("--write", action="store_true", help=f"update {DOC.name}")
    args = parser.parse_args()
    text = tables(json.loads(Path(args.json).read_text()))
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
