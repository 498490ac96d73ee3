"""A project's own subclass of the task backend (tests/test_tasks.py names its path in
TASKS): its queues are registered and run like the backend's own."""

from django_dbworker.tasks.backend import DatabaseBackend


class SubclassedBackend(DatabaseBackend):
    pass
