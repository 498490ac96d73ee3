"""The job as a Procrastinate task (found by PROCRASTINATE_AUTODISCOVER_MODULE_NAME)."""

from __future__ import annotations

from procrastinate.contrib.django import app

from .job import run_job


@app.task(name="bench.procrastinate_job", queue="bench")
def handle_job(job_id: int) -> None:
    run_job("procrastinate", job_id)
