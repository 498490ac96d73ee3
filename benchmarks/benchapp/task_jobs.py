"""The job as a django.tasks task: enqueued on our backend ("default") or, with
.using(backend="tasksdb"), on django-tasks-db. `system` names the Effect rows."""

from __future__ import annotations

from django.tasks import task

from .job import run_job


@task(queue_name="bench")
def handle_job(job_id: int, system: str) -> None:
    run_job(system, job_id)
