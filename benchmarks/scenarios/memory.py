"""Memory: RSS of the coordinator and its children over one long drain on PostgreSQL."""

from __future__ import annotations

import statistics
from typing import Any

from .common import Cfg, analyze, queue_jobs, reset, runworkers, summarize_drain


def memory(n: int, cfg: Cfg) -> dict[str, Any]:
    """One long drain on PostgreSQL with RSS sampled throughout: the coordinator's and
    each child's resident memory early in the run (10-20% of it) against its end."""
    db = "postgres"
    reset(db)
    queue_jobs(db, n)
    analyze(db)
    tree = runworkers(db, "bench", drain=True, log=cfg.log)
    code = tree.wait(cfg.timeout, every=0.5)
    tree.stop()
    samples = [x for x in tree.samples if x[2]]
    if len(samples) < 10:
        return {"jobs": n, "exit_code": code, "error": "too few samples"}
    t0, t1 = samples[0][0], samples[-1][0]
    early = [x for x in samples if t0 + 0.1 * (t1 - t0) <= x[0] <= t0 + 0.2 * (t1 - t0)]
    late = [x for x in samples if x[0] >= t0 + 0.9 * (t1 - t0)]

    def mb(xs: list[Any], pick: Any) -> float:
        return round(statistics.median(pick(x) for x in xs), 1)

    result = summarize_drain(db, "dbworker", n, t1 - t0)
    result.update(
        exit_code=code,
        coordinator_mb_early=mb(early, lambda x: x[1]),
        coordinator_mb_end=mb(late, lambda x: x[1]),
        child_mb_early=mb(early, lambda x: max(x[2])),
        child_mb_end=mb(late, lambda x: max(x[2])),
    )
    result["coordinator_growth_mb"] = round(
        result["coordinator_mb_end"] - result["coordinator_mb_early"], 1)
    result["child_growth_mb"] = round(result["child_mb_end"] - result["child_mb_early"], 1)
    return result
