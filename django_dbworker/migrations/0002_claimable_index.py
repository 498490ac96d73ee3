from django.db import migrations

from django_dbworker.vendors import VENDORS

INDEX = "dbworker_claimable"


def _vendor(schema_editor):
    cls = VENDORS.get(schema_editor.connection.vendor)
    return None if cls is None else cls(schema_editor.connection)


def create(apps, schema_editor):
    vendor = _vendor(schema_editor)
    if vendor is None:
        return
    table = schema_editor.quote_name(apps.get_model("django_dbworker", "Execution")._meta.db_table)
    schema_editor.execute(vendor.partial_index_sql(INDEX, table, "claimable_worker, id",
                                                   "claimable_worker"))


def drop(apps, schema_editor):
    vendor = _vendor(schema_editor)
    if vendor is None:
        return
    table = schema_editor.quote_name(apps.get_model("django_dbworker", "Execution")._meta.db_table)
    schema_editor.execute(vendor.drop_index_sql(INDEX, table))


class Migration(migrations.Migration):
    atomic = False  # MySQL cannot run DDL inside a transaction
    dependencies = [("django_dbworker", "0001_initial")]
    operations = [migrations.RunPython(create, drop)]
