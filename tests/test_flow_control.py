"""Flow control (issue 37): per_key and total, decided inside the claim, so that they hold
across every claimer: claims made here as other coordinators would make them, claims
racing in threads, and real coordinators whose WORKING rows are sampled every few ms.

The workers (tests/testapp/workers.py) run on KeyedJob: `keyed` (key="customer",
per_key=1), `keyed_three` (per_key=3) and `capped` (total=3).
"""

import re
import threading
import time
import uuid
from collections import Counter

import pytest
from django.db import connection, connections

from django_dbworker.models import Execution, FlowLock
from tests.helpers import at_once, claim, effects
from tests.processes import Coordinators
from tests.testapp.models import KeyedJob

pytestmark = pytest.mark.django_db(transaction=True)


def jobs(customers, delay=0.0) -> list[KeyedJob]:
    """One KeyedJob per item of ``customers`` (a customer id or None), in that order."""
    return [KeyedJob.objects.create(customer=c, delay=delay) for c in customers]


def working(worker: str) -> set[str]:
    return set(Execution.objects.filter(worker=worker, status="working")
               .values_list("source_id", flat=True))


def end(worker: str, job: KeyedJob) -> None:
    """The row's attempt ends (as a committed outcome would end it)."""
    Execution.objects.filter(worker=worker, source_id=str(job.pk)).update(
        status="finished", claim_token=None, lease_expires_at=None)


def test_per_key_one_claims_the_first_row_of_each_key_and_rows_without_a_key():
    rows = jobs([1, 1, 2, 1, 2, 3, None, None])
    claimed = claim("keyed", 20)
    assert [c.source_id for c in claimed] == [str(rows[i].pk) for i in (0, 2, 5, 6, 7)]
    # Every key is at its limit: another claimer gets nothing, however many it asks for.
    assert claim("keyed", 20, claimer="other:2") == []
    # The key's running row ends: its next row is claimable, and only that one.
    end("keyed", rows[0])
    assert [c.source_id for c in claim("keyed", 20, claimer="other:2")] == [str(rows[1].pk)]
    keys = dict(Execution.objects.filter(worker="keyed", status="working")
                .values_list("source_id", "flow_key"))
    assert keys == {str(rows[1].pk): "1", str(rows[2].pk): "2", str(rows[5].pk): "3",
                    str(rows[6].pk): None, str(rows[7].pk): None}


def test_per_key_three_takes_three_of_each_key_in_claim_order():
    rows = jobs([7] * 5 + [8] * 5)
    claimed = [c.source_id for c in claim("keyed_three", 4)]
    assert claimed == [str(r.pk) for r in rows[:3] + rows[5:6]]
    claimed += [c.source_id for c in claim("keyed_three", 20, claimer="other:2")]
    assert claimed == [str(r.pk) for r in rows[:3] + rows[5:6] + rows[6:8]]
    assert Counter(Execution.objects.filter(worker="keyed_three", status="working")
                   .values_list("flow_key", flat=True)) == {"7": 3, "8": 3}


def test_total_caps_the_worker_across_claimers():
    jobs([None] * 10)
    assert len(claim("capped", 2, claimer="a:1")) == 2
    assert len(claim("capped", 2, claimer="b:1")) == 1
    assert claim("capped", 5, claimer="c:1") == []
    assert len(working("capped")) == 3


def test_the_key_is_the_source_rows_value_when_it_is_claimed():
    first, second = jobs([1, 1])
    claim("keyed", 1)
    assert claim("keyed", 1, claimer="other:2") == []  # customer 1 is at its limit
    # The pending row moves to another customer: its claim counts it there.
    KeyedJob.objects.filter(pk=second.pk).update(customer=2)
    assert [c.source_id for c in claim("keyed", 1, claimer="other:2")] == [str(second.pk)]
    assert Execution.objects.get(worker="keyed", source_id=str(second.pk)).flow_key == "2"


def test_the_rows_behind_a_key_at_its_limit_run():
    rows = jobs([5] * 50 + [6])
    assert [c.source_id for c in claim("keyed", 2)] == [str(rows[0].pk), str(rows[50].pk)]


def sampled_claims(worker: str, threads: int, rounds: int, ask: int) -> list[str]:
    """``threads`` claimers, each with a connection of its own, claim ``ask`` rows
    ``rounds`` times at once (a barrier before each round); returns every row claimed."""
    # (A lease, and so an idle-in-transaction limit, far longer than a thread may wait
    # for the CPU between two statements on a loaded machine.)
    # A claim that timed out waiting for another's lock is contention, not a failure: it
    # claims again, as a coordinator would (CI: one thread of six waited past 2 s).
    return at_once(threads, rounds, lambda n: [c.source_id for c in claim(
        worker, ask, claimer=f"thread:{n}", contended=True, lease_seconds=120)])


@pytest.mark.solo  # (threads racing on purpose: alone, not beside another lane)
@pytest.mark.parametrize("worker,limit", [("keyed", 1), ("keyed_three", 3)])
def test_claims_racing_in_threads_never_take_more_than_a_key_allows(worker, limit):
    customers = [n % 20 for n in range(400)]
    rows = jobs(customers)
    customer_of = {str(r.pk): r.customer for r in rows}
    for _ in range(5):  # races hide on one try: every repeat starts from nothing running
        claimed = sampled_claims(worker, threads=6, rounds=3, ask=7)
        assert len(claimed) == len(set(claimed))  # no row twice
        per_key = Counter(customer_of[s] for s in claimed)
        assert max(per_key.values()) <= limit, per_key
        # A claim passes over a key another claim holds at that moment: one more claim,
        # alone, fills every key up to its limit, and not past it.
        claimed += [c.source_id for c in claim(worker, 200, claimer="last:1")]
        per_key = Counter(customer_of[s] for s in claimed)
        assert per_key == dict.fromkeys(range(20), limit), per_key
        Execution.objects.filter(worker=worker, status="working").update(
            status="finished", claim_token=None, lease_expires_at=None)


@pytest.mark.solo
def test_total_racing_in_threads_is_never_exceeded():
    jobs([None] * 100)
    for _ in range(10):
        # Each repeat from no lock row: the first claims race to make it, and a claim that
        # finds it made after its first look must still take it (CI: 4 claimed of 3).
        FlowLock.objects.filter(worker="capped").delete()
        claimed = sampled_claims("capped", threads=6, rounds=2, ask=2)
        assert len(claimed) == 3, claimed
        Execution.objects.filter(worker="capped", status="working").update(
            status="finished", claim_token=None, lease_expires_at=None)


@pytest.mark.solo  # (several coordinators: alone, as the stress test is)
@pytest.mark.parametrize("worker,limit", [("keyed", 1), ("keyed_three", 3)])
def test_four_coordinators_keep_the_per_key_limit_while_sampled(worker, limit):
    """1,000 rows over 20 keys, 4 coordinators x 2 children (2 on SQLite: one writer);
    the WORKING rows of each key are counted every few ms until all are finished. The
    rows come in runs of 10 of one key, so claims in order meet each key's limit (rows
    dealt round-robin would rarely have two of a key running at once)."""
    coordinators = 2 if connection.vendor == "sqlite" else 4
    rows = jobs([(n // 10) % 20 for n in range(1000)], delay=0.005)
    customer_of = {str(r.pk): r.customer for r in rows}
    group = Coordinators(coordinators, "--worker", worker, "--concurrency", f"{worker}=2",
                         "--status-interval", "5")
    group.wait_started()
    most: Counter = Counter()
    samples = 0
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        now = Counter(customer_of[s] for s in working(worker))
        for key, n in now.items():
            most[key] = max(most[key], n)
        samples += 1
        if not now and not Execution.objects.filter(worker=worker).exclude(status="finished").exists():
            break
        assert group.alive(), group.report()
        time.sleep(0.003)
    assert group.stop() == [0] * coordinators, group.report()
    assert Counter(Execution.objects.filter(worker=worker).values_list("status", flat=True)) == {
        "finished": 1000}
    counted = effects(worker)
    assert len(counted) == 1000 and set(counted.values()) == {1}
    assert samples > 100, samples
    assert max(most.values()) <= limit, most
    if limit > 1:
        assert max(most.values()) > 1, most  # the limit was reached, not only kept


def test_why_not_running_names_the_limit_that_holds_the_row():
    from django_dbworker.admin.diagnosis import diagnose

    first, second, other, last = jobs([42, 42, None, None])
    claim("keyed", 1)
    findings = {f.what: f for f in diagnose("keyed", second)}
    assert findings["per-key limit"].blocking
    assert findings["per-key limit"].detail == "customer 42: 1 of 1 running."
    assert not {f.what: f for f in diagnose("keyed", other)}["per-key limit"].blocking
    assert len(claim("capped", 3)) == 3
    capped = {f.what: f for f in diagnose("capped", last)}["total limit"]
    assert (capped.blocking, capped.detail) == (True, "Worker capped: 3 of 3 running.")
    end("capped", first)
    capped = {f.what: f for f in diagnose("capped", last)}["total limit"]
    assert (capped.blocking, capped.detail) == (False, "Worker capped: 2 of 3 running.")


def test_a_task_queue_total_holds_across_claimers():
    from tests.testapp.tasks import add

    results = [add.using(queue_name="capped").enqueue(1, n) for n in range(3)]
    assert len(claim("tasks.default.capped", 3)) == 1
    assert claim("tasks.default.capped", 3, claimer="other:2") == []
    assert len(working("tasks.default.capped")) == 1
    assert {str(r.id) for r in results} >= {str(uuid.UUID(s)) for s in working("tasks.default.capped")}


def test_a_place_held_by_a_dead_claimer_frees_when_recovery_takes_its_row_back():
    from django_dbworker.registration.registry import registry
    from django_dbworker.store.bridge import Bridge

    first, second = jobs([9, 9])
    [held] = claim("keyed", 1, claimer="dead:1")  # its coordinator died holding the row
    assert claim("keyed", 1) == []
    bridge = Bridge()
    try:
        # Its lease runs out (set in the past here, rather than waited for).
        Execution.objects.filter(pk=held.execution_id).update(lease_expires_at="2000-01-01T00:00:00Z")
        assert claim("keyed", 1) == []  # still WORKING: still counted, until recovered
        assert bridge.recover_expired(registry["keyed"]) == 1
    finally:
        bridge.close()
    [again] = claim("keyed", 2)
    assert again.source_id in {str(first.pk), str(second.pk)}
    assert claim("keyed", 2, claimer="other:2") == []


def test_the_admin_shows_the_key_a_running_row_counts_toward(admin_client):
    from django.urls import reverse

    [job] = jobs([314])
    claim("keyed", 1)
    execution = Execution.objects.get(worker="keyed", source_id=str(job.pk))
    page = admin_client.get(reverse("admin:django_dbworker_execution_change", args=[execution.pk]))
    assert page.status_code == 200
    assert re.search(r"Flow key:</label>\s*<div class=\"readonly\">314</div>", page.text), page.text[-3000:]


class PausedClaim(threading.Thread):
    """A claim that stops once it has locked its rows, before it writes and commits: what
    another coordinator's claim meets in the middle of this one."""

    def __init__(self, worker: str, ask: int, monkeypatch) -> None:
        super().__init__(name="paused-claim")
        from django_dbworker.vendors.claiming import ClaimWithinLimits

        self.worker, self.ask, self.claimed = worker, ask, None
        self.locked, self.go = threading.Event(), threading.Event()
        original = ClaimWithinLimits._lock_rows

        def lock_rows(operation, *args):
            ids = original(operation, *args)
            if threading.current_thread() is self:
                self.locked.set()
                assert self.go.wait(timeout=60)
            return ids

        monkeypatch.setattr(ClaimWithinLimits, "_lock_rows", lock_rows)

    def run(self) -> None:
        try:
            self.claimed = claim(self.worker, self.ask, claimer="paused:1")
        finally:
            connections.close_all()


def skip_one_writer():
    if connection.vendor == "sqlite":
        pytest.skip("SQLite has one writer: a claim waits for the write lock another claim "
                    "holds (BEGIN IMMEDIATE), so two claims never overlap there")


def test_a_claim_passes_over_a_key_another_claim_is_taking(monkeypatch):
    """The second claim sees a row of the key that the first claim did not (it became
    claimable in between, as a retry does) and counts the key before the first commits:
    only the key's lock keeps it from running a second row of the key."""
    skip_one_writer()
    retry, row = jobs([5, 5])
    FlowLock.objects.create(worker="keyed", key="5")  # as an earlier claim of the key left it
    Execution.objects.filter(worker="keyed", source_id=str(retry.pk)).update(status="finished")
    first = PausedClaim("keyed", 1, monkeypatch)
    first.start()
    try:
        assert first.locked.wait(timeout=60)
        Execution.objects.filter(worker="keyed", source_id=str(retry.pk)).update(status="pending")
        assert claim("keyed", 1, claimer="second:1") == []
    finally:
        first.go.set()
        first.join(timeout=60)
    assert [c.source_id for c in first.claimed] == [str(row.pk)]
    assert working("keyed") == {str(row.pk)}


def test_a_claim_of_a_capped_worker_waits_for_the_claim_before_it(monkeypatch):
    """Rows ahead of the first claim's become claimable again while it runs (retries):
    counting before the first claim commits, a second claim would take two of them and
    run 4 rows of a worker capped at 3. The worker's lock makes it wait, then count 2."""
    skip_one_writer()
    early, retry1, retry2, last = jobs([None] * 4)
    assert len(claim("capped", 3, claimer="earlier:1")) == 3  # early, retry1, retry2
    end("capped", retry1)
    end("capped", retry2)
    first = PausedClaim("capped", 1, monkeypatch)  # takes `last`: 2 running
    first.start()
    second: list = []
    waiting = threading.Thread(target=lambda: second.extend(claim("capped", 3, claimer="second:1")))
    try:
        assert first.locked.wait(timeout=60)
        Execution.objects.filter(worker="capped", source_id__in=[str(retry1.pk), str(retry2.pk)]
                                 ).update(status="pending")
        waiting.start()
        time.sleep(0.5)  # the second claim is waiting for the worker's lock now
        assert waiting.is_alive()
    finally:
        first.go.set()
        first.join(timeout=60)
        if waiting.ident:
            waiting.join(timeout=60)
    assert [c.source_id for c in first.claimed] == [str(last.pk)]
    assert [c.source_id for c in second] == [str(retry1.pk)]
    assert working("capped") == {str(early.pk), str(last.pk), str(retry1.pk)}


def test_a_frozen_holder_of_the_workers_lock_row_stops_no_claim_for_long():
    """A claimer that froze while it held the worker's lock row (a coordinator stopped
    mid-claim; here a transaction left open): another claim of the worker gives up after
    LOCK_WAIT_SECONDS with the database's lock-timeout error, which the coordinator
    retries as contention, instead of waiting for ever (PostgreSQL has no lock timeout
    by default; MariaDB's is 50 s)."""
    from django_dbworker.registration.registry import registry
    from django_dbworker.store.bridge import Bridge
    from django_dbworker.store.engine import DATABASE_ERRORS
    from django_dbworker.vendors import for_connection
    from django_dbworker.vendors.claiming import ClaimWithinLimits

    skip_one_writer()
    jobs([None] * 2)
    claim("capped", 1)  # (makes the worker's lock row)
    frozen = connections.create_connection("default")
    qn = frozen.ops.quote_name
    try:
        frozen.set_autocommit(False)
        with frozen.cursor() as cursor:
            cursor.execute(f"SELECT 1 FROM {qn(FlowLock._meta.db_table)} WHERE worker = %s "
                           f"AND {qn('key')} = %s FOR UPDATE", ["capped", ""])
        bridge = Bridge()
        started = time.monotonic()
        try:
            with pytest.raises(DATABASE_ERRORS) as failed:
                bridge.claim(registry["capped"], 1, "other:1")
        finally:
            bridge.close()
        waited = time.monotonic() - started
    finally:
        frozen.rollback()
        frozen.close()
    assert for_connection(connection).is_deadlock(failed.value), failed.value  # retried
    bound = ClaimWithinLimits.LOCK_WAIT_SECONDS
    assert bound - 0.5 <= waited < bound + 10, waited


def test_a_claim_counts_the_rows_each_limit_passed_over():
    """What /metrics shows as dbworker_throttled_rows, by the limit that held them."""
    from django_dbworker.registration.registry import registry
    from django_dbworker.store.bridge import Bridge

    jobs([1, 1, 1, 2, 2, None])
    bridge = Bridge()
    try:
        assert len(bridge.claim(registry["keyed"], 10, "test:1")) == 3  # 1, 2 and None
        assert bridge.throttled()["keyed"] == {"per_key": 3, "total": 0, "rate": 0}
        assert len(bridge.claim(registry["capped"], 10, "test:1")) == 3  # total=3
        assert bridge.throttled()["capped"] == {"per_key": 0, "total": 3, "rate": 0}
    finally:
        bridge.close()


def test_a_task_queue_with_per_key_runs_one_task_per_flow_key_at_once():
    from django_dbworker.models import Task
    from tests.testapp import tasks

    results = [tasks.per_customer.enqueue(c, n) for c, n in
               [(1, 1), (1, 2), (2, 1), (None, 1), (None, 2), (1, 3)]]
    assert [t.flow_key for t in Task.objects.order_by("enqueued_at")] == [
        "1", "1", "2", None, None, "1"]
    name = "tasks.default.keyed"
    first = {c.source_id for c in claim(name, 10)}
    ids = [r.id.replace("-", "") if connection.vendor == "sqlite" else r.id for r in results]
    assert first == {ids[0], ids[2], ids[3], ids[4]}  # one per key; no key: not limited
    assert claim(name, 10, claimer="other:2") == []
    Execution.objects.filter(worker=name, source_id=ids[0]).update(
        status="finished", claim_token=None, lease_expires_at=None)
    assert [c.source_id for c in claim(name, 10, claimer="other:2")] == [ids[1]]


def test_flow_key_is_declared_on_a_task_and_refused_elsewhere():
    from django.core.exceptions import ImproperlyConfigured

    from django_dbworker.tasks import flow_key
    from tests.testapp import tasks

    with pytest.raises(ImproperlyConfigured, match="above @task"):
        flow_key(lambda *a: 1)(tasks.add.func)
    with pytest.raises(ImproperlyConfigured, match="give a function of the task's arguments"):
        flow_key("customer")(tasks.add)
    with pytest.raises(ValueError, match="over 255: have @flow_key return something shorter"):
        tasks.per_customer.enqueue("x" * 300, 1)
