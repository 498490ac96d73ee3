"""Everything that differs between PostgreSQL, MySQL/MariaDB and SQLite, chosen once.

``for_connection(connection)`` picks the class (one module per database); nothing else in
the package tests which database it talks to. A new database is one new module here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .base import (
    ANY_WORKER_NOTICE,
    EXECUTION_TABLE,
    NOTIFY_CHANNEL,
    PAUSE_NOTICE,
    TRIGGER_NAME,
    Bound,
    TriggerNames,
    TriggerSource,
    UnsupportedDatabase,
    Vendor,
    driver_error,
    error_code,
)
from .mysql import MariaDB, MySQL
from .postgresql import PostgreSQL
from .sqlite import SQLite

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper

__all__ = [
    "ANY_WORKER_NOTICE", "EXECUTION_TABLE", "NOTIFY_CHANNEL", "PAUSE_NOTICE", "TRIGGER_NAME",
    "VENDORS", "Bound", "MariaDB", "MySQL", "PostgreSQL",
    "SQLite", "TriggerNames", "TriggerSource", "UnsupportedDatabase", "Vendor",
    "driver_error", "error_code", "for_connection", "for_engine", "prepare_child_settings",
]

VENDORS: dict[str, type[Vendor]] = {
    "postgresql": PostgreSQL,
    "mysql": MySQL,
    "sqlite": SQLite,
}
# The last part of a DATABASES ENGINE path, for the system checks (which do not connect).
ENGINES = {"postgresql": PostgreSQL, "postgis": PostgreSQL, "mysql": MySQL,
           "sqlite3": SQLite, "spatialite": SQLite}


def for_connection(connection: BaseDatabaseWrapper) -> Vendor:
    try:
        cls = VENDORS[connection.vendor]
    except KeyError:
        raise UnsupportedDatabase(
            f"The {connection.vendor!r} database backend is not supported: use PostgreSQL "
            "13+, MySQL 8.0.1+, MariaDB 10.6+ or a file-backed SQLite."
        ) from None
    if cls is MySQL and _is_mariadb(connection):
        cls = MariaDB  # (Django's one backend serves both)
    return cls(connection)


def _is_mariadb(connection: BaseDatabaseWrapper) -> bool:
    """Asks the server (Django caches its answer). A server that cannot be reached yet
    gets the family's common vendor: asked before the coordinator waits for its database,
    the question must not fail; every call once it is up gets the exact one."""
    from django.db import DatabaseError

    try:
        return bool(connection.mysql_is_mariadb)  # type: ignore[attr-defined]
    except DatabaseError:
        return False


def for_engine(engine: str) -> type[Vendor] | None:
    """The vendor of a DATABASES ENGINE path, or None when it is not supported."""
    return ENGINES.get(engine.rsplit(".", 1)[-1])


def prepare_child_settings(settings_dict: dict[str, Any]) -> None:
    """Adjust a child's DATABASES entry (its vendor's defaults) before it connects."""
    cls = for_engine(str(settings_dict.get("ENGINE", "")))
    if cls is not None:
        cls.prepare_child_settings(settings_dict)
