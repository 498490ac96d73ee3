"""An idle coordinator notices new work at once: NOTIFY on PostgreSQL, the change probe on
MariaDB and SQLite -- not after its poll back-off has grown to MAX_POLL_SECONDS."""

import time
from itertools import pairwise

import pytest
from django.conf import settings
from django.db import connection
from django.test import override_settings

from django_dbworker import Coordinator
from tests.helpers import execution, wait_for
from tests.testapp.models import Document

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_first_row_after_a_long_idle_is_picked_up_at_once():
    # On PostgreSQL NOTIFY must do it: the change probe, the fallback where NOTIFY does
    # not arrive, is put out of reach (it would look again only after a minute).
    probe = {"probe_seconds": 60} if connection.vendor == "postgresql" else {}
    coordinator = Coordinator(["docs"], poll_seconds=0.25, max_poll_seconds=10, **probe)
    coordinator.start()
    try:
        if connection.vendor == "postgresql":
            assert coordinator.wakeups.listener is not None  # it LISTENs
        time.sleep(4)  # idle: the back-off has doubled to 4 s and more (0.25 .. 10)
        started = time.monotonic()
        doc = Document.objects.create()
        wait_for(lambda: execution("docs", doc).status == "finished", timeout=30, interval=0.01)
        waited = time.monotonic() - started
    finally:
        coordinator.stop()
    # Without a wake-up the row would wait for the next poll: 2 s or more by now.
    assert waited < 1.5, f"picked up {waited:.2f}s after the insert"
    print(f"\npicked up and finished {waited * 1000:.0f} ms after the insert")


def _idle_claim_times(poll: float, most: float, seconds: float) -> list[float]:
    """When an idle coordinator (nothing to claim) ran its claims, over `seconds`, with
    POLL_SECONDS and MAX_POLL_SECONDS set in the settings, as a project sets them.

    A long lease: renewals (every third of it) write the heartbeat, and on SQLite any
    commit, its own included, moves the change probe and wakes the claims early."""
    with override_settings(DBWORKER={**settings.DBWORKER, "POLL_SECONDS": poll,
                                     "MAX_POLL_SECONDS": most, "LEASE_SECONDS": 60}):
        coordinator = Coordinator(["docs"])
        coordinator.start()
        times: list[float] = []
        try:
            assert coordinator.bridge is not None
            claim = coordinator.bridge.claim

            def counted(*args, **kwargs):
                times.append(time.monotonic())
                return claim(*args, **kwargs)

            coordinator.bridge.claim = counted  # the loop looks the method up on each claim
            time.sleep(seconds)
        finally:
            coordinator.stop()
    return times


def test_an_idle_coordinator_backs_off_its_polls_up_to_max_poll_seconds():
    # POLL_SECONDS = MAX_POLL_SECONDS: no back-off, a claim every 0.05 s.
    steady = _idle_claim_times(0.05, 0.05, 3)
    # Doubling from 0.05 s, capped at 0.4 s: 0.05, 0.1, 0.2, then every 0.4 s.
    backed_off = _idle_claim_times(0.05, 0.4, 4)
    gaps = [b - a for a, b in pairwise(backed_off)]
    print(f"\n{len(steady)} claims in 3 s without back-off; {len(backed_off)} in 4 s with it, "
          f"gaps {[round(g, 2) for g in gaps]}")
    assert len(steady) >= 20
    assert 5 <= len(backed_off) <= 14
    late = gaps[-4:]  # once the back-off reached its cap
    assert min(late) >= 0.35, gaps  # the wait grew to MAX_POLL_SECONDS ...
    assert max(late) < 0.4 + 0.5, gaps  # ... and no further


def test_the_change_probe_slows_to_half_its_rate_after_a_quiet_second_and_speeds_up_on_a_change():
    """An idle coordinator probes every PROBE_SECONDS while changes come, then half as
    often: each probe costs a wake-up and a query (the idle CPU budget). The probe runs
    here against the real database, without NOTIFY (as on MariaDB, SQLite, or PostgreSQL
    behind PgBouncer)."""
    from django_dbworker.bridge import Bridge
    from django_dbworker.outage import DatabaseHealth
    from django_dbworker.wakeups import QUIET_FACTOR, QUIET_SECONDS, Probed, Wakeups

    options = Coordinator(["docs"], probe_seconds=0.02).settings
    bridge = Bridge("default", options.lease_seconds)
    health = DatabaseHealth(bridge.vendor, bridge.ping, options.poll_seconds)
    wakeups = Wakeups(["docs"], options, health)
    try:
        def gap_after_probe(now: float) -> tuple[Probed, float]:
            probed = wakeups.probe(bridge, now)
            return probed, round(wakeups.next_probe - now, 6)

        assert gap_after_probe(100.0)[0] is Probed.NOTHING  # the first answer: a baseline
        Document.objects.create()  # a new pending row: the probe sees it ...
        assert gap_after_probe(100.05) == (Probed.ROWS, 0.02)
        # ... and probes at the full rate for QUIET_SECONDS after that change,
        assert gap_after_probe(100.05 + QUIET_SECONDS / 2) == (Probed.NOTHING, 0.02)
        # then half as often,
        quiet = 100.05 + QUIET_SECONDS + 0.01
        assert gap_after_probe(quiet) == (Probed.NOTHING, round(0.02 * QUIET_FACTOR, 6))
        # until the next change, seen at once.
        Document.objects.create()
        assert gap_after_probe(quiet + 0.5) == (Probed.ROWS, 0.02)
    finally:
        bridge.close()
