"""Rate limits and task keys (docs/flow-control.md): RateLog, the claims of the last
period of each rate-limited worker (per key for a rate per key), and Task.flow_key, the
key a @flow_key declaration computes at enqueue."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('django_dbworker', '0009_task_unique_key'),
    ]

    operations = [
        migrations.AddField(
            model_name='task',
            name='flow_key',
            field=models.CharField(blank=True, max_length=255, null=True),
        ),
        migrations.CreateModel(
            name='RateLog',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('worker', models.CharField(max_length=100)),
                ('key', models.CharField(blank=True, max_length=255, null=True)),
                ('at', models.DateTimeField()),
                ('claimed', models.PositiveIntegerField()),
            ],
            options={
                'verbose_name': 'rate log entry',
                'verbose_name_plural': 'rate log',
                'indexes': [models.Index(fields=['worker', 'at'], name='dbworker_ratelog_at'), models.Index(fields=['worker', 'key'], name='dbworker_ratelog_key')],
            },
        ),
    ]
