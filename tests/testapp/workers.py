"""Workers the tests drive. Behaviour is data-driven (children import these by name)."""

import os
import re
import tempfile
import time
from datetime import timedelta
from pathlib import Path

from django.db import transaction

from django_dbworker import ExecutionStatus, Finished, Unfinished, has_execution_status, worker
from django_dbworker.models import Execution

from .models import (
    Article,
    Author,
    Document,
    Effect,
    FairJob,
    FaultJob,
    KeyedJob,
    Link,
    Stepper,
    StressJob,
    Tag,
    UuidItem,
)


def effect(name: str, key) -> None:
    Effect.objects.create(worker=name, source_id=str(key), pid=os.getpid())


@worker(name="docs", source=Document, concurrency=2,
        eligible=lambda: Document.objects.filter(uploaded=True))
def handle_document(doc: Document):
    b = doc.behaviour
    if b.startswith("on_commit"):  # "on_commit", or "on_commit+fail": a callback, then b
        transaction.on_commit(lambda: effect("docs.on_commit", doc.pk))
        b = b.partition("+")[2]
    if b in ("abort", "abort_quietly"):  # ends the transaction under the child's feet
        effect("docs", doc.pk)
        from django.db import connections
        with connections["default"].cursor() as cursor:
            cursor.execute("ROLLBACK")
        if b == "abort":
            raise ValueError(f"aborted the transaction of document {doc.pk}")
        return Finished()
    if b == "swallow_error":  # a database error caught and ignored (aborts a PostgreSQL
        effect("docs", doc.pk)  # transaction; elsewhere only the statement fails)
        from django.db import DatabaseError, connections
        try:
            with connections["default"].cursor() as cursor:
                cursor.execute("SELECT * FROM no_such_table_here")
        except DatabaseError:
            pass
        return Finished()
    if b.startswith("hold:"):  # a gate of its own, which a test can hold (held_handler)
        gate_file(b.split(":", 1)[1]).write_text(str(os.getpid()))
    if b.startswith("sleep:"):
        pid_file("docs", doc.pk).write_text(str(os.getpid()))  # "the handler is running"
        time.sleep(float(b.split(":")[1]))
    if b == "fail":
        effect("docs", doc.pk)  # rolled back with the failure
        raise ValueError(f"cannot handle document {doc.pk}")
    if b == "commit":
        effect("docs", doc.pk)
        transaction.commit()
    if b == "lose_connection":  # the server drops its connection (as a restart would)
        effect("docs", doc.pk)
        from django.db import connections
        with connections["default"].cursor() as cursor:
            if connections["default"].vendor == "postgresql":
                cursor.execute("SELECT pg_terminate_backend(pg_backend_pid())")
            else:
                cursor.execute("SELECT CONNECTION_ID()")
                cursor.execute("KILL %s", [cursor.fetchone()[0]])
    if b == "discard":  # its writes go, its outcome stays
        effect("docs", doc.pk)
        transaction.set_rollback(True)
        return Finished()
    if b == "wrong_return":
        effect("docs", doc.pk)
        return "done"
    if b == "crash":
        os._exit(3)
    if b == "crash_once" and not Effect.objects.filter(worker="crash_marker", source_id=str(doc.pk)).exists():
        # Leave a marker outside this transaction, then die mid-handler.
        from django.db import connections
        with connections["default"].cursor():
            pass
        Effect.objects.create(worker="crash_marker", source_id=str(doc.pk))
        transaction.on_commit(lambda: None)
        os._exit(4)
    if b.startswith("steps:"):
        doc.steps += 1
        doc.save(update_fields=["steps"])
        if doc.steps < int(b.split(":")[1]):
            return Unfinished()
    effect("docs", doc.pk)
    doc.text = f"handled {doc.pk}"
    doc.save(update_fields=["text"])
    return Finished()


@worker(name="summaries", source=Document,
        eligible=lambda: Document.objects.filter(has_execution_status("docs", ExecutionStatus.FINISHED)))
def summarize(doc: Document):
    effect("summaries", doc.pk)
    return Finished()


@worker(name="ordered_desc", source=Document,
        eligible=lambda: Document.objects.filter(uploaded=True).order_by("-priority", "id"))
def ordered_desc(doc: Document):
    effect("ordered_desc", doc.pk)
    return Finished()


@worker(name="by_author", source=Document,
        eligible=lambda: Document.objects.filter(author__isnull=False).order_by("-author__rank", "id"))
def by_author(doc: Document):
    effect("by_author", doc.pk)
    return Finished()


# Its eligible filter lets every row through; it is there so that claims join the source
# through a UUID key (tests/test_claims.py checks that plan).
@worker(name="uuids", source=UuidItem, eligible=lambda: UuidItem.objects.exclude(name="skip"))
def handle_uuid(item: UuidItem):
    effect("uuids", item.pk)
    return Finished()


@worker(name="tags", source=Tag)
def handle_tag(tag: Tag):
    effect("tags", tag.pk)
    return Finished()


@worker(name="retrying", source=Tag, max_attempts=3, retry_backoff=0.01,
        eligible=lambda: Tag.objects.filter(slug__startswith="retry"))
def retrying(tag: Tag):
    effect("retrying", tag.pk)
    raise RuntimeError("always fails")


# -- tests/test_faults.py and tests/test_stress.py --------------------------------------

MARKERS = Path(tempfile.gettempdir()) / "dbworker-test-markers"


def markers() -> Path:
    """This test database's folder of marker files (removed when the session ends)."""
    from django.db import connection

    return MARKERS / re.sub(r"\W+", "_", str(connection.settings_dict["NAME"]))


def pid_file(worker_name: str, key) -> Path:
    """Where a handler leaves its pid outside the database (it survives a rollback)."""
    folder = markers()
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{worker_name}-{key}.pid"


def gate_file(name: str) -> Path:
    """Where a ``hold:<name>`` handler leaves its pid when it starts; the row's own
    ``pid_file`` serves ``sleep:`` rows, which is one file for every run of the row."""
    folder = markers()
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"gate-{name}"


@worker(name="timed", source=FaultJob, concurrency=2, timeout=3,
        eligible=lambda: FaultJob.objects.filter(behaviour__in=["ok", "hang"]))
def timed(job: FaultJob):
    effect("timed", job.pk)  # rolled back when the child is killed past its timeout
    if job.behaviour == "hang":
        pid_file("timed", job.pk).write_text(str(os.getpid()))
        time.sleep(120)
    return Finished()


@worker(name="timed_retry", source=FaultJob, timeout=3, max_attempts=2, retry_backoff=3600,
        eligible=lambda: FaultJob.objects.filter(behaviour="hang_once"))
def timed_retry(job: FaultJob):
    effect("timed_retry", job.pk)
    attempts = Execution.objects.get(worker="timed_retry", source_id=str(job.pk)).attempts
    if attempts == 1:  # the first attempt hangs; the retry finishes
        time.sleep(120)
    return Finished()


@worker(name="recycled", source=FaultJob, concurrency=1, max_tasks_per_child=2,
        eligible=lambda: FaultJob.objects.filter(behaviour="recycle"))
def recycled(job: FaultJob):
    effect("recycled", job.pk)  # records the child's pid
    return Finished()


# The chaos tests' Killer SIGKILLs children every ~0.3 s, most of them mid-handler: those
# crashes are the test's, not the row's. With the default max_crashes (3) and back-off
# (10 s) a row the killer hit three times ended FAILED (quarantined as poison) and the
# test waited for a "finished" that never came; test_poison covers the quarantine.
@worker(name="stress", source=StressJob, concurrency=2, max_crashes=50, retry_backoff=0.2)
def stress(job: StressJob):
    effect("stress", job.pk)  # the business effect, in the run's transaction
    if job.delay:
        time.sleep(job.delay)
    return Finished()


# -- tests/test_flow_control.py: limits shared by every coordinator ------------------------
def keyed_run(name: str, job: KeyedJob | FairJob):
    effect(name, job.pk)  # the business effect, in the run's transaction
    if job.delay:
        time.sleep(job.delay)
    return Finished()


@worker(name="keyed", source=KeyedJob, concurrency=2, key="customer", per_key=1)
def keyed(job: KeyedJob):
    return keyed_run("keyed", job)


@worker(name="keyed_three", source=KeyedJob, concurrency=2, key="customer", per_key=3)
def keyed_three(job: KeyedJob):
    return keyed_run("keyed_three", job)


@worker(name="capped", source=KeyedJob, concurrency=2, total=3)
def capped(job: KeyedJob):
    return keyed_run("capped", job)


# -- tests/test_fair_shares.py: claims take turns across keys --------------------------------
@worker(name="fair", source=FairJob, concurrency=4, key="tenant", fair=True)
def fair(job: FairJob):
    return keyed_run("fair", job)


# (Its eligible() passes every row the tests make: it is there so that fair claims embed one.)
@worker(name="fair_keyed", source=FairJob, concurrency=4, key="tenant", per_key=2, fair=True,
        eligible=lambda: FairJob.objects.filter(delay__lt=100))
def fair_keyed(job: FairJob):
    return keyed_run("fair_keyed", job)


@worker(name="tenant_keyed", source=FairJob, concurrency=4, key="tenant", per_key=1)  # not fair
def tenant_keyed(job: FairJob):
    return keyed_run("tenant_keyed", job)


# -- tests/test_rate_limits.py ---------------------------------------------------------------
@worker(name="rated", source=KeyedJob, concurrency=2, rate="5/2s")
def rated(job: KeyedJob):
    return keyed_run("rated", job)


@worker(name="rated_per_key", source=KeyedJob, concurrency=2, key="customer", rate="2/2s",
        rate_per_key=True)
def rated_per_key(job: KeyedJob):
    return keyed_run("rated_per_key", job)


@worker(name="rated_fast", source=KeyedJob, concurrency=4, rate="50/s")
def rated_fast(job: KeyedJob):
    return keyed_run("rated_fast", job)


@worker(name="multi", source=Stepper, concurrency=1,
        eligible=lambda: Stepper.objects.filter(kind="multi").order_by("id"))
def multi(item: Stepper):
    item.counter += 1
    item.save(update_fields=["counter"])
    return Unfinished() if item.counter < item.steps else Finished()


@worker(name="multi_default_order", source=Stepper, concurrency=2,
        eligible=lambda: Stepper.objects.filter(kind="multi2"))
def multi_default_order(item: Stepper):
    item.counter += 1
    item.save(update_fields=["counter"])
    return Unfinished() if item.counter < item.steps else Finished()


# -- tests/test_tasks.py: a row worker that enqueues a task ------------------------------
@worker(name="enqueuer", source=Author, eligible=lambda: Author.objects.filter(name__startswith="enqueue"))
def enqueuer(author: Author):
    from .tasks import record

    record.enqueue(f"from-author-{author.pk}")
    effect("enqueuer", author.pk)
    if author.name == "enqueue-and-fail":
        raise RuntimeError("the handler fails after enqueueing")
    return Finished()


# -- tests/test_retry_paths.py: a killed child under max_attempts / retry_backoff -------
@worker(name="crash_retry", source=FaultJob, max_attempts=2, retry_backoff=3600,
        eligible=lambda: FaultJob.objects.filter(behaviour="crash_retry"))
def crash_retry(job: FaultJob):
    pid_file("crash_retry", job.pk).write_text(str(os.getpid()))
    os._exit(9)  # the child dies mid-handler, every time


# -- tests/test_reruns.py ------------------------------------------------------------------
@worker(name="rerun_on_change", source=Article, rerun_on=("title", "language"))
def rerun_on_change(article: Article):
    effect("rerun_on_change", f"{article.pk}:{article.title}")
    if article.behaviour.startswith("sleep:"):
        pid_file("rerun_on_change", article.pk).write_text(str(os.getpid()))
        time.sleep(float(article.behaviour.split(":")[1]))
    if article.behaviour == "fail":
        raise ValueError("cannot handle this article")
    article.body = f"handled {article.title}"  # not a listed column: no re-run
    article.save(update_fields=["body"])
    return Finished()


@worker(name="rerun_stale", source=Link, rerun_every=timedelta(seconds=1))
def rerun_stale(link: Link):
    link.checks += 1
    link.save(update_fields=["checks"])
    effect("rerun_stale", f"{link.pk}:{link.checks}")
    return Finished()


@worker(name="retry_later", source=Tag, max_attempts=2, retry_backoff=3600,
        eligible=lambda: Tag.objects.filter(slug__startswith="later"))
def retry_later(tag: Tag):
    effect("retry_later", tag.pk)
    raise RuntimeError("fails; retried an hour later")


# -- tests/test_poison.py: one row that kills its child every time, among many ---------------
@worker(name="poison", source=FaultJob, retry_backoff=0.2,
        eligible=lambda: FaultJob.objects.filter(behaviour__startswith="poison"))
def poison(job: FaultJob):
    if job.behaviour == "poison":
        os._exit(3)
    return Finished()


# -- tests/test_one_clock.py: a coordinator whose host clock is two hours fast -------------
@worker(name="clock", source=FaultJob, max_attempts=2, retry_backoff=0.5,
        eligible=lambda: FaultJob.objects.filter(behaviour__startswith="clock"))
def clock(job: FaultJob):
    from django_dbworker.processes.attempts import current_attempt

    if job.behaviour == "clock_flaky" and current_attempt().number == 1:
        raise RuntimeError("fails once; retried 0.5 s later on the database's clock")
    return Finished()
