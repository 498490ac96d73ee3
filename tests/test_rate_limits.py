"""Rate limits (issue 37): ``rate="N/period"``, decided inside the claim under the worker's
lock, so no window of the period holds more than N claimed rows however many coordinators
claim. The workers (tests/testapp/workers.py) run on KeyedJob: `rated` (5 per 2 s) and
`rated_fast` (50/s).
"""

import time
from collections import Counter

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import connection

from django_dbworker import worker
from django_dbworker.models import Execution, RateLog
from django_dbworker.registration.rates import Rate, parse_rate
from django_dbworker.registration.registry import Registry, registry
from django_dbworker.store.bridge import Bridge
from django_dbworker.store.engine import as_datetime
from tests.helpers import claim, effects
from tests.processes import Coordinators
from tests.testapp.models import KeyedJob

pytestmark = pytest.mark.django_db(transaction=True)


def jobs(n: int, delay: float = 0.0) -> list[KeyedJob]:
    return KeyedJob.objects.bulk_create([KeyedJob(delay=delay) for _ in range(n)])


def test_a_rate_takes_its_count_then_says_when_the_next_row_may_be_claimed():
    jobs(12)
    bridge = Bridge()
    try:
        rated = registry["rated"]
        assert len(bridge.claim(rated, 10, "test:1")) == 5
        assert bridge.rate_wait(rated) is not None  # used up, rows left: wait for a token
        # Another claimer (another host) gets nothing, and learns how long to wait.
        assert claim("rated", 10, claimer="other:2") == []
        assert bridge.claim(rated, 10, "test:1") == []
        wait = bridge.rate_wait(rated)
        assert wait is not None and 0 < wait <= 2.0, wait
        # Ending the running rows frees no token: a rate counts claims, not running rows.
        Execution.objects.filter(worker="rated", status="working").update(
            status="finished", claim_token=None, lease_expires_at=None)
        assert bridge.claim(rated, 10, "test:1") == []
        time.sleep(bridge.rate_wait(rated) + 0.1)
        assert len(bridge.claim(rated, 10, "test:1")) == 5
        time.sleep(bridge.rate_wait(rated) + 0.1)
        assert len(bridge.claim(rated, 10, "test:1")) == 2  # the last two rows
        assert bridge.rate_wait(rated) is None  # none left behind: nothing to wait for
    finally:
        bridge.close()
    # The log holds the last period's claims only (older ones go as claims count).
    assert RateLog.objects.filter(worker="rated").count() <= 3


def test_the_window_slides_a_token_comes_back_one_period_after_its_claim():
    jobs(10)
    bridge = Bridge()
    try:
        rated = registry["rated"]
        assert len(bridge.claim(rated, 2, "test:1")) == 2
        time.sleep(1.0)
        assert len(bridge.claim(rated, 10, "test:1")) == 3  # 5 in the window now
        wait = bridge.rate_wait(rated)
        assert wait is not None and 0.3 < wait <= 1.05, wait  # the first claim's 2 come back
        time.sleep(wait + 0.1)
        assert len(bridge.claim(rated, 10, "test:1")) == 2  # those 2, not 5
    finally:
        bridge.close()


@pytest.mark.solo  # (threads racing on purpose: alone, not beside another lane)
def test_claims_racing_in_threads_never_take_more_than_the_rate():
    from tests.test_flow_control import sampled_claims

    jobs(100)
    claimed = sampled_claims("rated", threads=6, rounds=1, ask=5)
    assert len(claimed) == 5 and len(set(claimed)) == 5, claimed


# What every claim of the 50/s test logged, kept: the rate log itself holds only the last
# second (claims delete older entries), so a trigger of the test's copies each entry.
SEEN_DDL = {
    "postgresql": ["CREATE TABLE dbw_test_rate_seen (at timestamptz, claimed integer)",
                   "CREATE FUNCTION dbw_test_rate_seen() RETURNS trigger AS $$ BEGIN "
                   "INSERT INTO dbw_test_rate_seen VALUES (NEW.at, NEW.claimed); RETURN NEW; "
                   "END $$ LANGUAGE plpgsql",
                   "CREATE TRIGGER dbw_test_rate_seen AFTER INSERT ON django_dbworker_ratelog "
                   "FOR EACH ROW EXECUTE FUNCTION dbw_test_rate_seen()"],
    "mysql": ["CREATE TABLE dbw_test_rate_seen (at datetime(6), claimed integer)",
              "CREATE TRIGGER dbw_test_rate_seen AFTER INSERT ON django_dbworker_ratelog "
              "FOR EACH ROW INSERT INTO dbw_test_rate_seen VALUES (NEW.at, NEW.claimed)"],
    "sqlite": ["CREATE TABLE dbw_test_rate_seen (at text, claimed integer)",
               "CREATE TRIGGER dbw_test_rate_seen AFTER INSERT ON django_dbworker_ratelog "
               "BEGIN INSERT INTO dbw_test_rate_seen VALUES (NEW.at, NEW.claimed); END"],
}
SEEN_DROP = {
    "postgresql": ["DROP TRIGGER IF EXISTS dbw_test_rate_seen ON django_dbworker_ratelog",
                   "DROP FUNCTION IF EXISTS dbw_test_rate_seen()",
                   "DROP TABLE IF EXISTS dbw_test_rate_seen"],
    "mysql": ["DROP TRIGGER IF EXISTS dbw_test_rate_seen", "DROP TABLE IF EXISTS dbw_test_rate_seen"],
    "sqlite": ["DROP TRIGGER IF EXISTS dbw_test_rate_seen", "DROP TABLE IF EXISTS dbw_test_rate_seen"],
}


def _run_sql(statements: list[str]) -> None:
    with connection.cursor() as cursor:
        for sql in statements:
            cursor.execute(sql)


@pytest.mark.solo  # (several coordinators: alone, as the stress test is)
@pytest.mark.parametrize("coordinators,concurrency,rows", [(3, 4, 1500), (2, 2, 1000)])
def test_coordinators_never_claim_more_than_fifty_in_any_second_and_never_sit_idle(
        coordinators, concurrency, rows):
    """1,500 rows at 50/s take 30 s (1,000: 20 s). Every claim's time and size, as the
    rate log has them, is kept by a trigger of the test's; no window of one second,
    wherever it starts, holds more than 50 rows, every row ran once, and the rate was
    used: no two claims more than a period and a half apart (a rate waits at most a
    period for its next token; two coordinators of 2 children each once sat idle for 8 s
    when a token was due at once, RATE_WAIT_LEAST)."""
    jobs(rows, delay=0.002)
    _run_sql(SEEN_DROP[connection.vendor] + SEEN_DDL[connection.vendor])
    try:
        coordinators = 2 if connection.vendor == "sqlite" else coordinators
        group = Coordinators(coordinators, "--worker", "rated_fast", "--status-interval", "5",
                             "--concurrency", f"rated_fast={concurrency}")
        group.wait_started()
        started = time.monotonic()
        deadline = started + 120
        while Execution.objects.filter(worker="rated_fast", status="finished").count() < rows:
            assert group.alive(), group.report()
            assert time.monotonic() < deadline, group.report()
            time.sleep(0.2)
        elapsed = time.monotonic() - started
        assert group.stop() == [0] * coordinators, group.report()
        with connection.cursor() as cursor:
            cursor.execute("SELECT at, claimed FROM dbw_test_rate_seen")
            claims = sorted((as_datetime(at).timestamp(), n) for at, n in cursor.fetchall())
    finally:
        _run_sql(SEEN_DROP[connection.vendor])
    counted = effects("rated_fast")
    assert len(counted) == rows and set(counted.values()) == {1}
    # Every row's claim was logged (a row given back and claimed again is claimed twice).
    assert sum(n for _, n in claims) >= rows
    busiest = 0
    for i, (start, _) in enumerate(claims):  # every window that starts at a claim
        busiest = max(busiest, sum(n for at, n in claims[i:] if at < start + 1.0))
    assert busiest <= 50, busiest
    assert busiest >= 40, busiest  # the rate was reached, not only kept
    gap, after = max((b[0] - a[0], a[0] - claims[0][0]) for a, b in zip(claims, claims[1:], strict=False))
    assert gap < 1.5, f"no claim for {gap:.1f}s, {after:.1f}s into the run"
    assert elapsed < rows / 50 * 1.5, elapsed
    print(f"\n{connection.vendor}: {coordinators} coordinators, {rows} rows at 50/s in "
          f"{elapsed:.1f}s, {len(claims)} claims of {sum(n for _, n in claims)} rows, "
          f"busiest second {busiest}")


def test_a_task_queue_takes_a_rate_from_its_options():
    from django_dbworker.tasks.queues import queue_workers

    rates = {w.queue: (w.rate, w.limited) for w in queue_workers()}
    assert rates["capped"] == ("600/m", True) and rates["default"] == (None, False)
    assert parse_rate("100/m") == Rate(100, 60.0) and str(Rate(100, 60.0)) == "100/m"
    assert parse_rate("10/30s") == Rate(10, 30.0) and str(Rate(10, 30.0)) == "10/30s"


@pytest.mark.parametrize("rate", ["100", "0/s", "5/0s", "5/d", "many/m", 5])
def test_a_bad_rate_is_refused_naming_the_fix(rate):
    with pytest.raises(ImproperlyConfigured, match=r"rate must be a rate such as '100/m'"):
        worker(name="bad_rate", source=KeyedJob, rate=rate, registry=Registry())(lambda job: None)


def test_why_not_running_names_the_rate_and_when_its_next_token_comes():
    from django_dbworker.admin.diagnosis import diagnose

    first, *_, last = jobs(6)
    assert len(claim("rated", 10)) == 5
    findings = {f.what: f for f in diagnose("rated", last)}
    limit = findings["rate"]
    assert limit.blocking and "rate 5/2s: 5 claimed in the last 2 s" in limit.detail, limit
    assert "next row may be claimed in" in limit.detail, limit
    assert Counter(Execution.objects.filter(worker="rated").values_list("status", flat=True)) == {
        "working": 5, "pending": 1}
    assert not {f.what: f for f in diagnose("rated", first)}["rate"].blocking  # it runs


def test_metrics_count_the_rows_a_limit_holds_back():
    """dbworker_throttled_rows: what the last claim passed over, by the limit that held
    it. 12 rows at 5 per 2 s: 7 held by the rate, then 2, then none."""
    from tests.helpers import runworkers, wait_for
    from tests.processes import Output
    from tests.test_operations import free_port, get, samples

    jobs(12)
    port = free_port()
    proc = runworkers("--worker", "rated", "--metrics-port", str(port))
    output = Output(proc)
    seen = []

    def held() -> float | None:
        try:
            found = samples(get(port, "/metrics")[1])
        except OSError:  # (not listening yet)
            return None
        value = found.get(("dbworker_throttled_rows", (("limit", "rate"), ("queue", ""),
                                                      ("worker", "rated"))))
        seen.append(value)
        return value

    try:
        wait_for(lambda: held() in (7, 2), timeout=60, interval=0.05)
        wait_for(lambda: Execution.objects.filter(worker="rated", status="finished").count() == 12,
                 timeout=60)
        wait_for(lambda: held() == 0, timeout=30)
    finally:
        proc.terminate()
        assert output.wait(timeout=60) == 0, output.err
    assert set(seen) <= {None, 0, 2, 7}, seen  # nothing else was ever held


def test_the_dashboard_shows_each_limit_and_what_it_holds_back(admin_client):
    from django.urls import reverse

    jobs(8)
    assert len(claim("rated", 10)) == 5
    assert len(claim("capped", 10)) == 3
    claim("keyed", 10)  # every row has key None: not limited per key, all 8 run at once
    response = admin_client.get(reverse("admin:django_dbworker_dashboard"))
    assert response.status_code == 200
    limits = {w.name: w.limits for w in response.context["dashboard"].workers}
    assert limits["rated"] == ["rate 5/2s: 5 claimed in the last 2 s, 3 held back"]
    assert limits["capped"] == ["total: 3 of 3 running, 5 held back"]
    assert limits["keyed"] == ["per customer: 0 keys at 1 running"]
    assert limits["docs"] == []
    assert "rate 5/2s: 5 claimed in the last 2 s, 3 held back" in response.text


def test_a_rate_per_key_holds_for_each_key_apart():
    """2 per 2 s for each customer: a key's third row waits for its token while other
    keys' rows run; rows without a key are not limited per key."""
    rows = KeyedJob.objects.bulk_create([KeyedJob(customer=c) for c in
                                         [1, 1, 1, 2, 2, 2, None, None, None]])
    bridge = Bridge()
    try:
        w = registry["rated_per_key"]
        first = [c.source_id for c in bridge.claim(w, 20, "test:1")]
        assert first == [str(rows[i].pk) for i in (0, 1, 3, 4, 6, 7, 8)]
        assert bridge.throttled()["rated_per_key"] == {"per_key": 0, "total": 0, "rate": 2}
        assert bridge.claim(w, 20, "test:1") == []  # every key used its 2 tokens
        wait = bridge.rate_wait(w)
        assert wait is not None and 0 < wait <= 2.0, wait
        # Ending rows frees no token; the worker has no rate of its own.
        Execution.objects.filter(worker="rated_per_key", status="working").update(
            status="finished", claim_token=None, lease_expires_at=None)
        assert bridge.claim(w, 20, "test:1") == []
        time.sleep(wait + 0.1)
        assert sorted(c.source_id for c in bridge.claim(w, 20, "test:1")) == sorted(
            str(rows[i].pk) for i in (2, 5))
    finally:
        bridge.close()
    assert set(RateLog.objects.filter(worker="rated_per_key").values_list("key", flat=True)) == {
        "1", "2"}


def test_rate_per_key_needs_a_rate_and_a_key():
    with pytest.raises(ImproperlyConfigured, match="rate_per_key=True needs rate="):
        worker(name="bad", source=KeyedJob, key="customer", rate_per_key=True,
               registry=Registry())(lambda job: None)
    with pytest.raises(ImproperlyConfigured, match="rate_per_key=True needs key="):
        worker(name="bad", source=KeyedJob, rate="5/s", rate_per_key=True,
               registry=Registry())(lambda job: None)


def test_why_and_the_dashboard_show_a_rate_per_key(admin_client):
    from django.urls import reverse

    from django_dbworker.admin.diagnosis import diagnose

    rows = KeyedJob.objects.bulk_create([KeyedJob(customer=c) for c in [5, 5, 5, None]])
    assert len(claim("rated_per_key", 10)) == 3
    rate = {f.what: f for f in diagnose("rated_per_key", rows[2])}["rate"]
    assert rate.blocking and "rate 2/2s per customer, customer 5: 2 claimed in the last 2 s" in rate.detail
    assert "next row may be claimed in" in rate.detail
    assert not {f.what: f for f in diagnose("rated_per_key", rows[3])}["rate"].blocking
    dashboard = admin_client.get(reverse("admin:django_dbworker_dashboard")).context["dashboard"]
    limits = {w.name: w.limits for w in dashboard.workers}
    assert limits["rated_per_key"] == ["rate 2/2s per customer: 1 key at their rate"]
