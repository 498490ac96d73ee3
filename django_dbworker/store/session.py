"""Where a transition runs: on the coordinator's SQLAlchemy connection, or on a Django
connection inside the caller's transaction (a child's, with the handler's writes; the
admin's; the API's). Transitions are written once, in SQLAlchemy Core, and run on either.
"""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any, Protocol

import sqlalchemy as sa
from sqlalchemy.engine import URL, Connection

from ..vendors import Vendor, for_connection


@dataclass(frozen=True, slots=True)
class Ran:
    """What a statement did: rows changed, and rows it returned."""

    rowcount: int
    rows: Sequence[Any] = ()


class Session(Protocol):
    """A connection in a transaction (or in autocommit) that runs Core statements."""

    vendor: Vendor

    def run(self, statement: sa.ClauseElement, params: Mapping[str, Any] | None = None,
            shape: Hashable | None = None) -> Ran: ...


class OnEngine:
    """A transition on a connection of the coordinator's engine."""

    def __init__(self, connection: Connection, vendor: Vendor) -> None:
        self.connection, self.vendor = connection, vendor

    def run(self, statement: sa.ClauseElement, params: Mapping[str, Any] | None = None,
            shape: Hashable | None = None) -> Ran:
        # (SQLAlchemy keeps compiled statements itself, by their shape.)
        result = self.connection.execute(statement, dict(params or {}))  # type: ignore[call-overload]
        rows = result.all() if result.returns_rows else ()
        return Ran(result.rowcount if not result.returns_rows else len(rows), rows)


class OnDjango:
    """A transition on Django's connection ``alias``, in whatever transaction it is in:
    it commits or rolls back with the caller's own writes. The statement is compiled by
    the SQLAlchemy dialect of the same database, with named parameters, which Django's
    cursor passes to the driver (and turns into SQLite's own style)."""

    def __init__(self, alias: str) -> None:
        from django.db import connections

        self.alias = alias
        self.vendor = for_connection(connections[alias])

    def run(self, statement: sa.ClauseElement, params: Mapping[str, Any] | None = None,
            shape: Hashable | None = None) -> Ran:
        """``params``: the values of the statement's named parameters; ``shape``: a key
        that names the statement's text, so its compiled form is kept (the child's
        outcomes: compiling took longer than running)."""
        from django.db import connections

        driver = self.vendor.sqlalchemy_driver
        compiled: Any = None if shape is None else _COMPILED.get((driver, shape))
        if compiled is None:
            compiled = statement.compile(dialect=_dialect(driver),
                                         compile_kwargs={"render_postcompile": shape is None})
            if shape is not None:
                if len(_COMPILED) >= COMPILED_CACHE_SIZE:
                    _COMPILED.clear()
                _COMPILED[driver, shape] = compiled
        with connections[self.alias].cursor() as cursor:
            cursor.execute(compiled.string, compiled.construct_params(params))
            if not cursor.description:
                return Ran(cursor.rowcount)
            named = _row_type(tuple(column[0] for column in cursor.description))
            rows = [named._make(r) for r in cursor.fetchall()]
            return Ran(len(rows), rows)


# OnDjango's compiled statements, by (driver, shape): a few shapes (an outcome, the rows
# of a group); emptied if it ever grows past this.
COMPILED_CACHE_SIZE = 500
_COMPILED: dict[tuple[str, Hashable], Any] = {}


@cache
def _row_type(names: tuple[str, ...]) -> Any:
    """Rows read by name, as SQLAlchemy's are."""
    return namedtuple("Row", names, rename=True)


@cache
def _dialect(driver: str) -> sa.engine.Dialect:
    # Named parameters (%(name)s) for every database: only values that need no
    # conversion are bound (numbers, text, booleans); times are the database's own.
    return URL.create(driver).get_dialect()(paramstyle="pyformat")  # type: ignore[call-arg]
