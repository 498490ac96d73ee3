"""The dbworker side: the same effect as benchapp.tasks, concurrency 2; the poison
scenario's worker, whose concurrency each run sets (runworkers --concurrency); and the
flow scenario's limited workers (docs/flow-control.md)."""

from __future__ import annotations

import os
import time

from django_dbworker import Finished, worker
from django_dbworker.models import Execution

from .models import Effect, FairJob, Job, KeyedJob, OrderedJob, PoisonJob, RateClaim, RateJob


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


# The flow scenario (scenarios/flow.py): a rate shared by two coordinators, measured by
# the claims' times; and a fair worker whose claims are timed in-process (never run).
@worker(name="bench_rate", source=RateJob, concurrency=2, rate="50/s")
def handle_rate_job(job: RateJob) -> Finished:
    # The claim's time, read while the row is WORKING (its started_at becomes the
    # handler's start when it finishes); it commits with the row's outcome.
    claimed_at = Execution.objects.filter(worker="bench_rate", source_id=str(job.pk)).values_list(
        "started_at", flat=True).get()
    RateClaim.objects.create(job_id=job.pk, claimed_at=claimed_at)
    return Finished()


@worker(name="bench_fair", source=FairJob, concurrency=2, key="priority", per_key=1, fair=True)
def handle_fair_job(job: FairJob) -> Finished:
    started = time.time()
    Effect.objects.create(system="dbworker", job_id=job.pk, started_at=started, pid=os.getpid())
    return Finished()
