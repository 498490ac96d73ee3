"""The example's background work: two workers on the same model.

``analyze`` works in three steps, one per run, returning ``Unfinished()`` until the last
one; ``summarize`` waits until ``analyze`` has finished a row. Each run happens in a child
process inside ``transaction.atomic()``: its writes and the new status commit together.
"""

from __future__ import annotations

import hashlib
import time

from django.conf import settings

from django_dbworker import (
    ExecutionStatus,
    Finished,
    Outcome,
    Unfinished,
    has_execution_status,
    worker,
)

from .models import Upload

STEPS = ("checksum", "count_words", "detect_language")


def pretend_to_work() -> None:
    if settings.DEMO_STEP_SECONDS:
        time.sleep(settings.DEMO_STEP_SECONDS)


@worker(name="analyze", source=Upload, concurrency=2)
def analyze(upload: Upload) -> Outcome:
    """One step per run; Unfinished() brings the row back for the next step."""
    pretend_to_work()
    if "broken" in upload.name:
        # Any exception: the run's writes roll back and the row becomes FAILED with the
        # error recorded. It stays FAILED until someone resets it (admin or reset_failed).
        raise ValueError(f"{upload.name}: cannot decode the file")
    step = STEPS[upload.steps_done]
    if step == "checksum":
        upload.checksum = hashlib.sha256(upload.content.encode()).hexdigest()
    elif step == "count_words":
        upload.word_count = len(upload.content.split())
    else:
        upload.language = "en" if " the " in f" {upload.content.lower()} " else "unknown"
    upload.steps_done += 1
    upload.save(update_fields=["checksum", "word_count", "language", "steps_done"])
    return Finished() if upload.steps_done == len(STEPS) else Unfinished()


@worker(
    name="summarize",
    source=Upload,
    # A dependent worker: only rows that "analyze" has finished are eligible. The
    # expression is SQL; eligible() runs in the coordinator before every claim.
    eligible=lambda: Upload.objects.filter(
        has_execution_status("analyze", ExecutionStatus.FINISHED)
    ).order_by("uploaded_at"),
)
def summarize(upload: Upload) -> Finished:
    pretend_to_work()
    words = upload.content.split()
    upload.summary = " ".join(words[:8]) + (" ..." if len(words) > 8 else "")
    upload.save(update_fields=["summary"])
    return Finished()
