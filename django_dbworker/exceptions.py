from __future__ import annotations


class LostClaim(Exception):
    """The row's claim was taken over (its lease expired and another process claimed it).

    Raised inside a child when it tries to commit an outcome; the transaction rolls back,
    so none of the handler's writes are saved.
    """
