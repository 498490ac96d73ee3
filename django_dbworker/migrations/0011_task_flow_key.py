"""Per-key limits for task queues (docs/flow-control.md): Task.flow_key, the key a
@flow_key declaration computes at enqueue."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('django_dbworker', '0010_rate_log'),
    ]

    operations = [
        migrations.AddField(
            model_name='task',
            name='flow_key',
            field=models.CharField(blank=True, max_length=255, null=True),
        ),
    ]
