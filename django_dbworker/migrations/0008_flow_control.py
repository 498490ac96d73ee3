"""Flow control (docs/flow-control.md): Execution.flow_key, the key a WORKING row counts
toward, its index for counting a key's running rows, and FlowLock, the rows claims lock."""

from importlib import import_module

from django.db import migrations, models

# SQLite may copy the table for a new column, which drops the claim indexes migrations
# 0002 and 0003 made with SQL of their own: made again when missing, as 0007 does.
restore_indexes = import_module("django_dbworker.migrations.0007_execution_crashes").restore_indexes


class Migration(migrations.Migration):
    atomic = False  # MySQL cannot run DDL inside a transaction

    dependencies = [
        ('django_dbworker', '0007_execution_crashes'),
    ]

    operations = [
        migrations.RunPython(migrations.RunPython.noop, restore_indexes),
        migrations.CreateModel(
            name='FlowLock',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('worker', models.CharField(max_length=100)),
                ('key', models.CharField(max_length=255)),
            ],
            options={
                'verbose_name': 'flow lock',
            },
        ),
        migrations.AddField(
            model_name='execution',
            name='flow_key',
            field=models.CharField(blank=True, editable=False, max_length=255, null=True),
        ),
        migrations.AddIndex(
            model_name='execution',
            index=models.Index(fields=['worker', 'flow_key', 'status'], name='dbworker_working_key'),
        ),
        migrations.AddConstraint(
            model_name='flowlock',
            constraint=models.UniqueConstraint(fields=('worker', 'key'), name='dbworker_flowlock_key'),
        ),
        migrations.RunPython(restore_indexes, migrations.RunPython.noop),
    ]
