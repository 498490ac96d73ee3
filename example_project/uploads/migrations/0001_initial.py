from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True

    dependencies = []

    operations = [
        migrations.CreateModel(
            name="Upload",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False,
                                           verbose_name="ID")),
                ("name", models.CharField(max_length=200, unique=True)),
                ("content", models.TextField(blank=True)),
                ("uploaded_at", models.DateTimeField(auto_now_add=True)),
                ("steps_done", models.PositiveSmallIntegerField(default=0)),
                ("checksum", models.CharField(blank=True, max_length=64)),
                ("word_count", models.PositiveIntegerField(blank=True, null=True)),
                ("language", models.CharField(blank=True, max_length=20)),
                ("summary", models.CharField(blank=True, max_length=200)),
            ],
            options={"ordering": ["id"]},
        ),
    ]
