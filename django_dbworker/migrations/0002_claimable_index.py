from django.db import migrations

from django_dbworker.vendors import VENDORS

INDEX = "dbworker_claimable"


def create(apps, schema_editor):
    vendor = VENDORS.get(schema_editor.connection.vendor)
    if vendor is None:
        return
    table = apps.get_model("django_dbworker", "Execution")._meta.db_table
    schema_editor.execute(vendor.claimable_index_sql(INDEX, schema_editor.quote_name(table)))


def drop(apps, schema_editor):
    table = apps.get_model("django_dbworker", "Execution")._meta.db_table
    if schema_editor.connection.vendor == "mysql":
        schema_editor.execute(f"DROP INDEX {INDEX} ON {schema_editor.quote_name(table)}")
    else:
        schema_editor.execute(f"DROP INDEX IF EXISTS {INDEX}")


class Migration(migrations.Migration):
    atomic = False  # MySQL cannot run DDL inside a transaction
    dependencies = [("django_dbworker", "0001_initial")]
    operations = [migrations.RunPython(create, drop)]
