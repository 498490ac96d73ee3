"""Fair shares (issue 37): a fair worker's claims take turns across its key, so one key's
backlog does not starve another key. The workers (tests/testapp/workers.py) run on
FairJob: `fair` (key="tenant", fair=True) and `fair_keyed` (also per_key=2); the task
queue `fair` has FAIR with @flow_key (tests/testapp/tasks.py's per_tenant).

Claims here run through one Bridge, as one coordinator's claims do: where the next turn
starts is the coordinator's (Claims.fair_after).
"""

import pytest

from django_dbworker.models import Execution
from django_dbworker.registration.registry import registry
from django_dbworker.store.bridge import Bridge
from tests.helpers import wait_for
from tests.processes import Coordinators
from tests.testapp.models import FairJob

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def bridge():
    bridge = Bridge()
    yield bridge
    bridge.close()


def jobs(tenants, delay=0.0) -> list[FairJob]:
    return [FairJob.objects.create(tenant=t, delay=delay) for t in tenants]


def backlog(tenant: int, n: int) -> None:
    FairJob.objects.bulk_create([FairJob(tenant=tenant) for _ in range(n)], batch_size=2000)


def tenants_of(claims) -> list[int | None]:
    tenant = dict(FairJob.objects.filter(pk__in=[int(c.source_id) for c in claims])
                  .values_list("pk", "tenant"))
    return [tenant[int(c.source_id)] for c in claims]


def end(worker: str, claims) -> None:
    """The claimed rows' attempts end (as committed outcomes would end them)."""
    Execution.objects.filter(worker=worker, source_id__in=[c.source_id for c in claims]).update(
        status="finished", claim_token=None, lease_expires_at=None)


def test_a_claim_takes_the_first_row_of_every_key_then_the_second(bridge):
    rows = jobs([1, 1, 1, 2, 2, 2, 3, 3, 3])
    claimed = bridge.claim(registry["fair"], 6, "test:1")
    by_tenant = {1: rows[0:3], 2: rows[3:6], 3: rows[6:9]}
    assert [c.source_id for c in claimed] == [
        str(by_tenant[t][i].pk) for i in (0, 1) for t in (1, 2, 3)]


def test_claims_of_one_row_go_round_the_keys_and_the_rows_without_a_key(bridge):
    jobs([1, 1, 2, 2, None, None, 3, 3])
    order = []
    for _ in range(8):
        claims = bridge.claim(registry["fair"], 1, "test:1")
        order += tenants_of(claims)
        end("fair", claims)
    assert order == [1, 2, 3, None, 1, 2, 3, None]


def test_a_lone_key_starts_within_one_claim_while_a_backlog_of_another_drains(bridge):
    backlog(1, 10_000)
    w = registry["fair"]
    for _ in range(5):  # the backlog drains, four rows a claim
        claims = bridge.claim(w, 4, "test:1")
        assert tenants_of(claims) == [1, 1, 1, 1]
        end("fair", claims)
    lone = jobs([2])[0]
    claims = bridge.claim(w, 4, "test:1")
    assert str(lone.pk) in [c.source_id for c in claims]
    assert sorted(tenants_of(claims), key=str) == [1, 1, 1, 2]


def test_a_claim_of_thousands_of_rows_takes_turns_across_at_most_max_turns_keys(bridge):
    """A coordinator of many children claims thousands of rows at once; each key is a
    branch of the claim's UNION ALL, and SQLite refused more than 500 of them ("too many
    terms in compound SELECT"). The next claim goes on with the keys after."""
    from django_dbworker.vendors.claiming import ClaimWithinLimits

    FairJob.objects.bulk_create([FairJob(tenant=t) for t in range(700)], batch_size=2000)
    w, most = registry["fair"], ClaimWithinLimits.MAX_TURNS
    first = bridge.claim(w, 1024, "test:1")
    assert len(set(tenants_of(first))) == len(first) == most
    second = bridge.claim(w, 1024, "test:1")
    assert len(second) == most
    assert not set(tenants_of(first)) & set(tenants_of(second))
    backlog(700, 3000)  # one key's backlog: a claim takes more than one row a turn
    end("fair", first + second)
    Execution.objects.filter(worker="fair").exclude(source_id__in=[
        str(pk) for pk in FairJob.objects.filter(tenant=700).values_list("pk", flat=True)
    ]).update(status="finished", claim_token=None, lease_expires_at=None)
    assert len(bridge.claim(w, 1024, "test:1")) == 1024


def test_a_fair_claim_keeps_per_key_and_counts_the_rows_other_claims_hold(bridge):
    jobs([1] * 5 + [2] * 5)
    jobs([3], delay=100)  # not eligible (fair_keyed's eligible())
    first = bridge.claim(registry["fair_keyed"], 8, "test:1")
    assert sorted(tenants_of(first)) == [1, 1, 2, 2]  # per_key=2
    other = Bridge()
    try:
        assert other.claim(registry["fair_keyed"], 8, "other:1") == []
        end("fair_keyed", first[:1])
        again = other.claim(registry["fair_keyed"], 8, "other:1")
        assert tenants_of(again) == tenants_of(first[:1])
    finally:
        other.close()


def test_rows_made_before_the_worker_had_its_key_get_it_when_installed():
    from django_dbworker.installation.triggers import install

    rows = jobs([5, 6])
    Execution.objects.filter(worker="fair").update(flow_key=None)
    install("default", [registry["fair"]])
    assert dict(Execution.objects.filter(worker="fair").values_list("source_id", "flow_key")) == {
        str(rows[0].pk): "5", str(rows[1].pk): "6"}


def test_a_fair_task_queue_takes_turns_across_its_flow_keys(bridge):
    from tests.testapp.tasks import per_tenant

    for n in range(3):
        per_tenant.enqueue("a", n)
    per_tenant.enqueue("b", 0)
    claimed = bridge.claim(registry["tasks.default.fair"], 2, "test:1")
    keys = dict(Execution.objects.filter(worker="tasks.default.fair")
                .values_list("source_id", "flow_key"))
    assert [keys[c.source_id] for c in claimed] == ["a", "b"]


@pytest.mark.solo
def test_a_coordinator_claims_a_lone_keys_row_within_a_claim_of_its_arrival():
    """A real coordinator drains a 10,000-row backlog of one tenant (4 processes); a row
    of another tenant arrives while it does. At most one claim's rows of the backlog (a
    claim takes at most 4 x Pool.MAX_AHEAD rows) are claimed after it arrived and before
    it: the first claim that sees it takes it. Without fair shares the rest of the
    backlog, thousands of rows, would be claimed first."""
    from django_dbworker.processes.pool import Pool

    backlog(1, 10_000)
    FairJob.objects.filter(tenant=1).update(delay=0.002)
    group = Coordinators(1, "--worker", "fair", "--concurrency", "fair=4",
                         "--status-interval", "5")
    group.wait_started()
    fair = Execution.objects.filter(worker="fair")
    wait_for(lambda: fair.filter(status="finished").count() >= 500, timeout=120)
    lone = jobs([2])[0]
    mine = fair.filter(source_id=str(lone.pk))
    wait_for(lambda: mine.get().started_at is not None, timeout=60)
    arrived, claimed = mine.values_list("ready_at", "started_at").get()
    between = fair.filter(started_at__gt=arrived, started_at__lt=claimed).count()
    left = fair.filter(status="pending").count()
    assert group.stop() == [0]
    assert between <= 4 * Pool.MAX_AHEAD, f"{between} backlog rows were claimed before it"
    assert left > 1_000  # (it arrived with the backlog far from drained)
