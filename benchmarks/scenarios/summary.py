"""The JSON's summary (medians over repeats, fractions of the ceiling) and the machine it ran on."""

from __future__ import annotations

import os
import platform
import statistics
from pathlib import Path
from typing import Any


# -- reporting --------------------------------------------------------------------------
def percentile(values: list[float], p: float) -> float:
    if len(values) == 1:
        return values[0]
    k = (len(values) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def median_of(runs: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in runs if r.get(key) is not None]
    return round(statistics.median(vals), 2) if vals else None


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version(),
                            "cpus": os.cpu_count()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        info["mem_gb"] = round(int(Path("/proc/meminfo").read_text().split()[1]) / 2**20, 1)
        info["loadavg_at_start"] = os.getloadavg()
    except OSError:
        pass
    import importlib.metadata as md

    for pkg in ("django", "psycopg", "mysqlclient", "celery", "redis", "procrastinate",
                "django-tasks-db"):
        try:
            info[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return info


def server_versions(dbs: list[str]) -> dict[str, str]:
    from django.db import connections

    out = {}
    for db in dbs:
        with connections[db].cursor() as c:
            c.execute("SELECT sqlite_version()" if db == "sqlite" else "SELECT version()")
            out[db] = str(c.fetchone()[0])
            if db == "postgres":
                # Off, dead rows and stale statistics stay for the whole run (the server's
                # configuration, which the benchmark does not change): worth saying.
                c.execute("SHOW autovacuum")
                out["postgres_autovacuum"] = str(c.fetchone()[0])
    return out


def summarize_drains(drains: dict[str, list[dict[str, Any]]],
                     not_run: dict[str, str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Medians per system, each also as a fraction of its database's grouped no-queue
    ceiling (`of_ceiling`); the systems that did not run, with the reason."""
    out: dict[str, Any] = {}
    for name, runs in drains.items():
        rss = [r.get("rss") or {} for r in runs]
        out[name] = {
            "db": runs[0].get("db"),
            "jobs_per_s": median_of(runs, "jobs_per_s"),
            "all_jobs_per_s": [r["jobs_per_s"] for r in runs],
            "duplicates": sum(r["duplicates"] for r in runs),
            "done": min(r["done"] for r in runs),
            "coordinator_mb": max((x.get("coordinator_mb_max", 0) for x in rss), default=None)
            or None,
            "child_mb": max((x.get("child_mb_max", 0) for x in rss), default=None) or None,
        }
        if runs[0].get("enqueue_ms"):  # the task backends: how long one enqueue() call takes
            out[name]["enqueue_ms_p50"] = median_of([r["enqueue_ms"] for r in runs], "p50")
            out[name]["enqueue_ms_p95"] = median_of([r["enqueue_ms"] for r in runs], "p95")
    ceiling = {runs[0]["db"]: {"system": name, "jobs_per_s": out[name]["jobs_per_s"]}
               for name, runs in drains.items() if runs[0].get("ceiling")}
    for row in out.values():
        top = ceiling.get(row["db"], {}).get("jobs_per_s")
        row["of_ceiling"] = round(row["jobs_per_s"] / top, 2) \
            if top and row["jobs_per_s"] else None
    for name, reason in not_run.items():
        out.setdefault(name, {"jobs_per_s": None, "not_run": reason})
    return out, ceiling


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"drain": {}, "pickup": {}, "history": {}, "poison": {},
                           "scale_out": {}}
    if raw.get("memory"):
        out["memory"] = raw["memory"][-1]  # one long run: it is its own repeat
    if raw.get("flow"):
        out["flow"] = raw["flow"]  # one run per database (scenarios/flow.py): no medians
    not_run = raw.get("not_run", {})
    out["drain"], out["ceiling"] = summarize_drains(raw["drain"], not_run.get("drain", {}))
    for name, runs in raw["pickup"].items():
        out["pickup"][name] = {k: median_of(runs, k) for k in
                               ("p50_ms", "p95_ms", "max_ms", "idle_cpu_percent",
                                "after_idle_ms")}
    for name, reason in not_run.get("pickup", {}).items():
        out["pickup"].setdefault(name, {"not_run": reason})
    for name, pair in raw["history"].items():
        empty = median_of(pair["empty"], "jobs_per_s")
        full = median_of(pair["history"], "jobs_per_s")
        out["history"][name] = {"empty": empty, "history": full,
                                "ratio": round(full / empty, 2) if empty and full else None}
    out["poison"] = summarize_poison(raw.get("poison", {}))
    for name, runs in raw["scale_out"].items():
        out["scale_out"][name] = {
            "jobs_per_s": median_of(runs, "jobs_per_s"),
            "duplicates": sum(r["duplicates"] for r in runs),
            "finished": min(r["finished"] for r in runs),
            "cpu_busy_percent": median_of(runs, "machine_cpu_busy_percent"),
        }
    return out


def summarize_poison(pairs: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """Per database and concurrency: medians of each arm, poison / no poison (ratio of
    the medians, and each pair's), and what became of the poison row."""
    out: dict[str, Any] = {}
    for name, pair in pairs.items():
        clean, poisoned = pair["clean"], pair["poison"]
        row: dict[str, Any] = {
            "db": clean[0]["db"] if clean else poisoned[0]["db"],
            "concurrency": (clean or poisoned)[0]["concurrency"],
            "repeats": min(len(clean), len(poisoned)),
            "clean_jobs_per_s": median_of(clean, "jobs_per_s"),
            "poison_jobs_per_s": median_of(poisoned, "jobs_per_s"),
            "clean_done_s": median_of(clean, "others_done_s"),
            "poison_done_s": median_of(poisoned, "others_done_s"),
            "clean_first_start_s": median_of(clean, "first_start_s"),
            "poison_first_start_s": median_of(poisoned, "first_start_s"),
            "clean_longest_gap_s": median_of(clean, "longest_gap_s"),
            "poison_longest_gap_s": median_of(poisoned, "longest_gap_s"),
            # Each pair (the two arms run one after the other): poison arm's jobs/s over the
            # clean arm's. Their median is robust to the machine's load drifting between
            # pairs, which the ratio of the two medians is not.
            "pair_ratios": [round(p["jobs_per_s"] / c["jobs_per_s"], 2)
                            for c, p in zip(clean, poisoned, strict=False)
                            if c.get("jobs_per_s") and p.get("jobs_per_s")],
            # The machine is shared: its 1-minute load average as the runs began.
            "loadavg_1min_range": [min(loads), max(loads)] if (loads := [
                r["loadavg_1min"] for r in clean + poisoned if "loadavg_1min" in r]) else None,
            # Other rows not finished when --drain exited, over all runs (0 expected), and
            # rows that ran twice (two Effect rows: 0 expected).
            "others_not_finished": sum(r["jobs"] - r["others_status"].get("finished", 0)
                                       for r in clean + poisoned),
            "duplicates": sum(r["duplicates"] for r in clean + poisoned),
            "poison_row_at_drain_end": [
                {k: r["poison_row"][k] for k in ("status", "crashes", "retry_due_in_s")}
                for r in poisoned if r.get("poison_row")],
            # When the poison row's last attempt was claimed, against when the last other
            # row finished (seconds; about 0: its retry ran once the others were done).
            "poison_last_claim_minus_others_done_s": [
                round(r["poison_row"]["last_claimed_s"] - r["others_done_s"], 3)
                for r in poisoned if r.get("poison_row", {}).get("last_claimed_s") is not None
                and r.get("others_done_s") is not None],
            "poison_row_after": next((r["poison_row_after"] for r in poisoned
                                      if r.get("poison_row_after")), None),
        }
        c, p = row["clean_jobs_per_s"], row["poison_jobs_per_s"]
        row["ratio"] = round(p / c, 2) if c and p else None
        row["pair_ratio_median"] = (round(statistics.median(row["pair_ratios"]), 2)
                                    if row["pair_ratios"] else None)
        c, p = row["clean_done_s"], row["poison_done_s"]
        # Seconds, poison over clean: 1.10 means the other rows took 10 % longer.
        row["done_s_ratio"] = round(p / c, 2) if c and p else None
        out[name] = row
    return out
