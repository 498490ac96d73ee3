from django.db import migrations

INDEX = "dbworker_claimable_mysql"


def create(apps, schema_editor):
    # MySQL/MariaDB have no partial indexes (Django skips the conditional one there), so
    # they get a plain index on the same columns: the claimable rows are exactly those
    # with a non-NULL claimable_worker, and a claim reads only that range of it.
    if schema_editor.connection.vendor != "mysql":
        return
    table = schema_editor.quote_name(apps.get_model("django_dbworker", "Execution")._meta.db_table)
    schema_editor.execute(f"CREATE INDEX {INDEX} ON {table} (claimable_worker, id)")


def drop(apps, schema_editor):
    if schema_editor.connection.vendor != "mysql":
        return
    table = schema_editor.quote_name(apps.get_model("django_dbworker", "Execution")._meta.db_table)
    schema_editor.execute(f"DROP INDEX {INDEX} ON {table}")


class Migration(migrations.Migration):
    atomic = False  # MySQL cannot run DDL inside a transaction
    dependencies = [("django_dbworker", "0001_initial")]
    operations = [migrations.RunPython(create, drop)]
