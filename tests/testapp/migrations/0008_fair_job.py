from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('testapp', '0007_keyed_job'),
    ]

    operations = [
        migrations.CreateModel(
            name='FairJob',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('tenant', models.IntegerField(null=True)),
                ('delay', models.FloatField(default=0.0)),
            ],
        ),
    ]
