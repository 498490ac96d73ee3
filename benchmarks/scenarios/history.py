"""History ratio: draining new rows with many finished rows in history vs none."""

from __future__ import annotations

import time
from typing import Any

from .common import Cfg, analyze, make_history, queue_jobs, reset, runworkers, summarize_drain


def history(db: str, worker: str, new: int, past: int, cfg: Cfg) -> dict[str, Any]:
    reset(db)
    if past:
        make_history(db, past, worker)
    t = time.monotonic()
    queue_jobs(db, new, worker)
    analyze(db)
    setup = time.monotonic() - t
    tree = runworkers(db, worker, drain=True, log=cfg.log)
    t0 = time.monotonic()
    code = tree.wait(cfg.timeout)
    wall = time.monotonic() - t0
    tree.stop()
    result = summarize_drain(db, "dbworker", new, wall)
    result.update(history=past, exit_code=code, setup_s=round(setup, 2))
    return result
