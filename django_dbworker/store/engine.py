"""The coordinator's connections: a SQLAlchemy engine on the server and credentials of a
DATABASES entry, a statement run raw on the driver where SQLAlchemy's own execution cost
as much as the database's answer, and the one shape of transaction every database gives.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from django.db import connections
from sqlalchemy.engine import URL, Connection, Engine

from .. import conf
from ..vendors import Vendor, for_connection

# Django-only keys of DATABASES[...]["OPTIONS"] that database drivers do not accept.
DJANGO_ONLY_OPTIONS = {
    "isolation_level", "server_side_binding", "pool", "assume_role", "transaction_mode",
    "init_command", "timeout",
}
DATABASE_ERRORS = (sa.exc.DBAPIError, sa.exc.OperationalError, OSError)


def as_datetime(value: Any) -> datetime:
    """A database timestamp as a naive UTC datetime (SQLite's clock comes back as text)."""
    if not isinstance(value, datetime):
        value = datetime.fromisoformat(str(value))
    return value.replace(tzinfo=None) if value.tzinfo is None else (
        value.astimezone(UTC).replace(tzinfo=None))


def epoch(value: Any) -> float | None:
    return None if value is None else as_datetime(value).replace(tzinfo=UTC).timestamp()


def new_token() -> str:
    return secrets.token_hex(16)


# The coordinator's threads share this pool (system check E014 keeps it large enough).
POOL_DEFAULTS = {"pool_size": 2, "max_overflow": 4}


def engine_for(alias: str, lease_seconds: float | None = None, **options: Any) -> Engine:
    """A SQLAlchemy engine on the same server and credentials as DATABASES[alias]."""
    connection = connections[alias]
    vendor = for_connection(connection)
    sd = connection.settings_dict
    given = {k: v for k, v in (sd.get("OPTIONS") or {}).items() if k not in DJANGO_ONLY_OPTIONS}
    kwargs: dict[str, Any] = {
        **POOL_DEFAULTS,
        # No pre-ping: it would add a round trip to every claim. A connection that broke
        # fails its statement instead; it is discarded (SQLAlchemy discards the pool's
        # connections; a claim's, see _run_raw, its own) and the coordinator's outage
        # handling takes over.
        # No rollback when a connection goes back to the pool: every use ends its own
        # transaction (engine.begin() commits or rolls back), and after a database
        # restart that rollback only fails noisily on a dead socket.
        "pool_reset_on_return": None,
        "connect_args": vendor.connect_args(given),
        **vendor.engine_options(sd),
    }
    kwargs.update(conf.value("ENGINE_OPTIONS") or {})
    kwargs.update(options)
    engine = sa.create_engine(URL.create(vendor.sqlalchemy_driver, **vendor.url_parts(sd)),
                              **kwargs)
    lease = float(conf.value("LEASE_SECONDS") if lease_seconds is None else lease_seconds)
    sa.event.listen(engine, "connect", lambda dbapi, record: vendor.on_connect(dbapi, lease))
    settings = vendor.transaction_settings(lease)
    if settings is not None:  # (a listener only where needed: it runs on every claim)
        sa.event.listen(engine, "begin", lambda conn: _set_locally(conn, *settings))
    return engine


def _set_locally(conn: Connection, sql: str, params: tuple[Any, ...]) -> None:
    # SET LOCAL lives in a transaction block: a connection in autocommit (a claim that
    # is one statement) has none, and holds no lock between statements anyway.
    if not conn.connection.dbapi_connection.autocommit:  # type: ignore[union-attr]
        conn.exec_driver_sql(sql, params)


_BIND_COLON = re.compile(r"(?<![:\w\\]):(?=\w)")
_DJANGO_PARAM = re.compile(r"%%|%s")


def django_sql_to_text(sql: str, params: Sequence[Any], prefix: str = "dbw_p") -> sa.TextClause:
    """Django's compiled SQL (``%s`` placeholders) as a SQLAlchemy ``text()``."""
    sql = _BIND_COLON.sub(r"\\:", sql)  # a literal ':x' must not become a bind parameter
    binds: dict[str, Any] = {}

    def replace(match: re.Match[str]) -> str:
        if match.group() == "%%":
            return "%"
        name = f"{prefix}{len(binds)}"
        binds[name] = params[len(binds)]
        return f":{name}"

    converted = _DJANGO_PARAM.sub(replace, sql)
    clause = sa.text(converted)
    return clause.bindparams(*[sa.bindparam(k, v) for k, v in binds.items()]) if binds else clause



@contextmanager
def writing(engine: Engine, vendor: Vendor) -> Iterator[Connection]:
    """One transaction for statements that must commit together, on every database:
    where the engine commits each statement (SQLite), BEGIN IMMEDIATE takes the write
    lock first and COMMIT ends it."""
    if not vendor.autocommit_engine:
        with engine.begin() as conn:
            yield conn
        return
    with engine.connect() as conn:
        conn.exec_driver_sql("BEGIN IMMEDIATE")
        try:
            yield conn
            conn.exec_driver_sql("COMMIT")
        except BaseException:
            conn.exec_driver_sql("ROLLBACK")
            raise
