"""The Celery side: load the job, insert the same Effect row."""

from __future__ import annotations

import os
import time

from benchproject.celery_app import app

from .models import Effect, Job


@app.task(name="bench.handle_job")
def handle_job(job_id: int) -> None:
    started = time.time()
    job = Job.objects.get(pk=job_id)
    Effect.objects.create(system="celery", job_id=job.pk, started_at=started, pid=os.getpid())
