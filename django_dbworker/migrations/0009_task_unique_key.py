"""Unique task keys (docs/tasks.md): TaskUniqueKey, the row an enqueue of a @unique
task inserts when missing and locks, naming the task that holds the key."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('django_dbworker', '0008_flow_control'),
    ]

    operations = [
        migrations.CreateModel(
            name='TaskUniqueKey',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('backend', models.CharField(max_length=32)),
                ('task_path', models.CharField(max_length=255)),
                ('key', models.CharField(max_length=255)),
                ('task_id', models.UUIDField(blank=True, null=True)),
            ],
            options={
                'verbose_name': 'task unique key',
                'constraints': [models.UniqueConstraint(fields=('backend', 'task_path', 'key'), name='dbworker_task_unique_key')],
            },
        ),
    ]
