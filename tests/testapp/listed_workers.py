"""A workers module that is not named workers.py: only DBWORKER["WORKER_MODULES"] imports it
(tests/test_guarantees.py::test_worker_modules_replaces_autodiscovery)."""

from django_dbworker import Finished, worker

from .models import Tag


@worker(name="listed_only", source=Tag)
def listed_only(tag: Tag) -> Finished:
    return Finished()
