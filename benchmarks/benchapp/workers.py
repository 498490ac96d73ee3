"""The dbworker side: the same effect as benchapp.tasks, concurrency 2."""

from __future__ import annotations

import os
import time

from django_dbworker import Finished, worker

from .models import Effect, Job, OrderedJob


@worker(name="bench", source=Job, concurrency=2)
def handle_job(job: Job) -> Finished:
    started = time.time()
    Effect.objects.create(system="dbworker", job_id=job.pk, started_at=started, pid=os.getpid())
    return Finished()


@worker(name="bench_ordered", source=OrderedJob, concurrency=2,
        eligible=lambda: OrderedJob.objects.filter(ready=True).order_by("priority"))
def handle_ordered_job(job: OrderedJob) -> Finished:
    started = time.time()
    Effect.objects.create(system="dbworker", job_id=job.pk, started_at=started, pid=os.getpid())
    return Finished()
