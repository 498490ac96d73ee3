"""django.tasks tasks the tests enqueue (children import them by path)."""

import asyncio
import os
import time
from datetime import timedelta

from django.db import transaction

from django_dbworker.tasks import flow_key, unique

from .models import Effect

try:
    from django.tasks import task
except ImportError:  # Django 5.2: the backport
    from django_tasks import task


def effect(name: str, key) -> None:
    Effect.objects.create(worker=name, source_id=str(key), pid=os.getpid())


@task()
def add(a, b):
    effect("task.add", f"{a}+{b}")
    return a + b


@task()
def echo(*args, **kwargs):
    return {"args": list(args), "kwargs": kwargs}


@task()
def fail(message):
    effect("task.fail", message)  # rolled back with the failure
    raise ValueError(message)


@task(queue_name="retries", takes_context=True)
def flaky(context, key, succeed_on):
    """Fails until attempt ``succeed_on``; records the attempt it saw."""
    effect("task.flaky", f"{key}:{context.attempt}")
    if context.attempt < succeed_on:
        raise RuntimeError(f"attempt {context.attempt} fails")
    return context.attempt


@task()
def not_json():
    return object()


@task()
def record(key, sleep=0.0):
    if sleep:
        from .workers import pid_file

        pid_file("task.record", key).write_text(str(os.getpid()))
        time.sleep(sleep)
    effect("task.record", key)
    return key


@task(queue_name="emails")
def hang(key):
    effect("task.hang", key)
    time.sleep(120)


@task()
async def async_add(a, b):
    await asyncio.sleep(0.01)
    from asgiref.sync import sync_to_async

    await sync_to_async(effect)("task.async_add", f"{a}+{b}")
    return a + b


@task()
def nothing(key):
    effect("task.nothing", key)


@task()
def discard(key):
    """Writes, then asks for its writes to be rolled back: its result stands."""
    effect("task.discard", key)
    transaction.set_rollback(True)
    return key


@task()
def commit_inside():
    transaction.commit()


@task(priority=0)
def ordered(key):
    effect("task.ordered", key)
    return key


@task(queue_name="crashes")
def crash(key):
    """Kills its child every time (the queue retries: MAX_ATTEMPTS 2, RETRY_BACKOFF 1)."""
    effect("task.crash", key)  # never committed
    os._exit(3)


@task(takes_context=True)
def sees_its_start(context):
    """Whether another connection sees this task's task_started record (tests/testapp/
    signals.py) while the task runs: that is, whether the record was committed."""
    from threading import Thread

    from django.db import connection

    from .models import SignalSeen

    seen = []

    def look():
        try:
            seen.append(SignalSeen.objects.filter(
                kind="started", key__startswith=f"{context.task_result.id}:").exists())
        finally:
            connection.close()

    thread = Thread(target=look)
    thread.start()
    thread.join()
    return seen[0]


@task()
def returns_nan():
    return {"ratio": float("nan")}


@task()
def ignore(*args, **kwargs):
    """Takes anything and does nothing with it (tests of what enqueue() accepts)."""


# -- tests/test_unique_tasks.py ------------------------------------------------------------
@unique()  # the arguments are the key
@task()
def refresh(key):
    effect("task.refresh", key)
    return key


@unique(key=lambda customer, **_: customer)  # one pending task per customer
@task()
def recount(customer, note=""):
    effect("task.recount", f"{customer}:{note}")
    return note


@unique(key=lambda customer, **_: customer, among="pending_or_running")  # None: not unique
@task()
def sync_customer(customer, sleep=0.0):
    if sleep:
        time.sleep(sleep)
    effect("task.sync_customer", customer)


@unique(key=lambda key, **_: key, within=timedelta(minutes=10))  # one per key per 10 min
@task()
def notify(key):
    effect("task.notify", key)
    return key


@unique(key=lambda key, *_, **__: key, debounce=0.4)  # the last arguments run, once
@task()
def reindex(key, version):
    effect("task.reindex", f"{key}:{version}")
    return version


# -- tests/test_flow_control.py: a queue with PER_KEY 1 ------------------------------------
@flow_key(lambda customer, *args, **kwargs: customer)
@task(queue_name="keyed")
def per_customer(customer, n):
    effect("task.per_customer", f"{customer}:{n}")


# -- tests/test_fair_shares.py: a FAIR queue takes turns across @flow_key ------------------
@flow_key(lambda tenant, *args, **kwargs: tenant)
@task(queue_name="fair")
def per_tenant(tenant, n):
    effect("task.per_tenant", f"{tenant}:{n}")
