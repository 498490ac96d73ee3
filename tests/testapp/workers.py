"""Workers the tests drive. Behaviour is data-driven (children import these by name)."""

import os
import re
import tempfile
import time
from pathlib import Path

from django.db import transaction

from django_dbworker import ExecutionStatus, Finished, Unfinished, has_execution_status, worker
from django_dbworker.models import Execution

from .models import Document, Effect, FaultJob, StressJob, Tag, UuidItem


def effect(name: str, key) -> None:
    Effect.objects.create(worker=name, source_id=str(key), pid=os.getpid())


@worker(name="docs", source=Document, concurrency=2,
        eligible=lambda: Document.objects.filter(uploaded=True))
def handle_document(doc: Document):
    b = doc.behaviour
    if b.startswith("sleep:"):
        pid_file("docs", doc.pk).write_text(str(os.getpid()))  # "the handler is running"
        time.sleep(float(b.split(":")[1]))
    if b == "fail":
        effect("docs", doc.pk)  # rolled back with the failure
        raise ValueError(f"cannot handle document {doc.pk}")
    if b == "commit":
        effect("docs", doc.pk)
        transaction.commit()
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


@worker(name="uuids", source=UuidItem)
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

def pid_file(worker_name: str, key) -> Path:
    """Where a handler leaves its pid outside the database (it survives a rollback)."""
    from django.db import connection

    database = re.sub(r"\W+", "_", str(connection.settings_dict["NAME"]))
    return Path(tempfile.gettempdir()) / f"dbworker-{database}-{worker_name}-{key}.pid"


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


@worker(name="stress", source=StressJob, concurrency=2)
def stress(job: StressJob):
    effect("stress", job.pk)  # the business effect, in the run's transaction
    if job.delay:
        time.sleep(job.delay)
    return Finished()
