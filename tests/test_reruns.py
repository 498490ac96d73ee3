"""Rows that come back: rerun_on (a listed column changed, whatever wrote it) and
rerun_every (a finished row is due again), on every database through real triggers."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from datetime import timedelta

import pytest
from django.db import connection
from django.db.models import F

from django_dbworker import Coordinator
from django_dbworker.models import Execution
from django_dbworker.registration.registry import registry
from django_dbworker.store import transitions
from django_dbworker.store.bridge import Bridge
from tests.helpers import (
    analyze,
    candidates,
    claim,
    drain,
    effects,
    execute,
    execution,
    held_handler,
    insert_raw,
    wait_for,
)
from tests.testapp.models import Article, Link

pytestmark = pytest.mark.django_db(transaction=True)


def finished(title="first", **fields) -> Article:
    article = Article.objects.create(title=title, **fields)
    drain("rerun_on_change")
    assert execution("rerun_on_change", article).status == "finished"
    return article


def test_a_change_by_the_orm_makes_a_finished_row_pending_again():
    article = finished()
    article.title = "second"
    article.save()
    e = execution("rerun_on_change", article)
    assert (e.status, e.rerun_reason, e.attempts) == ("pending", "changed: title", 1)
    drain("rerun_on_change")
    assert effects("rerun_on_change") == {f"{article.pk}:first": 1, f"{article.pk}:second": 1}
    e.refresh_from_db()
    assert (e.status, e.rerun_reason) == ("finished", None)


def test_a_change_by_raw_sql_and_by_bulk_update_counts_too():
    a, b = finished("a"), finished("b")
    table = connection.ops.quote_name(Article._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE {table} SET language = %s WHERE id = %s", ["fr", a.pk])
    b.language, b.title = "de", "b2"
    Article.objects.bulk_update([b], ["language", "title"])
    assert execution("rerun_on_change", a).rerun_reason == "changed: language"
    assert execution("rerun_on_change", b).rerun_reason == "changed: title, language"
    assert {execution("rerun_on_change", x).status for x in (a, b)} == {"pending"}


def test_the_same_value_or_another_column_does_not_rerun():
    article = finished(language="en")
    Article.objects.filter(pk=article.pk).update(title=F("title"), language="en")
    Article.objects.filter(pk=article.pk).update(body="edited")  # not listed
    assert execution("rerun_on_change", article).status == "finished"
    assert drain("rerun_on_change")["claimed"] == 0
    # The handler itself writes `body` on every run: that never brings the row back.
    assert effects("rerun_on_change") == {f"{article.pk}:first": 1}


def test_a_failed_row_whose_data_changed_runs_again():
    article = Article.objects.create(title="x", behaviour="fail")
    drain("rerun_on_change")
    assert execution("rerun_on_change", article).status == "failed"
    Article.objects.filter(pk=article.pk).update(title="fixed", behaviour="ok")
    assert execution("rerun_on_change", article).status == "pending"
    drain("rerun_on_change")
    assert execution("rerun_on_change", article).status == "finished"
    assert effects("rerun_on_change") == {f"{article.pk}:fixed": 1}


def test_a_row_failed_by_crashes_whose_data_changed_starts_its_crash_count_again():
    """A row quarantined after crashing its process comes back with a change like any
    failed row, and with a fresh crash count: not FAILED again at its next crash."""
    article = Article.objects.create(title="x")
    Execution.objects.filter(worker="rerun_on_change", source_id=str(article.pk)).update(
        status="failed", crashes=3, error_type="ChildDied")
    Article.objects.filter(pk=article.pk).update(title="fixed")
    e = execution("rerun_on_change", article)
    assert (e.status, e.crashes) == ("pending", 0)


def change(article_pk: int, by: str, **fields) -> None:
    """Change an article's columns through the ORM or through raw SQL."""
    if by == "orm":
        Article.objects.filter(pk=article_pk).update(**fields)
        return
    table = connection.ops.quote_name(Article._meta.db_table)
    columns = ", ".join(f"{connection.ops.quote_name(c)} = %s" for c in fields)
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE {table} SET {columns} WHERE id = %s", [*fields.values(), article_pk])


@pytest.mark.parametrize("by", ["orm", "raw_sql"])
def test_a_change_while_it_runs_makes_it_run_once_more_after_its_commit(by):
    article = Article.objects.create(title="old", behaviour="sleep:0")
    coordinator = Coordinator(["rerun_on_change"])
    with held_handler("rerun_on_change", article.pk) as held:
        coordinator.start()
        try:
            held.wait()  # the handler runs, with the old title, and waits for us
            if connection.vendor == "sqlite":
                # One writer: the UPDATE waits for the handler's commit (let go in a
                # moment), then makes the row pending.
                threading.Timer(0.5, held.release).start()
            change(article.pk, by, title="new", behaviour="ok")
            e = execution("rerun_on_change", article)
            if connection.vendor == "sqlite":
                assert e.status in ("pending", "working", "finished")
            else:
                assert (e.status, e.rerun_requested) == ("working", True)
        except BaseException:
            coordinator.stop(timeout=0)
            raise
    try:
        wait_for(lambda: effects("rerun_on_change").get(f"{article.pk}:new") == 1, timeout=60)
        wait_for(lambda: execution("rerun_on_change", article).status == "finished", timeout=30)
    finally:
        coordinator.stop()
    assert effects("rerun_on_change") == {f"{article.pk}:old": 1, f"{article.pk}:new": 1}
    e = execution("rerun_on_change", article)
    assert (e.rerun_requested, e.status) == (False, "finished")


def test_rows_changed_under_running_workers_all_run_with_their_last_values():
    """Changes through .save(), update(), bulk_update() and raw SQL to ten rows while a
    coordinator (two children, 30 ms handlers) runs them: 200 anywhere, then on until the
    last change of every row landed while that row was working. No change is lost. Every row ends finished,
    handled with its last value."""
    articles = {a.pk: a for a in (Article.objects.create(title="start", behaviour="sleep:0.03")
                                  for _ in range(10))}
    drain("rerun_on_change")
    executions = Execution.objects.filter(worker="rerun_on_change")
    last_while_working = dict.fromkeys(articles, False)
    rng = random.Random(1)
    coordinator = Coordinator(["rerun_on_change"], concurrency={"rerun_on_change": 2})
    coordinator.start()
    changes = while_working = 0
    try:
        # 200 changes to any row, then on until each row's last change hit it working.
        while (changes < 200 or not all(last_while_working.values())) and changes < 5000:
            working = {int(k) for k in executions.filter(status="working")
                       .values_list("source_id", flat=True)}
            left = [pk for pk, done in last_while_working.items() if not done]
            targets = [pk for pk in left if pk in working]
            # (after the first 200, a row done with is left alone)
            pk = rng.choice(list(articles)) if changes < 200 else rng.choice(targets or left)
            article = articles[pk]
            article.title = f"v{changes}"
            how = ("save", "update", "bulk_update", "raw_sql")[changes % 4]
            if how == "save":
                article.save(update_fields=["title"])
            elif how == "bulk_update":
                Article.objects.bulk_update([article], ["title"])
            else:
                change(pk, "orm" if how == "update" else "raw_sql", title=article.title)
            changes += 1
            while_working += pk in working
            last_while_working[pk] = pk in working
            time.sleep(rng.uniform(0, 0.005))

        def settled() -> bool:
            done = effects("rerun_on_change")
            return (all(f"{a.pk}:{a.title}" in done for a in articles.values())
                    and not executions.exclude(status="finished").exists())

        wait_for(settled, timeout=120, interval=0.2)
    finally:
        coordinator.stop()
    assert all(last_while_working.values()), "the changes never caught every row working"
    assert not executions.filter(rerun_requested=True).exists()
    handled = effects("rerun_on_change")
    assert all(handled[f"{a.pk}:{a.title}"] >= 1 for a in articles.values())
    print(f"\n{changes} changes to 10 rows under a running coordinator, {while_working} of them "
          f"while the row was working: {sum(handled.values())} runs, 0 last values lost")


def test_a_row_inserted_by_raw_sql_still_becomes_work():
    insert_raw(Article, title="raw", body="", behaviour="ok")
    drain("rerun_on_change")
    assert set(effects("rerun_on_change")) == {f"{Article.objects.get().pk}:raw"}


def test_rerun_every_brings_a_finished_row_back_when_it_is_stale():
    link = Link.objects.create(url="https://example.com")
    drain("rerun_stale")
    e = execution("rerun_stale", link)
    assert e.status == "finished" and e.next_attempt_at is not None  # waits, out of claims
    assert e.next_attempt_at - e.finished_at == timedelta(seconds=1)  # rerun_every
    assert claim("rerun_stale") == []  # not claimable before it is stale
    time.sleep(1.2)
    assert drain("rerun_stale")["finished"] == 1
    link.refresh_from_db()
    assert link.checks == 2
    e.refresh_from_db()
    assert e.status == "finished" and e.rerun_reason is None


def test_a_running_coordinator_rechecks_stale_rows_by_itself():
    link = Link.objects.create(url="https://example.org")
    coordinator = Coordinator(["rerun_stale"])
    coordinator.start()
    try:
        wait_for(lambda: Link.objects.get(pk=link.pk).checks >= 3, timeout=30, interval=0.1)
    finally:
        coordinator.stop()
    counts = Counter(k.split(":")[0] for k in effects("rerun_stale"))
    assert counts[str(link.pk)] >= 3


def test_stale_rows_are_found_through_the_waiting_index_not_the_history():
    """100,000 finished rows waiting for rerun_every: the next due time and the due rows
    come off the waiting index; nothing reads the history."""
    import os

    n = int(os.environ.get("DBWORKER_EXPLAIN_HISTORY", "100000"))
    Link.objects.bulk_create([Link(url=f"u{i}") for i in range(n)], batch_size=5000)
    Execution.objects.filter(worker="rerun_stale").update(
        status="finished", finished_at="2030-01-01T00:00:00Z",
        next_attempt_at="2030-01-01T00:00:00Z")
    analyze(Execution)
    bridge = Bridge()
    worker = registry["rerun_stale"]
    try:
        plans = []
        for stmt in (transitions.due_rows(bridge.vendor, worker.name), candidates(bridge, worker, 10)[0]):
            sql = str(stmt.compile(bridge.engine, compile_kwargs={"literal_binds": True}))
            prefix = "EXPLAIN QUERY PLAN " if connection.vendor == "sqlite" else "EXPLAIN "
            plans.append("\n".join(" ".join(map(str, r)) for r in execute(bridge, prefix + sql)))
        seconds = bridge.seconds_until_due(worker)
        promoted = bridge.promote_due(worker)
    finally:
        bridge.close()
    print("\n\n".join(plans))
    assert "dbworker_waiting" in plans[0] and "dbworker_claimable" in plans[1]
    table = Execution._meta.db_table
    for plan in plans:
        if connection.vendor == "postgresql":
            assert f"Seq Scan on {table}" not in plan and "Sort" not in plan
        elif connection.vendor == "mysql":
            assert not any(f" {table} ALL " in f" {line} " for line in plan.splitlines())
            assert "filesort" not in plan
        else:
            assert "TEMP B-TREE" not in plan and f"SCAN {table}" not in plan
    assert seconds is not None and seconds > 3600 and promoted == 0


def test_the_admin_says_why_a_done_row_runs_again(admin_client):
    from django.urls import reverse

    from django_dbworker.registration.registry import registry

    article = finished()
    Article.objects.filter(pk=article.pk).update(title="second", language="fr")
    link = Link.objects.create(url="https://example.com")
    drain("rerun_stale")
    Execution.objects.filter(pk=execution("rerun_stale", link).pk).update(
        next_attempt_at="2001-01-01T00:00:00Z", finished_at="2001-01-01T00:00:00Z")
    bridge = Bridge()
    try:
        assert bridge.promote_due(registry["rerun_stale"]) == 1  # what a coordinator does
    finally:
        bridge.close()
    page = admin_client.get(reverse("admin:django_dbworker_execution_changelist"))
    assert "re-run because title, language changed" in page.text
    # rerun_every = 1 s after it finished: stale since 2001-01-01 00:00 (local time).
    assert "stale since 2001-01-01" in page.text or "stale since 2000-12-31" in page.text
    detail = admin_client.get(reverse("admin:django_dbworker_execution_change",
                                      args=[execution("rerun_on_change", article).pk]))
    assert "re-run because title, language changed" in detail.text
