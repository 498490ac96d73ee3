"""Fair shares (docs/flow-control.md): the claimable rows of each key, by index. A fair
claim walks the keys of a worker's claimable rows (one index probe per key) and takes
each key's first rows (by priority, then creation), so a key with one row is reached
however long another key's backlog is. Partial, as the claimable index is: only
claimable rows are in it."""

from django.db import migrations

INDEX = "dbworker_claimable_key"


def _vendor(schema_editor):
    from django_dbworker.vendors import VENDORS

    cls = VENDORS.get(schema_editor.connection.vendor)
    return None if cls is None else cls(schema_editor.connection)


def _table(apps, schema_editor):
    return schema_editor.quote_name(apps.get_model("django_dbworker", "Execution")._meta.db_table)


def create(apps, schema_editor):
    vendor = _vendor(schema_editor)
    if vendor is not None:
        schema_editor.execute(vendor.partial_index_sql(
            INDEX, _table(apps, schema_editor), "claimable_worker, flow_key, priority DESC, id",
            "claimable_worker"))


def drop(apps, schema_editor):
    vendor = _vendor(schema_editor)
    if vendor is not None:
        schema_editor.execute(vendor.drop_index_sql(INDEX, _table(apps, schema_editor)))


class Migration(migrations.Migration):
    atomic = False  # MySQL cannot run DDL inside a transaction
    dependencies = [("django_dbworker", "0010_rates_and_task_keys")]
    operations = [migrations.RunPython(create, drop)]
