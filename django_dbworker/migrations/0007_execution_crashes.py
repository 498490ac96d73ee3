"""Execution.crashes: how many times in a row a row's process died while it ran."""

from django.db import migrations, models

from django_dbworker.vendors import VENDORS

# The partial indexes migrations 0002 and 0003 made with SQL of their own (Django does not
# know them). SQLite adds a NOT NULL column by copying the table, which drops them: they
# are made again here when missing.
INDEXES = [
    ("dbworker_claimable", "claimable_worker, id", "claimable_worker"),
    ("dbworker_claimable_priority", "claimable_worker, priority DESC, id", "claimable_worker"),
    ("dbworker_waiting", "waiting_worker, next_attempt_at", "waiting_worker"),
]


def restore_indexes(apps, schema_editor):
    vendor_cls = VENDORS.get(schema_editor.connection.vendor)
    if vendor_cls is None:
        return
    vendor = vendor_cls(schema_editor.connection)
    db_table = apps.get_model("django_dbworker", "Execution")._meta.db_table
    with schema_editor.connection.cursor() as cursor:
        present = schema_editor.connection.introspection.get_constraints(cursor, db_table)
    for name, columns, where in INDEXES:
        if name not in present:
            schema_editor.execute(vendor.partial_index_sql(
                name, schema_editor.quote_name(db_table), columns, where))


class Migration(migrations.Migration):
    atomic = False  # MySQL cannot run DDL inside a transaction

    dependencies = [
        ('django_dbworker', '0006_pauses_and_finished_index'),
    ]

    operations = [
        # (Unapplied: the column goes, by a copy of the table on SQLite; then the indexes
        # come back.)
        migrations.RunPython(migrations.RunPython.noop, restore_indexes),
        migrations.AddField(
            model_name='execution',
            name='crashes',
            field=models.PositiveIntegerField(db_default=0, default=0),
        ),
        migrations.RunPython(restore_indexes, migrations.RunPython.noop),
    ]
