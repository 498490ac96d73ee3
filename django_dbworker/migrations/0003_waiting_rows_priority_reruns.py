"""Claimable rows split from rows that wait for a due time; priority; re-run bookkeeping;
an exact record of the triggers this app installs; the coordinators' PID namespaces."""

import django.utils.timezone
from django.db import migrations, models

from django_dbworker.vendors import VENDORS

# (name, columns, the generated column whose NULLs the index leaves out)
INDEXES = [
    ("dbworker_claimable", "claimable_worker, id", "claimable_worker"),
    ("dbworker_claimable_priority", "claimable_worker, priority DESC, id", "claimable_worker"),
    ("dbworker_waiting", "waiting_worker, next_attempt_at", "waiting_worker"),
]
CLAIMABLE = ["pending", "unfinished"]
WAITING = ["pending", "unfinished", "finished"]


def _indexes(names):
    def run(apps, schema_editor):
        vendor_cls = VENDORS.get(schema_editor.connection.vendor)
        if vendor_cls is None:
            return
        vendor = vendor_cls(schema_editor.connection)
        table = schema_editor.quote_name(apps.get_model("django_dbworker", "Execution")._meta.db_table)
        for name, columns, where in INDEXES:
            if name in names:
                schema_editor.execute(vendor.partial_index_sql(name, table, columns, where))
    return run


def _drop(names):
    def run(apps, schema_editor):
        vendor_cls = VENDORS.get(schema_editor.connection.vendor)
        if vendor_cls is None:
            return
        vendor = vendor_cls(schema_editor.connection)
        table = schema_editor.quote_name(apps.get_model("django_dbworker", "Execution")._meta.db_table)
        for name in names:
            schema_editor.execute(vendor.drop_index_sql(name, table))
    return run


def generated(statuses, due_is_null):
    return models.GeneratedField(
        db_persist=True,
        expression=models.Case(
            models.When(models.Q(status__in=statuses) & models.Q(next_attempt_at__isnull=due_is_null),
                        then=models.F("worker")),
            default=models.Value(None)),
        output_field=models.CharField(max_length=100, null=True))


class Migration(migrations.Migration):
    atomic = False  # MySQL cannot run DDL inside a transaction
    dependencies = [("django_dbworker", "0002_claimable_index")]

    operations = [
        migrations.RunPython(_drop(["dbworker_claimable"]), _indexes(["dbworker_claimable"])),
        migrations.RemoveField("execution", "claimable_worker"),
        migrations.AddField("execution", "claimable_worker", generated(CLAIMABLE, True)),
        migrations.AddField("execution", "waiting_worker", generated(WAITING, False)),
        migrations.AddField("execution", "priority", models.SmallIntegerField(default=0)),
        migrations.AddField("execution", "rerun_requested", models.BooleanField(default=False)),
        migrations.AddField("execution", "rerun_reason",
                            models.CharField(blank=True, max_length=255, null=True)),
        migrations.AddField("execution", "ready_at", models.DateTimeField(blank=True, null=True)),
        migrations.RunPython(_indexes([name for name, _, _ in INDEXES]),
                             _drop([name for name, _, _ in INDEXES])),
        migrations.AddField("coordinatorheartbeat", "namespace",
                            models.CharField(blank=True, default="", max_length=255)),
        migrations.CreateModel(
            name="InstalledTrigger",
            fields=[
                ("name", models.CharField(max_length=64, primary_key=True, serialize=False)),
                ("table", models.CharField(max_length=255)),
                ("worker", models.CharField(max_length=100)),
                ("installed_at", models.DateTimeField(default=django.utils.timezone.now)),
            ],
            options={"verbose_name": "installed trigger"},
        ),
    ]
