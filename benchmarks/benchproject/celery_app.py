"""The Celery side of the comparison: Redis broker, tasks in benchapp.tasks."""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "benchproject.settings")

app = Celery("benchproject", include=["benchapp.tasks"])
app.config_from_object("django.conf:settings", namespace="CELERY")
