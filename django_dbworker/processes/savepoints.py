"""What wraps one handler in the child's transaction, with as few round trips as is safe.

A handler must leave the transaction it runs in open: a raw ``ROLLBACK`` or ``COMMIT``, an
implicit commit (DDL on MySQL), or a database error it catches (which aborts a PostgreSQL
transaction) would otherwise let its row be recorded as finished while its writes are gone.
``transaction.atomic()`` notices this at its RELEASE SAVEPOINT, which fails. Where the
driver tells, without asking the server, whether the transaction is still open and sound
(psycopg's transaction status, sqlite3's ``in_transaction``), the child asks it instead and
spares the round trips: a group's handler keeps its savepoint rather than releasing it,
and a row alone runs with no savepoint at all. mysqlclient cannot tell, so on MySQL and
MariaDB every handler runs in ``atomic()``, release included.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from django.db import DatabaseError, Error, connections, transaction

from ..vendors import for_connection


def handler_block(alias: str, *, grouped: bool) -> AbstractContextManager[Any]:
    """The block one handler runs in: ``grouped`` (other rows share the transaction) gets
    a savepoint to roll back to, a row alone needs none (its transaction is its own)."""
    if not for_connection(connections[alias]).tells_transaction_state:
        return transaction.atomic(using=alias)  # its RELEASE is the check
    return kept_savepoint(alias) if grouped else _transaction_checked(alias)


@contextmanager
def kept_savepoint(alias: str) -> Iterator[None]:
    """What ``transaction.atomic()`` nested in a transaction does, less the RELEASE
    SAVEPOINT after a block that succeeds: one round trip fewer per row of a group. The
    savepoint stays open until the group's transaction ends, which frees it anyway.

    On an exception, after ``transaction.set_rollback(True)`` inside, or when the block
    left the transaction ended or aborted, it rolls back to the savepoint, which also
    drops the on_commit() callbacks registered inside. When it cannot (the transaction is
    gone), the transaction is marked for rollback, as atomic() marks it."""
    connection: Any = connections[alias]
    sid = connection.savepoint() if not connection.needs_rollback else None
    # Listed as atomic() lists its own: on_commit() tags callbacks with the open savepoints.
    connection.savepoint_ids.append(sid)
    try:
        yield
        _left_open(alias)
    except BaseException:
        connection.savepoint_ids.pop()
        _roll_back_to(connection, sid)
        raise
    connection.savepoint_ids.pop()
    if connection.needs_rollback:
        _roll_back_to(connection, sid)


@contextmanager
def _transaction_checked(alias: str) -> Iterator[None]:
    yield
    _left_open(alias)


def _left_open(alias: str) -> None:
    """After a handler returned: unless it asked for a rollback, its transaction must be
    open and sound."""
    if not connections[alias].needs_rollback:
        require_open_transaction(alias)


def require_open_transaction(alias: str) -> None:
    """Raise DatabaseError if the handler ended its transaction or left it aborted (where
    the driver can tell without a round trip; elsewhere, nothing)."""
    state = _transaction_state(connections[alias])
    if state == "ended":
        raise DatabaseError(
            "The handler ended its transaction (a raw COMMIT or ROLLBACK, or a statement "
            "that commits implicitly): its writes are not its row's. Leave the transaction "
            "to django-dbworker.")
    if state == "busy":
        raise DatabaseError(
            "The handler left a command in progress (a stream(), COPY or pipeline it did "
            "not finish): finish or close it before returning.")
    if state == "aborted":
        raise DatabaseError(
            "The handler caught a database error and went on, which left its transaction "
            "aborted. Let the error propagate, or wrap the statement in "
            "transaction.atomic() to catch it.")


def _transaction_state(connection: Any) -> str | None:
    """"open", "ended", "aborted" or "busy", as the driver knows it (no round trip); None where it
    cannot tell."""
    raw = connection.connection
    if raw is None:
        return "ended"
    return for_connection(connection).transaction_state(raw)


def _roll_back_to(connection: Any, sid: str | None) -> None:
    if connection.closed_in_transaction:
        return  # the database rolls back by itself; the outer atomic() deals with the rest
    connection.needs_rollback = False
    if sid is None:
        connection.needs_rollback = True
        return
    try:
        connection.savepoint_rollback(sid)
    except Error:
        connection.needs_rollback = True
