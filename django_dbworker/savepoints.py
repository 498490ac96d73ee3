"""A savepoint around one handler of a group, kept rather than released on success."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django.db import Error, connections


@contextmanager
def kept_savepoint(alias: str) -> Iterator[None]:
    """What ``transaction.atomic()`` nested in a transaction does, less the RELEASE
    SAVEPOINT after a block that succeeds: one round trip fewer per row of a group. The
    savepoint is left open until the group's transaction ends, which frees it anyway
    (a group holds at most ``GROUP_ROWS`` of them: PostgreSQL caches 64 per transaction).

    On an exception, or after ``transaction.set_rollback(True)`` inside, it rolls back to
    the savepoint, which also drops the on_commit() callbacks registered inside. When it
    cannot (the database aborted the whole transaction: a MySQL deadlock, say), the
    transaction is marked for rollback, as atomic() marks it."""
    connection: Any = connections[alias]
    sid = connection.savepoint() if not connection.needs_rollback else None
    # Listed as atomic() lists its own: on_commit() tags callbacks with the open savepoints.
    connection.savepoint_ids.append(sid)
    try:
        yield
    except BaseException:
        connection.savepoint_ids.pop()
        _roll_back_to(connection, sid)
        raise
    connection.savepoint_ids.pop()
    if connection.needs_rollback:
        _roll_back_to(connection, sid)


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
