"""An idle coordinator notices new work at once: NOTIFY on PostgreSQL, the change probe on
MariaDB and SQLite -- not after its poll back-off has grown to MAX_POLL_SECONDS."""

import sys
import time
from itertools import pairwise

import pytest
from django.conf import settings
from django.db import connection
from django.test import override_settings

from django_dbworker import Coordinator
from tests.helpers import counting_probes, execution, seconds_to_claim, wait_for
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


@pytest.fixture
def probing():
    """A coordinator's wake-ups, without the coordinator: (wakeups, gap_after_probe),
    where gap_after_probe(now) runs the change probe at ``now`` against the real
    database (no NOTIFY, as on MariaDB, SQLite, or PostgreSQL behind PgBouncer) and says
    what it saw and how long until the next one. PROBE_SECONDS is 0.02."""
    from django_dbworker.coordinator.outage import DatabaseHealth
    from django_dbworker.coordinator.wakeups import Probed, Wakeups
    from django_dbworker.store.bridge import Bridge

    options = Coordinator(["docs"], probe_seconds=0.02).settings
    bridge = Bridge("default", options.lease_seconds)
    health = DatabaseHealth(bridge.vendor, bridge.ping, options.poll_seconds)
    wakeups = Wakeups(["docs"], options, health)

    def gap_after_probe(now: float) -> tuple[Probed, float]:
        probed = wakeups.probe(bridge, now)
        return probed, round(wakeups.next_probe - now, 6)

    try:
        yield wakeups, gap_after_probe
    finally:
        bridge.close()


def test_the_change_probe_slows_to_half_its_rate_after_a_quiet_second_and_speeds_up_on_a_change(
        probing):
    """An idle coordinator probes every PROBE_SECONDS while changes come, then half as
    often: each probe costs a wake-up and a query (the idle CPU budget)."""
    from django_dbworker.coordinator.wakeups import QUIET_FACTOR, QUIET_SECONDS, Probed

    _, gap_after_probe = probing
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


def test_on_sqlite_an_idle_coordinator_sleeps_until_the_doorbell_rings():
    """SQLite under Linux: the idle coordinator probes when the kernel says the
    database's files were written (and once a DOORBELL_BACKSTOP_SECONDS otherwise), not
    every 0.04 s; a row inserted after an idle stretch is still picked up at once. Where
    there is no doorbell (a server: MariaDB, PostgreSQL) there is none."""
    from django_dbworker.coordinator.wakeups import DOORBELL_BACKSTOP_SECONDS

    coordinator = Coordinator(["docs"], poll_seconds=0.25, max_poll_seconds=10,
                              probe_seconds=0.02)
    coordinator.start()
    waits: list[float] = []
    try:
        doorbell = coordinator.wakeups.doorbell
        if connection.vendor != "sqlite" or sys.platform != "linux":
            assert doorbell is None
            return
        assert doorbell is not None
        probes = counting_probes(coordinator)
        time.sleep(3)  # idle
        idle_probes = len(probes)
        for _ in range(3):
            # Insert 0.4 s after the last probe: a coordinator waiting for its backstop
            # would claim the row about 0.6 s later.
            wait_for(lambda: time.monotonic() - probes[-1] >= 0.4, interval=0.01)
            waits.append(seconds_to_claim())
    finally:
        coordinator.stop()
    print(f"\n{idle_probes} probes in 3 s idle; claimed {[round(w * 1000) for w in waits]} ms "
          "after each insert")
    # A probe per heartbeat (every third of LEASE_SECONDS, a commit of its own) or per
    # backstop period: 75 at 0.04 s.
    assert idle_probes <= 3 / DOORBELL_BACKSTOP_SECONDS + 4, idle_probes
    assert max(waits) < 0.35, waits


def test_a_ring_brings_the_probe_at_once_then_again_soon_until_it_sees_the_change(probing):
    """The doorbell rings when a commit writes the file, a moment before the commit is
    published: the probe runs at once, then after 2, 4, 8... ms until it sees the change,
    then only on the backstop's timer. A ring that brings nothing (a checkpoint) stops
    the follow-ups after RING_SECONDS. (A bell rung by hand here; the real one is tested
    in tests/test_doorbell.py. The probe runs against the real database.)"""
    from django_dbworker.coordinator.wakeups import DOORBELL_BACKSTOP_SECONDS, RING_SECONDS, Probed

    class Bell:
        ringing = broken = False

        def rang(self) -> bool:
            rang, self.ringing = self.ringing, False
            return rang

        def close(self) -> None:
            pass

    wakeups, gap_after_probe = probing
    bell = wakeups.doorbell = Bell()
    assert gap_after_probe(100.0) == (Probed.NOTHING, DOORBELL_BACKSTOP_SECONDS)
    bell.ringing = True
    wakeups.on_ring(100.01)  # rung again within PROBE_SECONDS of the last probe:
    assert wakeups.next_probe == 100.02  # PROBE_SECONDS after it
    assert gap_after_probe(100.02) == (Probed.NOTHING, 0.002)
    assert gap_after_probe(100.023) == (Probed.NOTHING, 0.004)
    Document.objects.create()
    assert gap_after_probe(100.03) == (Probed.ROWS, DOORBELL_BACKSTOP_SECONDS)
    bell.ringing = True
    wakeups.on_ring(100.5)
    assert wakeups.next_probe <= 100.5  # at once
    assert gap_after_probe(100.5) == (Probed.NOTHING, 0.002)  # not published yet
    assert gap_after_probe(100.503) == (Probed.NOTHING, 0.004)
    Document.objects.create()
    assert gap_after_probe(100.51) == (Probed.ROWS, DOORBELL_BACKSTOP_SECONDS)
    bell.ringing = True
    wakeups.on_ring(101.0)
    assert gap_after_probe(101.0) == (Probed.NOTHING, 0.002)
    assert gap_after_probe(101.0 + RING_SECONDS) == (Probed.NOTHING, DOORBELL_BACKSTOP_SECONDS)
    wakeups.on_ring(102.0)  # readable, but no write to the database's files
    assert wakeups.next_probe == 101.0 + RING_SECONDS + DOORBELL_BACKSTOP_SECONDS
    bell.ringing = True  # rung, not read yet when the probe runs: the probe reads it
    assert gap_after_probe(103.0) == (Probed.NOTHING, 0.002)
    assert not bell.ringing
