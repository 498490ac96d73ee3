"""The app config: discovers workers when Django starts, and installs their triggers
after ``migrate``."""

from __future__ import annotations

from django.apps import AppConfig
from django.db.models.signals import post_migrate


class DBWorkerConfig(AppConfig):
    name = "django_dbworker"
    verbose_name = "Background work"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import checks  # noqa: F401  (registers the system checks)
        from .installation.triggers import install_after_migrate
        from .registration.discovery import discover_workers

        discover_workers()
        from .tasks.queues import backends, register_queues

        if any(True for _ in backends()):
            register_queues()  # a worker per queue of each DatabaseBackend in TASKS
        # After every migrate: triggers for each registered worker, backfill, clean-up.
        post_migrate.connect(install_after_migrate, sender=self)
