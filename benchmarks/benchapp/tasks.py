"""The Celery side: load the job, insert the same Effect row."""

from __future__ import annotations

from benchproject.celery_app import app

from .job import run_job


@app.task(name="bench.handle_job")
def handle_job(job_id: int) -> None:
    run_job("celery", job_id)
