from __future__ import annotations

from django.db import models


class Upload(models.Model):
    """An uploaded text file. Saving one is all it takes to queue work for it."""

    name = models.CharField(max_length=200, unique=True)
    content = models.TextField(blank=True)
    uploaded_at = models.DateTimeField(auto_now_add=True)

    # Written by the "analyze" worker, one step per run (see workers.py).
    steps_done = models.PositiveSmallIntegerField(default=0)
    checksum = models.CharField(max_length=64, blank=True)
    word_count = models.PositiveIntegerField(null=True, blank=True)
    language = models.CharField(max_length=20, blank=True)

    # Written by the "summarize" worker, once "analyze" has finished the row.
    summary = models.CharField(max_length=200, blank=True)

    class Meta:
        ordering = ["id"]

    def __str__(self) -> str:
        return self.name
