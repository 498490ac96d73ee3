"""The dbworker side: the same effect as benchapp.tasks, concurrency 2; and the poison
scenario's worker, whose concurrency each run sets (runworkers --concurrency)."""

from __future__ import annotations

import os
import time

from django_dbworker import Finished, worker

from .models import Effect, Job, KeyedJob, OrderedJob, PoisonJob


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


# The package's default retry_backoff (10 s) for the measured drains; the harness sets a
# small one only to see a poison row through to FAILED afterwards (scenarios/poison.py).
_backoff = os.environ.get("BENCH_POISON_RETRY_BACKOFF")
POISON_OPTIONS = {"retry_backoff": float(_backoff)} if _backoff else {}


@worker(name="bench_poison", source=PoisonJob, concurrency=1, **POISON_OPTIONS)
def handle_poison_job(job: PoisonJob) -> Finished:
    if job.poison:
        os._exit(3)  # the child dies mid-handler, every time this row runs
    started = time.time()
    Effect.objects.create(system="poison", job_id=job.pk, started_at=started, pid=os.getpid())
    return Finished()


@worker(name="bench_keyed", source=KeyedJob, concurrency=2, key="priority", per_key=1)
def handle_keyed_job(job: KeyedJob) -> Finished:
    started = time.time()
    Effect.objects.create(system="dbworker", job_id=job.pk, started_at=started, pid=os.getpid())
    return Finished()
