"""The Execution table as SQLAlchemy Core sees it: declared from the Django model, so
that the child, the admin and the API build statements without reflecting the table
(the coordinator's claims use the same columns)."""

from __future__ import annotations

from functools import cache
from typing import Any

import sqlalchemy as sa

# Django field types and the Core types statements need (for literals and results).
_TYPES: dict[str, type[sa.types.TypeEngine[Any]]] = {
    "AutoField": sa.Integer, "BigAutoField": sa.BigInteger, "IntegerField": sa.Integer,
    "PositiveIntegerField": sa.Integer, "SmallIntegerField": sa.SmallInteger,
    "BooleanField": sa.Boolean, "DateTimeField": sa.DateTime, "TextField": sa.Text,
}


@cache
def execution_table() -> sa.Table:
    # (Looked up, not imported: models.py imports the store for its QuerySet's resets.)
    from django.apps import apps

    Execution = apps.get_model("django_dbworker", "Execution")
    columns = []
    for field in Execution._meta.concrete_fields:
        kind = field.get_internal_type()  # (a GeneratedField's is its output field's)
        columns.append(sa.Column(field.column, _TYPES.get(kind, sa.String)(),
                                 primary_key=field.primary_key))
    return sa.Table(Execution._meta.db_table, sa.MetaData(), *columns)
