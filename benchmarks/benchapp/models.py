"""Rows that are the work (Job, OrderedJob, PoisonJob, KeyedJob, RateJob, FairJob), the one
row a job writes (Effect), and the claim times of the flow scenario's rate (RateClaim)."""

from __future__ import annotations

from django.db import models


class Job(models.Model):
    """Work for the `bench` worker (default ordering) and for Celery."""

    # time.time() when the harness sent the INSERT (it commits in that statement).
    created_ts = models.FloatField(default=0.0)
    priority = models.IntegerField(default=0)
    ready = models.BooleanField(default=True)


class OrderedJob(models.Model):
    """Work for the `bench_ordered` worker: eligible() filters and orders on columns."""

    created_ts = models.FloatField(default=0.0)
    priority = models.IntegerField(default=0)
    ready = models.BooleanField(default=True)


class PoisonJob(models.Model):
    """Work for the `bench_poison` worker (the poison scenario): a Job, plus the mark of
    the one row whose handler kills its child every time. A table of its own, so that
    its worker adds no Execution rows to the other scenarios' Job rows."""

    created_ts = models.FloatField(default=0.0)
    priority = models.IntegerField(default=0)
    ready = models.BooleanField(default=True)
    poison = models.BooleanField(default=False)


class Effect(models.Model):
    """What a job does: one row inserted through the ORM, stamped with the start time."""

    system = models.CharField(max_length=20)
    job_id = models.BigIntegerField()
    started_at = models.FloatField()  # time.time() when the handler started
    pid = models.IntegerField()


class KeyedJob(models.Model):
    """Work for the `bench_keyed` worker (per_key=1 on `priority`: the harness gives each
    row one of 1,000 values). A table of its own, as PoisonJob is."""

    created_ts = models.FloatField(default=0.0)
    priority = models.IntegerField(default=0)
    ready = models.BooleanField(default=True)


class RateJob(models.Model):
    """Work for the `bench_rate` worker (rate="50/s": the flow scenario). A table of its
    own, as PoisonJob is."""

    created_ts = models.FloatField(default=0.0)
    priority = models.IntegerField(default=0)
    ready = models.BooleanField(default=True)


class RateClaim(models.Model):
    """When a `bench_rate` row was claimed: its Execution's started_at, which the handler
    reads while the row is WORKING. (Once the row finishes, started_at is when its
    handler started, docs/concepts.md "One clock": that lags the claim, by a different
    time for each row.)"""

    job_id = models.BigIntegerField()
    claimed_at = models.DateTimeField()


class FairJob(models.Model):
    """Work for the `bench_fair` worker (fair=True, per_key=1 on `priority`: the flow
    scenario's claim cost, beside `bench_keyed`). A table of its own, as PoisonJob is."""

    created_ts = models.FloatField(default=0.0)
    priority = models.IntegerField(default=0)
    ready = models.BooleanField(default=True)
