"""Rate limits (docs/flow-control.md): RateLog, the claims of the last period of each
rate-limited worker."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('django_dbworker', '0009_task_unique_key'),
    ]

    operations = [
        migrations.CreateModel(
            name='RateLog',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('worker', models.CharField(max_length=100)),
                ('at', models.DateTimeField()),
                ('claimed', models.PositiveIntegerField()),
            ],
            options={
                'verbose_name': 'rate log entry',
                'verbose_name_plural': 'rate log',
                'indexes': [models.Index(fields=['worker', 'at'], name='dbworker_ratelog_at')],
            },
        ),
    ]
