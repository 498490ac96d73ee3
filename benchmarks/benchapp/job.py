"""The job every queued system runs, and the no-queue ceiling runs without a queue: load
the Job row, insert one Effect row through the ORM, stamped with the handler's start."""

from __future__ import annotations

import os
import time

from .models import Effect, Job


def run_job(system: str, job_id: int) -> None:
    started = time.time()
    job = Job.objects.get(pk=job_id)
    Effect.objects.create(system=system, job_id=job.pk, started_at=started, pid=os.getpid())
