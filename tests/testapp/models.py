import uuid

from django.db import models


class Author(models.Model):
    name = models.CharField(max_length=100)
    rank = models.IntegerField(default=0)


class Document(models.Model):
    """Rows become work for the `docs` worker; `behaviour` tells the handler what to do."""

    title = models.CharField(max_length=100, default="")
    behaviour = models.CharField(max_length=30, default="ok")
    uploaded = models.BooleanField(default=True)
    priority = models.IntegerField(null=True)
    author = models.ForeignKey(Author, null=True, on_delete=models.SET_NULL)
    steps = models.IntegerField(default=0)
    text = models.TextField(default="")


class UuidItem(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4)
    name = models.CharField(max_length=50, default="")


class Tag(models.Model):
    slug = models.CharField(primary_key=True, max_length=50)


class Effect(models.Model):
    """A business effect: one row per handler run that committed."""

    worker = models.CharField(max_length=50)
    source_id = models.CharField(max_length=64)
    pid = models.IntegerField(default=0)


class FaultJob(models.Model):
    """Rows for tests/test_faults.py: handlers past their timeout, recycled children."""

    behaviour = models.CharField(max_length=30, default="ok")


class StressJob(models.Model):
    """Rows for tests/test_stress.py and the database-restart test: the `stress` handler
    sleeps `delay` seconds inside its transaction, then records its business effect."""

    delay = models.FloatField(default=0.0)
