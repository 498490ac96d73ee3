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


class KeyedJob(models.Model):
    """Rows for tests/test_flow_control.py: the `keyed*` and `capped` handlers sleep
    `delay` seconds inside their transaction, then record their business effect. Rows
    with the same `customer` share a per-key limit."""

    customer = models.IntegerField(null=True)
    delay = models.FloatField(default=0.0)


class FairJob(models.Model):
    """Rows for tests/test_fair_shares.py: the `fair` and `fair_keyed` workers take turns
    across `tenant`; their handlers sleep `delay` seconds, then record their effect. A
    table of its own, so its backlogs of 100,000 rows make no rows for other workers."""

    tenant = models.IntegerField(null=True)
    delay = models.FloatField(default=0.0)


class Stepper(models.Model):
    """Rows for the drain tests: the `multi` handler adds one to `counter` per run and
    returns Unfinished() until it reaches `steps`."""

    kind = models.CharField(max_length=20, default="multi")
    counter = models.IntegerField(default=0)
    steps = models.IntegerField(default=1)


class Article(models.Model):
    """Rows for tests/test_reruns.py: the `rerun_on_change` worker re-runs an article when
    its title or language changes."""

    title = models.CharField(max_length=100, default="")
    language = models.CharField(max_length=10, null=True)
    body = models.TextField(default="")
    behaviour = models.CharField(max_length=30, default="ok")


class Link(models.Model):
    """Rows for tests/test_reruns.py: the `rerun_stale` worker checks a link again a
    second after it last did."""

    url = models.CharField(max_length=200)
    checks = models.IntegerField(default=0)


class SignalSeen(models.Model):
    """A signal a receiver of tests/testapp/signals.py got: which, for what, in which process."""

    kind = models.CharField(max_length=50)
    key = models.CharField(max_length=100)
    pid = models.IntegerField()


# tests/test_hostile_names.py: names that end an identifier or a string early wherever
# they reach SQL unquoted. Hostile: quotes, a backslash (an escape on MySQL), a semicolon,
# a comment and PostgreSQL's function-body quote, as Django itself can create them (its
# quote_name doubles nothing, so neither holds the database's own identifier quote).
HOSTILE_TABLE = "dbw o'brien\\; DROP--$f$"
HOSTILE_COLUMN = "it's\\;--$f$ x"
# ... and with every database's identifier quote too (" and `): Django cannot create or
# query that table, so the test does, with the vendor's quoting.
QUOTED_TABLE = "weird\"; DROP--`o'brien\\"
QUOTED_COLUMN = "ti\"t`le's\\"


class Hostile(models.Model):
    title = models.CharField(max_length=100, default="", db_column=HOSTILE_COLUMN)

    class Meta:
        db_table = HOSTILE_TABLE


class HostileQuoted(models.Model):
    title = models.CharField(max_length=100, default="", db_column=QUOTED_COLUMN)

    class Meta:
        db_table = QUOTED_TABLE
        managed = False
