"""The Execution table (and FlowLock, which limited claims lock) as SQLAlchemy Core sees
them: declared from the Django models, so that the child, the admin and the API build
statements without reflecting the tables (the coordinator's claims use the same
columns)."""

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
    return _core_table("Execution")


@cache
def flow_lock_table() -> sa.Table:
    return _core_table("FlowLock")


@cache
def rate_log_table() -> sa.Table:
    return _core_table("RateLog")


@cache
def task_unique_key_table() -> sa.Table:
    return _core_table("TaskUniqueKey")


def _core_table(model_name: str) -> sa.Table:
    # (Looked up, not imported: models.py imports the store for its QuerySet's resets.)
    from django.apps import apps

    model = apps.get_model("django_dbworker", model_name)
    columns = []
    for field in model._meta.concrete_fields:
        kind = field.get_internal_type()  # (a GeneratedField's is its output field's)
        columns.append(sa.Column(field.column, _TYPES.get(kind, sa.String)(),
                                 primary_key=field.primary_key))
    return sa.Table(model._meta.db_table, sa.MetaData(), *columns)
