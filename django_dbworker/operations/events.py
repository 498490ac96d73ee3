"""The events a coordinator counts: one list for its stats line and its Prometheus counters.

A name counted that is not here is a bug (a typo, or an event added in one place only):
``Metrics.count`` raises on it, so the tests that drive each path catch it, and
``tests/test_probes.py`` checks that every name the package counts is listed.
"""

from __future__ import annotations

# name -> the counter's help text; the stats line shows them in this order.
EVENTS = {
    "claimed": "Rows claimed.",
    "finished": "Handlers that returned Finished() (tasks: SUCCESSFUL).",
    "unfinished": "Handlers that returned Unfinished().",
    "failed": "Attempts that failed for good (no retry left).",
    "retried": "Failed attempts that wait for a retry.",
    "lost": "Runs whose claim was taken over; their writes were discarded.",
    "crashed": "Children that died.",
    "released": "Rows given back to the database (not run, or interrupted).",
    "interrupted": "Runs cut short by a database error; their rows were released.",
    "recovered": "Claims of other holders whose lease expired, made claimable again.",
}


class UnknownEvent(ValueError):
    pass


def check(event: str) -> str:
    """``event``, or an error naming the known ones."""
    if event not in EVENTS:
        raise UnknownEvent(f"Unknown event {event!r}: add it to django_dbworker.operations.events.EVENTS "
                           f"(known: {', '.join(EVENTS)}).")
    return event
