"""The exceptions the app raises into your code."""

from __future__ import annotations


class LostClaim(Exception):
    """The row's claim was taken over (its lease expired and another process claimed it).

    Raised inside a child when it tries to commit an outcome; the transaction rolls back,
    so none of the handler's writes are saved.
    """


class ChildDied(Exception):
    """An attempt's child process died while running it (recorded by the coordinator)."""


class LeaseExpired(Exception):
    """An attempt's claim expired before it finished: its holder stopped renewing it."""


class Interrupted(Exception):
    """An attempt was cut short because the database failed while it ran."""
