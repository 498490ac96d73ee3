"""Claims: ordering, exclusivity between claimers, and plans that ignore history."""

import os
import threading
import time

import pytest
from django.db import connection

from django_dbworker.models import Execution
from django_dbworker.registration.registry import registry
from django_dbworker.store.bridge import Bridge
from tests.helpers import analyze, claim, claim_sql, drain, effects, execute
from tests.testapp.models import Author, Document, Effect

pytestmark = pytest.mark.django_db(transaction=True)


def order_of(worker):
    return [int(s) for s in Effect.objects.filter(worker=worker).order_by("id")
            .values_list("source_id", flat=True)]


def test_default_order_is_creation_order():
    docs = [Document.objects.create() for _ in range(6)]
    drain("docs", concurrency=1)
    assert order_of("docs") == [d.pk for d in docs]


def test_descending_order_with_nulls_respected():
    a = Document.objects.create(priority=1)
    b = Document.objects.create(priority=5)
    c = Document.objects.create(priority=None)
    d = Document.objects.create(priority=5)
    Document.objects.create(priority=9, uploaded=False)  # not eligible
    drain("ordered_desc")
    expected = list(Document.objects.filter(uploaded=True).order_by("-priority", "id")
                    .values_list("pk", flat=True))
    assert order_of("ordered_desc") == expected
    assert set(expected) == {a.pk, b.pk, c.pk, d.pk}


def test_one_claim_of_many_rows_returns_them_in_the_custom_order():
    import random

    rng = random.Random(3)
    for _ in range(40):
        Document.objects.create(priority=rng.choice([None, *range(10)]))
    expected = [str(pk) for pk in Document.objects.filter(uploaded=True)
                .order_by("-priority", "id").values_list("pk", flat=True)]
    claims = claim("ordered_desc", 25)
    assert [c.source_id for c in claims] == expected[:25]


def test_order_across_a_relation():
    low, high = Author.objects.create(name="low", rank=1), Author.objects.create(name="high", rank=7)
    d1 = Document.objects.create(author=low)
    d2 = Document.objects.create(author=high)
    d3 = Document.objects.create(author=high)
    Document.objects.create(author=None)  # filtered out across the relation
    drain("by_author")
    assert order_of("by_author") == [d2.pk, d3.pk, d1.pk]


def test_nulls_last_ordering_expression():
    from django.db.models import F

    from django_dbworker.store.claims import ordering_terms

    _, terms = ordering_terms([F("priority").desc(nulls_last=True), "-id", "title"])
    assert [(t.descending, t.nulls_last) for t in terms] == [(True, True), (True, False), (False, False)]


def test_claims_take_only_claimable_rows_and_mark_them_working():
    docs = [Document.objects.create() for _ in range(3)]
    bridge = Bridge()
    try:
        claims = bridge.claim(registry["docs"], 10, "test:1")
        assert sorted(int(c.source_id) for c in claims) == [d.pk for d in docs]
        assert bridge.claim(registry["docs"], 10, "test:2") == []
        rows = Execution.objects.filter(worker="docs")
        assert {r.status for r in rows} == {"working"}
        assert all(r.lease_expires_at and r.claim_token and r.attempts == 1 for r in rows)
        assert {r.claimed_by for r in rows} == {"test:1"}
        # Releasing an unstarted claim restores the row as it was.
        for c in claims:
            assert bridge.release(c)
        assert {(r.status, r.attempts, r.claim_token) for r in rows.all()} == {("pending", 0, None)}
    finally:
        bridge.close()


def test_concurrent_claimers_never_get_the_same_row():
    Document.objects.bulk_create([Document() for _ in range(300)])
    worker = registry["docs"]
    got: list[list[str]] = [[] for _ in range(4)]
    errors = []

    def claimer(i):
        bridge = Bridge()
        try:
            while True:
                claims = bridge.claim(worker, 7, f"thread:{i}")
                if not claims:
                    return
                got[i].extend(c.source_id for c in claims)
        except Exception as exc:  # surfaced below
            errors.append(exc)
        finally:
            bridge.close()

    threads = [threading.Thread(target=claimer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    everything = [s for g in got for s in g]
    assert len(everything) == 300 and len(set(everything)) == 300
    assert sum(1 for g in got if g) >= 2  # the work was actually shared


def test_expired_leases_are_recovered_and_renewed_leases_are_not():
    Document.objects.create()
    Document.objects.create()
    bridge = Bridge(lease_seconds=60)
    try:
        held, lapsed = bridge.claim(registry["docs"], 2, "test:1")
        Execution.objects.filter(pk=lapsed.execution_id).update(lease_expires_at="2000-01-01T00:00:00Z")
        assert bridge.renew([held]) == 1
        assert bridge.recover_expired(registry["docs"]) == 1
        assert Execution.objects.get(pk=lapsed.execution_id).status == "unfinished"
        assert Execution.objects.get(pk=held.execution_id).status == "working"
        # The old holder can neither renew nor release the recovered row.
        assert bridge.renew([lapsed]) == 0
        assert bridge.release(lapsed) is False
    finally:
        bridge.close()


def explain(bridge, worker):
    sql = claim_sql(bridge, worker, 10)
    prefix = {"postgresql": "EXPLAIN ", "mysql": "EXPLAIN ", "sqlite": "EXPLAIN QUERY PLAN "}[connection.vendor]
    return "\n".join(" ".join(str(c) for c in row) for row in execute(bridge, prefix + sql))


def driving_access(plan: str) -> str:
    """The plan line of the first table read: the outer side of every join, which drives
    the statement (PostgreSQL lists the outer child first; SQLite and MySQL list tables in
    join order)."""
    for line in plan.splitlines():
        if connection.vendor == "postgresql" and " on " in line and "Scan" in line:
            return line.strip()
        if connection.vendor == "sqlite" and (" SCAN " in f" {line}" or " SEARCH " in f" {line}"):
            return line
        if connection.vendor == "mysql" and line.split()[2:3] != ["None"]:
            return line
    raise AssertionError(f"no table access in the plan:\n{plan}")


@pytest.mark.parametrize("worker", ["docs", "ordered_desc", "uuids"])
def test_the_claim_plan_reads_the_claimable_index_not_the_history(worker):
    """Claim cost must not grow with history: no full scan of Execution."""
    w = registry[worker]
    table = w.source._meta.db_table
    # DBWORKER_EXPLAIN_HISTORY=100000 reproduces the figure in the docs.
    finished = int(os.environ.get("DBWORKER_EXPLAIN_HISTORY", "20000"))
    if w.source is Document:
        Document.objects.bulk_create([Document() for _ in range(finished)], batch_size=5000)
        Document.objects.bulk_create([Document() for _ in range(20)])
    else:
        import uuid
        w.source.objects.bulk_create([w.source(id=uuid.uuid4()) for _ in range(finished + 20)],
                                     batch_size=5000)
    done = list(Execution.objects.filter(worker=worker).order_by("id")
                .values_list("id", flat=True)[:finished])
    for start in range(0, len(done), 10000):
        Execution.objects.filter(id__in=done[start:start + 10000]).update(status="finished")
    analyze(Execution, w.source)
    bridge = Bridge()
    try:
        plan = explain(bridge, w)
    finally:
        bridge.close()
    print(plan)
    execution = Execution._meta.db_table
    assert "dbworker_claimable" in plan
    # The SPEC's trap: the planner walks an index in key order (the source's primary key,
    # or Execution's own: the history) and probes the other side row by row. The claimable
    # index must drive: the first table the plan reads is Execution, through it.
    first = driving_access(plan)
    assert execution in first and "dbworker_claimable" in first, f"driven by {first!r}:\n{plan}"
    if connection.vendor == "mysql":  # id, select_type, table, type, possible_keys, key...
        fields = first.split()
        assert fields[3] not in ("ALL", "index"), f"a walk of a whole index:\n{plan}"
        assert fields[5].startswith("dbworker_claimable"), f"driven by key {fields[5]}:\n{plan}"
    for scanned in (execution, table):  # neither the history nor the source is read whole
        if connection.vendor == "postgresql":
            assert f"Seq Scan on {scanned}" not in plan
        elif connection.vendor == "mysql":
            assert not any(f" {scanned} ALL " in f" {line} " for line in plan.splitlines()), plan
        else:
            assert not any(line.split(" ", 3)[-1].startswith(f"SCAN {scanned}")
                           for line in plan.splitlines()), plan
    # And it still claims correctly.
    drain(worker)
    assert len(effects(worker)) == 20


def test_a_backlog_is_claimed_from_the_last_full_claim_on_and_rows_given_back_below_it_are_not_lost():
    """In a backlog each claim starts where the last full claim started (its floor), not
    at the first row ever claimed: a long drain stays as fast as a short one (see FLOOR
    in bridge.py). A row that becomes claimable again below the floor (given back here;
    a retry or a recovered row alike) is claimed by the next claim that comes back
    short, or by the claim that looks from the start once in every FLOOR_SECONDS, also
    while every claim comes back full."""
    from django_dbworker.store.claims import FLOOR_SECONDS

    docs = [Document.objects.create() for _ in range(8)]
    worker = registry["docs"]
    bridge = Bridge()
    try:
        def claim(n):
            return bridge.claim(worker, n, "test:1")

        def pks(claims):
            return [int(c.source_id) for c in claims]

        first = claim(3)
        assert pks(first) == [d.pk for d in docs[:3]]
        assert pks(claim(3)) == [d.pk for d in docs[3:6]]  # the floor is now docs[3]
        assert bridge.release(first[1])  # claimable again, below the floor
        # The full claim before started at docs[3]: so does this one; docs[1] waits.
        assert pks(claim(2)) == [d.pk for d in docs[6:8]]
        # The backlog ran out: this claim came back short and looked from the start.
        assert pks(claim(3)) == [docs[1].pk]
        assert claim(3) == []

        # A floor lives FLOOR_SECONDS: then the first claimable rows come first again.
        more = [Document.objects.create() for _ in range(5)]
        low = claim(2)
        assert pks(low) == [d.pk for d in more[:2]]
        assert pks(claim(2)) == [d.pk for d in more[2:4]]  # the floor is now more[2]
        assert bridge.release(low[1])
        time.sleep(FLOOR_SECONDS + 0.1)
        assert pks(claim(1)) == [more[1].pk]  # not more[4], which is above the old floor
        assert pks(claim(3)) == [more[4].pk]

        # Also while every claim comes back full (a steady backlog): the floor keeps the
        # time it was first set, so a claim looks from the start within FLOOR_SECONDS.
        steady = [Document.objects.create() for _ in range(4)]
        held = [claim(1)[0] for _ in steady]  # each one full: the floor is steady[3]
        assert pks(held) == [d.pk for d in steady]
        assert bridge.release(held[2])
        released_at, seen = time.monotonic(), []
        while steady[2].pk not in seen and time.monotonic() - released_at < 3 * FLOOR_SECONDS:
            Document.objects.create()
            seen += pks(claim(1))
        waited = time.monotonic() - released_at
        assert steady[2].pk in seen, f"not claimed in {waited:.1f}s of full claims"
        assert waited < FLOOR_SECONDS + 0.5, waited
    finally:
        bridge.close()
