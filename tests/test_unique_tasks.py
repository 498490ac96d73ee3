"""Unique and debounced tasks (issue 37): ``@unique`` above ``@task()``.

An enqueue of a key whose task still counts returns that task; concurrent enqueues of one
key take turns on the key's row, so exactly one task exists however many race; a debounced
key's pending task takes the latest arguments and its run_after moves on.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import connections, transaction
from django.utils import timezone

from django_dbworker.models import Execution, Task, TaskUniqueKey
from django_dbworker.tasks import unique, uniqueness
from django_dbworker.tasks.compat import TaskResultStatus
from tests.helpers import at_once, drain, effects
from tests.testapp import tasks

pytestmark = pytest.mark.django_db(transaction=True)
DEFAULT = "tasks.default.default"


def execution_of(result) -> Execution:
    return Execution.objects.get(worker=DEFAULT, source_id__in=[
        str(result.id), result.id.replace("-", "")])


def run_until_finished(result, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not tasks.reindex.get_result(result.id).is_finished:
        assert time.monotonic() < deadline, "the task did not run"
        drain(DEFAULT)
        time.sleep(0.05)


def test_an_enqueue_of_a_pending_key_returns_the_pending_task():
    first = tasks.refresh.enqueue("a")
    again = tasks.refresh.enqueue("a")
    other = tasks.refresh.enqueue("b")  # other arguments: another key
    assert again.id == first.id and other.id != first.id
    assert again.status == TaskResultStatus.READY and again.args == ["a"]
    assert Task.objects.count() == 2
    assert drain(DEFAULT)["finished"] == 2
    assert effects("task.refresh") == {"a": 1, "b": 1}
    # Finished, the task no longer holds its key: the next enqueue adds one.
    later = tasks.refresh.enqueue("a")
    assert later.id != first.id and later.status == TaskResultStatus.READY
    assert Task.objects.count() == 3


def test_the_key_function_picks_what_makes_two_enqueues_the_same():
    first = tasks.recount.enqueue(7, note="first")
    assert tasks.recount.enqueue(7, note="second").id == first.id
    assert tasks.recount.enqueue(8, note="second").id != first.id
    # The same key in another task is another key.
    assert tasks.refresh.enqueue(7).id != first.id
    drain(DEFAULT)
    assert effects("task.recount") == {"7:first": 1, "8:second": 1}


def test_pending_counts_until_the_task_starts_and_pending_or_running_until_it_ends():
    """A running task holds its key only under among="pending_or_running"."""
    from django_dbworker.store.session import OnDjango
    from django_dbworker.store.transitions import claim_rows

    held = tasks.refresh.enqueue("running")
    sync = tasks.sync_customer.enqueue(5)
    assert claim_rows(OnDjango("default"), [execution_of(r).pk for r in (held, sync)],
                      "x" * 32, "test:1", 60) == 2
    assert tasks.refresh.enqueue("running").id != held.id
    again = tasks.sync_customer.enqueue(5)
    assert again.id == sync.id and again.status == TaskResultStatus.RUNNING
    # A key function that returns None: this enqueue is not unique.
    assert tasks.sync_customer.enqueue(None).id != tasks.sync_customer.enqueue(None).id


def test_within_its_window_a_task_holds_its_key_whatever_it_became():
    """within=10 min: finished, failed or running, the task enqueued less than 10 minutes
    ago is what every enqueue of its key returns; past the window, an enqueue adds one."""
    first = tasks.notify.enqueue("w")
    assert drain(DEFAULT)["finished"] == 1
    again = tasks.notify.enqueue("w")
    assert again.id == first.id and again.status == TaskResultStatus.SUCCESSFUL
    Execution.objects.filter(pk=execution_of(first).pk).update(status="failed")
    assert tasks.notify.enqueue("w").id == first.id
    assert tasks.notify.enqueue("v").id != first.id  # (another key: its own window)
    # Made 10 minutes and a second ago by the database's clock: the window has passed.
    from django_dbworker.vendors import for_connection

    ago = for_connection(connections["default"]).now_expression(-601)
    Execution.objects.filter(pk=execution_of(first).pk).update(created_at=ago)
    later = tasks.notify.enqueue("w")
    assert later.id != first.id and later.status == TaskResultStatus.READY
    drain(DEFAULT)
    assert effects("task.notify") == {"w": 2, "v": 1}


def test_a_failed_task_no_longer_holds_its_key():
    first = tasks.refresh.enqueue("fails")
    Execution.objects.filter(pk=execution_of(first).pk).update(status="failed")
    assert tasks.refresh.enqueue("fails").id != first.id


def test_a_deleted_task_no_longer_holds_its_key():
    first = tasks.refresh.enqueue("deleted")
    Task.objects.filter(pk=first.id).delete()
    assert tasks.refresh.enqueue("deleted").id != first.id


def test_a_unique_enqueue_rolls_back_with_the_caller():
    with pytest.raises(RuntimeError), transaction.atomic():
        tasks.refresh.enqueue("rolled back")
        raise RuntimeError("the request fails")
    assert not Task.objects.exists()
    kept = tasks.refresh.enqueue("rolled back")  # the key holds nothing that is gone
    assert Task.objects.get().pk.hex == kept.id.replace("-", "")


def test_a_deduplicated_enqueue_sends_no_task_enqueued_signal():
    from django_dbworker.tasks.compat import task_enqueued

    sent = []

    def seen(sender, task_result, **kwargs):
        sent.append(task_result.id)

    task_enqueued.connect(seen)
    try:
        first = tasks.refresh.enqueue("signal")
        tasks.refresh.enqueue("signal")
    finally:
        task_enqueued.disconnect(seen)
    assert sent == [first.id]


def _race(enqueue, threads: int) -> list[str]:
    """``threads`` enqueues at once, each in a transaction of its own (with a connection
    of its own) that stays open a moment after its enqueue, so the others pile up on the
    key. Returns the result ids."""

    def one(n: int) -> list[str]:
        with transaction.atomic():
            found = [enqueue().id]
            time.sleep(0.02)
        return found

    return at_once(threads, 1, one)


@pytest.mark.solo  # (50 connections racing on purpose: alone, not beside another lane)
def test_fifty_concurrent_enqueues_of_one_key_make_exactly_one_task():
    """First when the key has no row yet (the enqueues meet on its unique index), then
    again when its row holds a finished task (they meet on the row's lock): both times
    one task, and every enqueue returned it."""
    for round_ in range(3):
        ids = _race(lambda: tasks.recount.enqueue(42, note="race"), threads=50)
        tasks_now = Task.objects.filter(task_path=tasks.recount.module_path)
        pending = tasks_now.exclude(pk__in=Task.objects.filter(finished_at__isnull=False))
        assert pending.count() == 1, (round_, pending.count())
        assert {i.replace("-", "") for i in ids} == {pending.get().pk.hex}, round_
        assert TaskUniqueKey.objects.count() == 1
        assert drain(DEFAULT)["finished"] == 1
    assert effects("task.recount") == {"42:race": 3}


def test_a_debounced_key_runs_once_with_the_last_arguments_after_the_last_enqueue():
    first = tasks.reindex.enqueue("doc", 1)
    assert first.task.run_after is not None  # debounced: never at once
    time.sleep(0.2)
    for version in (2, 3):
        latest = tasks.reindex.enqueue("doc", version)
        assert latest.id == first.id and latest.args == ["doc", version]
    enqueued_last = timezone.now()
    row = Task.objects.get()
    assert row.args == ["doc", 3] and row.run_after >= enqueued_last + timedelta(seconds=0.3)
    assert execution_of(first).next_attempt_at == row.run_after  # the claim waits for it
    assert not Execution.objects.filter(worker=DEFAULT).claimable().exists()  # not due yet
    run_until_finished(first)
    result = tasks.reindex.get_result(first.id)
    assert result.status == TaskResultStatus.SUCCESSFUL and result.return_value == 3
    assert result.started_at >= row.run_after
    assert effects("task.reindex") == {"doc:3": 1}


@pytest.mark.solo  # (a claim held open by a thread while another enqueues)
def test_a_debounce_that_meets_a_claim_adds_a_task_rather_than_change_the_running_one():
    """The pending task is being claimed (its claim not committed yet) when a debounced
    enqueue comes: the enqueue waits for the claim, then adds a task with its arguments.
    The claimed task keeps the arguments it runs with, and the last arguments still run."""
    from django_dbworker.store.session import OnDjango
    from django_dbworker.store.transitions import claim_rows

    first = tasks.reindex.enqueue("raced", 1)
    claimed, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def claimer() -> None:
        try:
            with transaction.atomic():
                assert claim_rows(OnDjango("default"), [execution_of(first).pk],
                                  "t" * 32, "test:1", 60) == 1
                claimed.set()
                release.wait(timeout=60)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            claimed.set()
        finally:
            connections.close_all()

    thread = threading.Thread(target=claimer)
    thread.start()
    assert claimed.wait(timeout=30) and not errors, errors
    threading.Timer(0.5, release.set).start()
    second = tasks.reindex.enqueue("raced", 2)  # waits for the claim's commit
    thread.join(timeout=60)
    assert not errors, errors
    assert second.id != first.id and second.args == ["raced", 2]
    assert Task.objects.get(pk=first.id).args == ["raced", 1]  # as its handler reads them
    assert Execution.objects.get(pk=execution_of(first).pk).status == "working"
    assert execution_of(second).status == "pending"


@pytest.mark.parametrize("options,message", [
    ({"among": "running"}, "among='running' is not one of"),
    ({"key": "customer"}, "key must be a function"),
    ({"debounce": 0}, "debounce must be a positive number"),
    ({"debounce": 5, "among": "pending_or_running"}, 'debounce needs among="pending"'),
    ({"within": -1}, "within must be a positive number"),
    ({"within": 60, "debounce": 5}, "use debounce or within, not both"),
])
def test_bad_declarations_are_refused_naming_the_fix(options, message):
    with pytest.raises(ImproperlyConfigured, match=message):
        unique(**options)(tasks.add)
    with pytest.raises(ImproperlyConfigured, match="above @task"):
        unique()(tasks.add.func)
    assert uniqueness.rule_for(tasks.add.module_path) is None  # nothing was declared


def test_a_key_too_long_is_refused_at_enqueue_and_nothing_is_stored():
    with pytest.raises(ValueError, match="over 255: have key= return something shorter"):
        tasks.recount.enqueue("x" * 300)
    assert not Task.objects.exists() and not TaskUniqueKey.objects.exists()



def test_prune_deletes_the_keys_of_the_tasks_it_deletes_and_no_other():
    from django.core.management import call_command

    old = tasks.refresh.enqueue("old")
    drain(DEFAULT)
    kept = tasks.refresh.enqueue("kept")  # pending: neither it nor its key is pruned
    long_ago = timezone.now() - timedelta(days=40)
    Task.objects.filter(pk=old.id).update(finished_at=long_ago)
    Execution.objects.filter(pk=execution_of(old).pk).update(finished_at=long_ago)
    assert TaskUniqueKey.objects.count() == 2
    call_command("prune_tasks", "--older-than", "30")
    assert [k.task_id.hex for k in TaskUniqueKey.objects.all()] == [kept.id.replace("-", "")]
    assert tasks.refresh.enqueue("old").id != old.id  # the key starts afresh


def test_the_task_admin_shows_the_key_a_task_holds(admin_client):
    from django.urls import reverse

    held = tasks.recount.enqueue("customer-<9>", note="admin")
    plain = tasks.add.enqueue(1, 2)
    page = admin_client.get(reverse("admin:django_dbworker_task_change", args=[held.id]))
    assert page.status_code == 200
    assert "Unique key" in page.text and "customer-&lt;9&gt;" in page.text  # escaped
    page = admin_client.get(reverse("admin:django_dbworker_task_change", args=[plain.id]))
    assert page.status_code == 200 and "customer-" not in page.text
