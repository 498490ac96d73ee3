"""Crashes never lose work and never commit twice: killed children, killed coordinators,
and a claim taken over after its lease expired."""

import logging
import os
import re
import signal
import socket
import threading
import time
from collections import Counter
from contextlib import contextmanager
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from django_dbworker import Coordinator
from django_dbworker.models import CoordinatorHeartbeat, Execution
from tests.freeze import freeze_between_transactions
from tests.helpers import (
    drain,
    effects,
    execution,
    held_handler,
    running_marker,
    runworkers,
    settings_module,
    wait_for,
)
from tests.processes import Output
from tests.testapp.models import Document

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_killed_child_is_replaced_and_its_row_runs_again_once():
    doc = Document.objects.create(behaviour="sleep:0")
    other = Document.objects.create()
    coordinator = Coordinator(["docs"], concurrency=1)
    with held_handler("docs", doc.pk) as held:
        coordinator.start()
        try:
            first = held.wait()  # the handler is running, and waits for us
            assert [c.process.pid for c in coordinator.pools[0].children] == [first]
            os.kill(first, signal.SIGKILL)
            # The row runs again, in a new child: held at the same gate.
            second = held.wait(besides=(first,))
        except BaseException:
            coordinator.stop(timeout=0)
            raise
    try:
        wait_for(lambda: execution("docs", doc).status == "finished" and execution("docs", other).status == "finished",
                 timeout=60)
        assert [c.process.pid for c in coordinator.pools[0].children] == [second]  # rebuilt
    finally:
        coordinator.stop()
    assert coordinator.stats["crashed"] == 1
    assert effects("docs") == {str(doc.pk): 1, str(other.pk): 1}
    assert execution("docs", doc).attempts == 2


def test_a_handler_longer_than_the_lease_keeps_its_row():
    """Live claims are renewed: without renewal the lease (3 s) would lapse, the row be
    recovered and claimed again, and the first run's commit rejected as a lost claim."""
    doc = Document.objects.create(behaviour="sleep:5")
    coordinator = Coordinator(["docs"], concurrency=1)
    coordinator.start()
    try:
        wait_for(lambda: execution("docs", doc).status == "finished", timeout=60)
    finally:
        coordinator.stop()
    assert coordinator.stats["lost"] == 0 and coordinator.stats["recovered"] == 0
    assert execution("docs", doc).attempts == 1
    assert effects("docs") == {str(doc.pk): 1}


@contextmanager
def rows_behind_a_held_handler(coordinator: Coordinator, gate: str, behind: int):
    """Rows sent ahead to a child, waiting behind a handler the test holds. The
    coordinator's one child first earns rows ahead of need with quick rows; then a row
    whose handler is held at ``gate`` starts, alone, and ``behind`` quick rows are
    claimed and sent to the child after it: they wait in its pipe, not in the held row's
    group (a group reads the stop flag between its rows; rows that arrive later are what
    the check at the start of the next group is for). On SQLite the held handler's
    transaction holds the one write lock, so there the rows are inserted with the held
    one, and the claims split them. Yields (the warm-up rows, the held row, the rows
    behind it) while they wait in the child."""
    warm = Document.objects.bulk_create([Document() for _ in range(40)])
    wait_for(lambda: effects("docs").total() == len(warm), timeout=60)
    with held_handler(gate=gate) as held:
        if connection.vendor == "sqlite":
            slow, *waiting = Document.objects.bulk_create(
                [Document(behaviour=f"hold:{gate}"), *[Document() for _ in range(behind)]])
            held.wait()
        else:
            slow = Document.objects.create(behaviour=f"hold:{gate}")
            held.wait()
            waiting = Document.objects.bulk_create([Document() for _ in range(behind)])
        [child] = coordinator.pools[0].children
        wait_for(lambda: len(child.outstanding) > 1, timeout=30)  # rows were sent ahead
        yield warm, slow, waiting


def test_rows_waiting_behind_a_handler_longer_than_the_lease_keep_their_claims(monkeypatch):
    """A handler runs past the lease with rows sent ahead waiting behind it in its child.
    On SQLite its transaction holds the one write lock, so nothing can be renewed until it
    commits: the leases run out meanwhile. The coordinator must not take its own live
    claims back as expired then: each row runs once, in its first attempt."""
    from django_dbworker.processes.pool import Pool

    monkeypatch.setattr(Pool, "STUCK_SECONDS", 3600.0)  # the rows stay behind it
    coordinator = Coordinator(["docs"], concurrency=1)
    coordinator.start()
    try:
        with rows_behind_a_held_handler(coordinator, "long", 5) as (warm, slow, waiting):
            claimed = execution("docs", waiting[0])
            while timezone.now() < claimed.lease_expires_at + timedelta(seconds=2):
                time.sleep(0.1)  # past the lease the claims were made with
        wait_for(lambda: all(execution("docs", d).status == "finished" for d in [slow, *waiting]),
                 timeout=60)
    finally:
        coordinator.stop()
    assert coordinator.stats["recovered"] == coordinator.stats["lost"] == 0, coordinator.stats
    assert {execution("docs", d).attempts for d in [slow, *waiting]} == {1}
    assert effects("docs") == {str(d.pk): 1 for d in [*warm, slow, *waiting]}


def test_a_live_coordinators_claim_is_renewed_and_never_taken_over(tmp_path):
    """Renewal, on every database: the child stops itself after it received its row and
    before its transaction, so it holds no lock (SQLite's included), and only renewals
    keep the row. Other coordinators look again and again, a whole lease (3 s) past the
    first one: they never take it. Then the child goes on and finishes it, once."""
    doc = Document.objects.create()
    stopped = tmp_path / "child-stopped"
    proc = runworkers("--worker", "docs",
                      env={"DBWORKER_FAILPOINT": f"child.before_begin:{stopped}:stop"})
    output = Output(proc)
    try:
        wait_for(stopped.exists, timeout=60)  # the child has the row, and is stopped
        first = execution("docs", doc)
        assert first.status == "working" and first.claimed_by.endswith(f":{proc.pid}")
        stats = Counter()
        while timezone.now() < first.lease_expires_at + timedelta(seconds=3):
            stats.update(drain("docs"))  # another coordinator, each time
            time.sleep(0.2)
        still = execution("docs", doc)
        assert stats["recovered"] == stats["claimed"] == 0, stats
        assert (still.status, still.claim_token) == ("working", first.claim_token)
        assert still.lease_expires_at > first.lease_expires_at  # pushed on, again and again
    finally:
        os.killpg(proc.pid, signal.SIGCONT)
    wait_for(lambda: execution("docs", doc).status == "finished", timeout=60, interval=0.1)
    proc.send_signal(signal.SIGTERM)
    assert output.wait(timeout=60) == 0, output.err
    assert "lost its claim" not in output.err
    assert execution("docs", doc).attempts == 1
    assert effects("docs") == {str(doc.pk): 1}


def test_a_killed_coordinator_and_child_lose_nothing_the_lease_returns_the_row(tmp_path, caplog):
    """The coordinator and its children die on another machine (another IDENTITY): no
    dead-pid check here can judge that process, so only its lease running out brings the
    row back. (On this machine, test_claims_of_a_coordinator_that_died_... covers the
    quicker path.)"""
    doc = Document.objects.create(behaviour="sleep:30")
    started = running_marker("docs", doc.pk)
    proc = runworkers("--worker", "docs", env=settings_module(
        tmp_path, 'DBWORKER = {**DBWORKER, "IDENTITY": "another-machine"}\n'))
    wait_for(started.exists, timeout=60)  # the handler is running
    os.killpg(proc.pid, signal.SIGKILL)  # the machine is gone: coordinator and children
    proc.communicate(timeout=30)
    held = execution("docs", doc)
    assert held.status == "working"  # nobody released it
    assert held.claimed_by == f"another-machine:{proc.pid}"
    lease_ended = held.lease_expires_at
    Document.objects.filter(pk=doc.pk).update(behaviour="ok")
    stats = Counter()

    def finished():
        stats.update(drain("docs"))  # each drain ends at once while the lease holds
        return stats["finished"]

    begun = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="django_dbworker.coordinator"):
        wait_for(finished, timeout=30, interval=0.2)
    assert time.monotonic() - begun < 20
    # Recovered by the lease: one expired lease counted, no coordinator judged dead.
    assert stats["recovered"] == 1 and stats["finished"] == 1, stats
    assert "1 claim(s) had expired leases" in caplog.text
    assert "are gone" not in caplog.text
    assert CoordinatorHeartbeat.objects.filter(host="another-machine", pid=proc.pid).exists()
    e = execution("docs", doc)
    assert e.status == "finished" and e.attempts == 2  # the interrupted attempt, then ours
    assert e.claimed_by == f"{socket.gethostname()}:{os.getpid()}"
    assert e.started_at >= lease_ended  # run again only once the lease had run out
    assert effects("docs") == {str(doc.pk): 1}


def test_a_frozen_coordinators_claim_ends_finished_exactly_once():
    if connection.vendor == "sqlite":
        sqlite_running_handler_cannot_be_taken_over()
    else:
        claim_taken_over_after_its_lease_discards_the_stale_childs_writes()


def claim_taken_over_after_its_lease_discards_the_stale_childs_writes():
    doc = Document.objects.create(behaviour="sleep:0")
    with held_handler("docs", doc.pk) as held:
        stale = runworkers("--worker", "docs")
        try:
            held.wait()  # the handler is running, held until the takeover is over
            first = execution("docs", doc)
            assert first.claimed_by.endswith(f":{stale.pid}") and first.attempts == 1
            freeze_between_transactions(stale.pid)  # the coordinator freezes: no renewals
            # After the lease (3 s), another coordinator takes over; its run reads the
            # row afresh and does not stop at the gate.
            Document.objects.filter(pk=doc.pk).update(behaviour="ok")
            stats = Counter()
            wait_for(lambda: stats.update(drain("docs")) or stats["finished"], timeout=60,
                     interval=0.5)
            taken = execution("docs", doc)
            assert stats["recovered"] == 1 and stats["claimed"] == 1 and stats["finished"] == 1, stats
            assert taken.claim_token is None and taken.attempts == 2
            assert taken.claimed_by == f"{socket.gethostname()}:{os.getpid()}"  # ours, not the stale one's
        finally:
            os.kill(stale.pid, signal.SIGCONT)
    # Released: the stale child's handler goes on and tries to commit; a graceful stop
    # waits for it.
    stale.send_signal(signal.SIGTERM)
    _, err = stale.communicate(timeout=60)
    assert "lost its claim" in err
    assert execution("docs", doc).status == "finished"
    assert effects("docs") == {str(doc.pk): 1}  # exactly once: the stale child's writes are gone


def test_a_stale_childs_commit_is_refused_while_the_new_holder_still_runs(tmp_path):
    """The claim token guards the commit, not only the status: the row is still WORKING,
    under the new holder's claim, when the stale child commits, so a guard on the status
    alone would let the stale run win and refuse the new holder's instead. Both children
    stop themselves after they received the row and before their transaction (holding no
    lock, so this runs on SQLite too); the test decides who goes on when."""
    doc = Document.objects.create()
    stale_stopped, new_stopped = tmp_path / "stale-child-stopped", tmp_path / "new-child-stopped"
    stale = runworkers("--worker", "docs",
                       env={"DBWORKER_FAILPOINT": f"child.before_begin:{stale_stopped}:stop"})
    stale_output = Output(stale)
    new = None
    try:
        wait_for(stale_stopped.exists, timeout=60)  # the stale child has the row, stopped
        freeze_between_transactions(stale.pid)  # its coordinator too: no renewals
        new = runworkers("--worker", "docs",
                         env={"DBWORKER_FAILPOINT": f"child.before_begin:{new_stopped}:stop"})
        new_output = Output(new)
        wait_for(new_stopped.exists, timeout=60)  # after the lease (3 s): taken over, stopped
        taken = execution("docs", doc)
        assert (taken.status, taken.attempts) == ("working", 2)
        assert taken.claimed_by.endswith(f":{new.pid}"), taken.claimed_by
    finally:
        os.killpg(stale.pid, signal.SIGCONT)  # the stale coordinator and its child go on
    # The stale child runs the handler and commits while the new holder still holds the row.
    wait_for(lambda: "lost its claim" in stale_output.err, timeout=60, interval=0.1)
    assert effects("docs") == {}  # refused: nothing of the stale run was committed
    assert execution("docs", doc).claim_token == taken.claim_token  # still the new holder's
    os.killpg(new.pid, signal.SIGCONT)
    wait_for(lambda: execution("docs", doc).status == "finished", timeout=60, interval=0.1)
    for proc in (stale, new):
        proc.send_signal(signal.SIGTERM)
    assert [stale_output.wait(timeout=60), new_output.wait(timeout=60)] == [0, 0]
    assert "lost its claim" not in new_output.err, new_output.err  # the new holder's commit stands
    e = execution("docs", doc)
    assert e.status == "finished" and e.attempts == 2
    assert e.claimed_by.endswith(f":{new.pid}"), e.claimed_by
    assert effects("docs") == {str(doc.pk): 1}


def test_a_stale_child_that_wakes_after_the_takeover_has_its_writes_discarded(tmp_path):
    """End to end on every database, SQLite included: the child stops itself after it
    received its row and before it opened a transaction (so it holds no lock), its
    coordinator freezes, another coordinator takes the row over and finishes it; then the
    stale pair wakes, runs the handler and tries to commit."""
    doc = Document.objects.create(behaviour="sleep:0.5")
    marker = tmp_path / "child-stopped"
    stale = runworkers("--worker", "docs",
                       env={"DBWORKER_FAILPOINT": f"child.before_begin:{marker}:stop"})
    try:
        wait_for(marker.exists, timeout=60)  # the child has the row, and is stopped
        freeze_between_transactions(stale.pid)  # its coordinator too: no renewals
        stats = Counter()
        wait_for(lambda: stats.update(drain("docs")) or stats["finished"], timeout=60,
                 interval=0.5)  # after the lease (3 s): recovered, claimed, finished
        assert stats["recovered"] == 1 and stats["finished"] == 1, stats
        assert effects("docs") == {str(doc.pk): 1}
        started = running_marker("docs", doc.pk)  # (cleared of the new holder's run)
    finally:
        os.killpg(stale.pid, signal.SIGCONT)  # the coordinator and its stopped child
    wait_for(started.exists, timeout=30)  # the stale child runs the handler
    stale.send_signal(signal.SIGTERM)  # a graceful stop waits for it to try its commit
    _, err = stale.communicate(timeout=60)
    assert "lost its claim" in err, err
    e = execution("docs", doc)
    assert e.status == "finished" and e.attempts == 2
    assert effects("docs") == {str(doc.pk): 1}  # the stale run's writes are gone


def sqlite_running_handler_cannot_be_taken_over():
    """SQLite has one writer: a running handler's transaction holds it, so no process can
    take its row over, even past the lease; the row finishes once, by its first claim."""
    doc = Document.objects.create(behaviour="sleep:0")
    with held_handler("docs", doc.pk) as held:
        first = runworkers("--worker", "docs")
        try:
            held.wait()  # the handler is running, and holds the write lock
            freeze_between_transactions(first.pid)  # no renewals: the lease (3 s) runs out
            lease = execution("docs", doc).lease_expires_at  # (readers do not wait)

            def release_after_the_lease():
                while timezone.now() <= lease + timedelta(seconds=0.5):
                    time.sleep(0.05)
                held.release()

            releaser = threading.Thread(target=release_after_the_lease, daemon=True)
            releaser.start()
            # Waits out the busy database, which is free once the handler, released past
            # the lease, has committed; then finds nothing to take.
            stats = drain("docs")
            releaser.join(timeout=60)
            assert timezone.now() > lease  # the claim had expired while the drain waited
        finally:
            os.kill(first.pid, signal.SIGCONT)
    # No takeover: nothing recovered, claimed or run by the second coordinator.
    assert stats["recovered"] == stats["claimed"] == stats["finished"] == 0, stats
    e = execution("docs", doc)
    assert e.status == "finished" and e.attempts == 1
    assert e.claimed_by == f"{socket.gethostname()}:{first.pid}"  # by its first claim
    assert effects("docs") == {str(doc.pk): 1}


def test_claims_of_a_coordinator_that_died_on_this_machine_are_released_at_once():
    """A coordinator killed outright leaves its heartbeat and its claims. The next
    coordinator on the same host sees that process is gone and hands the rows over
    without waiting out the lease (here an hour: without the check nothing would run)."""
    doc = Document.objects.create(behaviour="sleep:30")
    started = running_marker("docs", doc.pk)
    proc = runworkers("--worker", "docs")
    wait_for(started.exists, timeout=60)  # the handler is running
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)  # reaped: the pid no longer exists
    Execution.objects.filter(pk=execution("docs", doc).pk).update(
        lease_expires_at=timezone.now() + timedelta(hours=1))
    Document.objects.filter(pk=doc.pk).update(behaviour="ok")
    assert CoordinatorHeartbeat.objects.filter(pid=proc.pid).exists()
    stats = drain("docs")
    assert stats["finished"] == 1
    assert execution("docs", doc).status == "finished"
    assert effects("docs") == {str(doc.pk): 1}
    assert not CoordinatorHeartbeat.objects.filter(pid=proc.pid).exists()


GIVEN_BACK = re.compile(r"the (\d+) row\(s\) waiting behind it in the same child were given back")


def test_rows_sent_ahead_to_a_child_are_given_back_when_its_handler_is_stuck(caplog):
    """Quick handlers earn a child rows ahead of need; when the one it runs then hangs,
    the rows behind it go back to the database, and another coordinator runs them while
    it hangs (not on SQLite, where the hung handler's transaction holds the one write lock
    until it ends: they run after it)."""
    coordinator = Coordinator(["docs"], concurrency=1)
    coordinator.start()
    try:
        warm = Document.objects.bulk_create([Document() for _ in range(40)])
        wait_for(lambda: effects("docs").total() == len(warm), timeout=60)
        with caplog.at_level(logging.INFO, logger="django_dbworker.pool"), \
                held_handler(gate="stuck") as held:
            # One claim takes the slow row and the quick ones behind it, all for the one
            # child; its handler hangs on the first.
            slow, *quick = Document.objects.bulk_create(
                [Document(behaviour="hold:stuck"), *[Document() for _ in range(10)]])
            held.wait()
            given_back = wait_for(lambda: [int(m.group(1)) for r in caplog.records
                                           if (m := GIVEN_BACK.search(r.getMessage()))],
                                  timeout=30)
            assert sum(given_back) >= 1, given_back  # rows had been sent ahead to it
            if connection.vendor != "sqlite":
                # Given back (or never claimed, if the child had room for fewer): pending.
                wait_for(lambda: {execution("docs", d).status for d in quick} == {"pending"},
                         timeout=30)
                meanwhile = drain("docs")  # another coordinator, while the handler hangs
                assert meanwhile["finished"] == len(quick), meanwhile
                assert execution("docs", slow).status == "working"
        wait_for(lambda: all(execution("docs", d).status == "finished" for d in [slow, *quick]),
                 timeout=60)
    finally:
        coordinator.stop()
    assert coordinator.stats["released"] >= sum(given_back), coordinator.stats
    assert effects("docs") == {str(d.pk): 1 for d in [*warm, slow, *quick]}
    # Given back before they started: the attempt is not counted.
    assert {execution("docs", d).attempts for d in [slow, *quick]} == {1}


def test_a_graceful_stop_gives_back_the_rows_sent_ahead_that_had_not_started(monkeypatch):
    """Stop claiming, let the running handler finish: the rows waiting behind it in its
    child go back as they were (claimable now, attempt not counted), not left working."""
    from django_dbworker.processes.pool import Pool

    monkeypatch.setattr(Pool, "STUCK_SECONDS", 3600.0)  # only the stop gives rows back here
    coordinator = Coordinator(["docs"], concurrency=1)
    coordinator.start()
    stopping = threading.Thread(target=coordinator.stop, daemon=True)
    try:
        with rows_behind_a_held_handler(coordinator, "slow", 10) as (warm, slow, waiting):
            stopping.start()  # a graceful stop, while the handler runs
            wait_for(lambda: coordinator.stopping, timeout=30)
        # Released: the handler finishes; the rows behind it never start.
        stopping.join(timeout=60)
        assert not stopping.is_alive(), "the stop did not end once the handler finished"
    finally:
        if not stopping.is_alive() and stopping.ident is None:
            coordinator.stop()
    assert execution("docs", slow).status == "finished"
    ran = [d.pk for d in waiting if str(d.pk) in effects("docs")]
    assert not ran, f"rows waiting behind the handler started after the stop: {ran}"
    given_back = [execution("docs", d) for d in waiting]
    assert {(e.status, e.attempts, e.claim_token) for e in given_back} == {("pending", 0, None)}
    assert set(effects("docs").values()) == {1}  # none ran twice
    assert not Execution.objects.filter(status="working").exists()
