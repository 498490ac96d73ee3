"""The django.tasks backend, end to end on every database through real children: the
contract as Django documents it, and what only a database that is also the queue gives."""

from __future__ import annotations

import datetime as dt
import os
import re
import signal
import socket
import time

import pytest
from django.contrib.admin.models import LogEntry
from django.core.management import call_command
from django.db import connection, transaction
from django.utils import timezone

from django_dbworker import Coordinator
from django_dbworker.models import Execution, Task
from django_dbworker.tasks.compat import (
    InvalidTask,
    TaskResultDoesNotExist,
    TaskResultStatus,
    task_backends,
)
from tests.helpers import (
    analyze,
    busy_machine,
    claim_and_run_group,
    claim_sql,
    drain,
    effects,
    execute,
    runworkers,
    statements_of,
    wait_for,
)
from tests.testapp import tasks
from tests.testapp.models import Author, Effect, SignalSeen

pytestmark = pytest.mark.django_db(transaction=True)
DEFAULT = "tasks.default.default"


def executions(result):
    return Execution.objects.get(source_id__in=[str(result.id), result.id.replace("-", "")])


def run(*queues: str, **overrides):
    return drain(*(queues or (DEFAULT,)), **overrides)


# -- the contract ----------------------------------------------------------------------------
def test_the_flags_tell_the_truth():
    backend = task_backends["default"]
    assert (backend.supports_defer, backend.supports_priority, backend.supports_get_result,
            backend.supports_async_task) == (True, True, True, True)


def test_enqueue_returns_a_ready_result_and_the_row_becomes_work():
    result = tasks.add.enqueue(2, 3)
    assert result.status == TaskResultStatus.READY and result.enqueued_at is not None
    assert result.args == [2, 3] and result.kwargs == {} and result.backend == "default"
    assert result.worker_ids == [] and result.attempts == 0 and not result.is_finished
    with pytest.raises(ValueError, match="not finished"):
        _ = result.return_value
    e = executions(result)
    assert (e.worker, e.status) == (DEFAULT, "pending")  # made by the trigger
    stats = run()
    assert stats["finished"] == 1
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL and result.return_value == 5
    assert result.started_at and result.last_attempted_at and result.finished_at
    assert result.started_at <= result.finished_at
    # One attempt, by this process's coordinator (host:pid, as claimed_by says).
    assert result.attempts == 1 and result.worker_ids == [f"{socket.gethostname()}:{os.getpid()}"]
    again = tasks.add.get_result(result.id)
    assert again.return_value == 5 and again.status == TaskResultStatus.SUCCESSFUL
    assert effects("task.add") == {"2+3": 1}


@pytest.mark.parametrize("value", [
    [1, "two", None, True, {"a": [1.5]}],
    {"nested": {"list": [1, 2], "none": None}},
])
def test_arguments_and_return_values_round_trip_through_json(value):
    result = tasks.echo.enqueue(value, key=value)
    run()
    result.refresh()
    assert result.return_value == {"args": [value], "kwargs": {"key": value}}
    assert tasks.echo.get_result(result.id).args == [value]


def test_arguments_that_are_not_json_are_refused_at_enqueue():
    with pytest.raises(TypeError, match="must round-trip through JSON"):
        tasks.echo.enqueue(object())
    with pytest.raises(TypeError, match="must round-trip through JSON"):
        tasks.echo.enqueue(when=timezone.now())
    assert not Task.objects.exists()


def test_a_return_value_that_is_not_json_is_a_failure_saying_so():
    result = tasks.not_json.enqueue()
    run()
    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    [error] = result.errors
    assert error.exception_class_path == "builtins.TypeError" and "not JSON" in error.traceback


@pytest.mark.parametrize("change,message", [
    ({"priority": 101}, "priority must be a whole number"),
    ({"queue_name": "nope"}, "Queue 'nope' is not valid"),
    ({"run_after": dt.datetime(2030, 1, 1)}, "run_after must be an aware datetime"),
])
def test_invalid_tasks_are_refused(change, message):
    with pytest.raises(InvalidTask, match=message):
        tasks.add.using(**change).enqueue(1, 2)
    assert not Task.objects.exists()


def test_a_failure_records_the_class_path_and_traceback_and_rolls_back():
    result = tasks.fail.enqueue("broken")
    run()
    result.refresh()
    assert result.status == TaskResultStatus.FAILED and result.finished_at
    [error] = result.errors
    assert error.exception_class_path == "builtins.ValueError"
    assert error.exception_class is ValueError
    assert "ValueError: broken" in error.traceback
    with pytest.raises(ValueError, match="Task failed"):
        _ = result.return_value
    assert effects("task.fail") == {}  # the task's write rolled back with it


def test_a_commit_inside_a_task_is_a_failure_naming_the_fix():
    result = tasks.commit_inside.enqueue()
    run()
    assert executions(result).status == "failed"
    assert "Don't commit in a handler" in executions(result).error_message


def _run_in_one_group(n, tamper=None, *, monkeypatch):
    """Claim n tasks of the default queue and run them as one group, as a child would:
    the SQL it sent, and what run_group() returned."""
    sent, (claims, results, _) = statements_of(
        lambda: claim_and_run_group(DEFAULT, n, tamper, monkeypatch=monkeypatch))
    assert len(claims) == n
    return sent, claims, results


@pytest.mark.parametrize("returns", ["values", "none"])  # (none: an all-NULL column)
def test_a_group_of_tasks_writes_their_results_in_one_statement(returns, monkeypatch):
    if returns == "values":
        results, expected = [tasks.add.enqueue(i, 10) for i in range(4)], [10, 11, 12, 13]
    else:
        results, expected = [tasks.nothing.enqueue(i) for i in range(4)], [None] * 4
    sent, _, done = _run_in_one_group(4, monkeypatch=monkeypatch)
    assert [kind for kind, _, _ in done] == ["done"] * 4
    table = Task._meta.db_table
    # One call for the group, not a save per task (PostgreSQL: one UPDATE of all four rows;
    # elsewhere one executemany()).
    task_updates = [sql for sql in sent if sql.upper().startswith("UPDATE") and table in sql]
    assert len(task_updates) == 1
    for result, value in zip(results, expected, strict=True):
        result.refresh()
        assert result.status == TaskResultStatus.SUCCESSFUL and result.return_value == value
        assert result.started_at == result.last_attempted_at <= result.finished_at
        assert len(result.worker_ids) == 1 and result.attempts == 1 and result.errors == []
    assert len(effects("task.add") if returns == "values" else effects("task.nothing")) == 4


def test_a_group_with_a_failing_task_keeps_its_error_and_the_others_results(monkeypatch):
    first, failing, last = tasks.add.enqueue(1, 2), tasks.fail.enqueue("no"), tasks.nothing.enqueue(3)
    _run_in_one_group(3, monkeypatch=monkeypatch)
    for result in (first, failing, last):
        result.refresh()
    assert (first.status, first.return_value) == (TaskResultStatus.SUCCESSFUL, 3)
    assert (last.status, last.return_value) == (TaskResultStatus.SUCCESSFUL, None)
    assert failing.status == TaskResultStatus.FAILED and failing.finished_at is not None
    assert [e.exception_class_path for e in failing.errors] == ["builtins.ValueError"]
    assert effects("task.add") == {"1+2": 1} and effects("task.fail") == {}
    finished = SignalSeen.objects.filter(kind="finished").values_list("key", flat=True)
    assert sorted(finished) == sorted(f"{r.id}:{r.status}" for r in (first, failing, last))


def test_a_task_whose_claim_was_lost_in_a_group_saves_no_result(monkeypatch):
    """The results are written before the claim-guarded outcomes: a lost claim must take
    its task's result back with it, and leave its neighbours' in place."""
    results = [tasks.add.enqueue(i, 1) for i in range(3)]

    def take_over(claims):  # another coordinator took the second task (its lease ran out)
        Execution.objects.filter(pk=claims[1].execution_id).update(claim_token="someone-else")

    _, claims, done = _run_in_one_group(3, take_over, monkeypatch=monkeypatch)
    kinds = {execution_id: kind for kind, execution_id, _ in done}
    assert kinds.pop(claims[1].execution_id) == "lost" and set(kinds.values()) == {"done"}
    lost = next(r for r in results if str(r.id).replace("-", "") == claims[1].source_id.replace("-", ""))
    row = Task.objects.get(pk=lost.id)
    assert (row.started_at, row.finished_at, row.return_value, row.worker_ids) == (
        None, None, None, [])
    assert Execution.objects.get(pk=claims[1].execution_id).status == "working"
    for result in results:
        if result is not lost:
            result.refresh()
            assert result.status == TaskResultStatus.SUCCESSFUL and result.finished_at
    assert len(effects("task.add")) == 2
    finished = SignalSeen.objects.filter(kind="finished").values_list("key", flat=True)
    assert sorted(finished) == sorted(f"{r.id}:{r.status}" for r in results if r is not lost)


@pytest.mark.parametrize("n", [1, 3])  # a task alone, and in a group
def test_a_task_that_sets_rollback_loses_its_writes_and_keeps_its_result(n, monkeypatch):
    results = [tasks.discard.enqueue(f"k{i}") for i in range(n)]
    _, _, done = _run_in_one_group(n, monkeypatch=monkeypatch)
    assert [kind for kind, _, _ in done] == ["done"] * n
    for i, result in enumerate(results):
        result.refresh()
        assert result.status == TaskResultStatus.SUCCESSFUL and result.return_value == f"k{i}"
        assert result.finished_at is not None and len(result.worker_ids) == 1
    assert effects("task.discard") == {}
    finished = SignalSeen.objects.filter(kind="finished").values_list("key", flat=True)
    assert sorted(finished) == sorted(f"{r.id}:{TaskResultStatus.SUCCESSFUL}" for r in results)


def test_get_result_of_an_unknown_id():
    for bad in ["00000000-0000-0000-0000-000000000000", "not-a-uuid"]:
        with pytest.raises(TaskResultDoesNotExist):
            task_backends["default"].get_result(bad)


def test_retries_with_context_count_attempts():
    result = tasks.flaky.enqueue("k", succeed_on=3)
    for _ in range(20):
        run("tasks.default.retries")
        result.refresh()
        if result.is_finished:
            break
        time.sleep(0.05)
    assert result.status == TaskResultStatus.SUCCESSFUL and result.return_value == 3
    assert result.attempts == 3 and len(result.worker_ids) == 3
    assert [e.exception_class_path for e in result.errors] == ["builtins.RuntimeError"] * 2
    assert effects("task.flaky") == {"k:3": 1}  # the failed attempts' writes rolled back


def test_async_tasks_run_in_the_child():
    result = tasks.async_add.enqueue(20, 22)
    run()
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL and result.return_value == 42
    assert effects("task.async_add") == {"20+22": 1}


def test_signals_are_sent_by_the_enqueuing_process_and_the_child():
    result = tasks.add.enqueue(1, 1)
    run()
    rows = {k: list(SignalSeen.objects.filter(kind=k).values_list("key", "pid"))
            for k in ("enqueued", "started", "finished")}
    assert rows["enqueued"] == [(f"{result.id}:READY", os.getpid())]
    [(started, child_pid)] = rows["started"]
    assert started == f"{result.id}:RUNNING" and child_pid != os.getpid()
    assert rows["finished"] == [(f"{result.id}:SUCCESSFUL", child_pid)]


def test_other_backends_and_queues_are_workers_of_their_own():
    result = tasks.add.using(backend="other").enqueue(3, 4)
    email = tasks.add.using(queue_name="emails").enqueue(5, 6)
    assert executions(result).worker == "tasks.other.default"
    assert executions(email).worker == "tasks.default.emails"
    assert run()["claimed"] == 0  # the default queue has none of them
    run("tasks.other.default", "tasks.default.emails")
    assert task_backends["other"].get_result(result.id).return_value == 7
    with pytest.raises(TaskResultDoesNotExist):
        task_backends["default"].get_result(result.id)  # another backend's task


# -- transactional enqueue --------------------------------------------------------------------
def test_an_enqueue_rolled_back_with_the_caller_leaves_nothing():
    with pytest.raises(RuntimeError), transaction.atomic():
        Author.objects.create(name="rolled back")
        tasks.add.enqueue(1, 2)
        raise RuntimeError("the request fails")
    assert not Task.objects.exists() and not Execution.objects.filter(worker=DEFAULT).exists()
    assert run()["claimed"] == 0


def test_an_enqueue_commits_with_the_caller():
    with transaction.atomic():
        author = Author.objects.create(name="kept")
        result = tasks.add.enqueue(author.pk, 1)
        # Not claimable before the commit: other connections do not see it yet.
        assert Task.objects.filter(pk=result.id).exists()
    run()
    assert tasks.add.get_result(result.id).return_value == author.pk + 1


def test_a_task_enqueued_by_a_row_handler_commits_with_the_handlers_writes():
    ok = Author.objects.create(name="enqueue")
    failing = Author.objects.create(name="enqueue-and-fail")
    drain("enqueuer")
    assert effects("enqueuer") == {str(ok.pk): 1}
    assert list(Task.objects.values_list("args", flat=True)) == [[f"from-author-{ok.pk}"]]
    run()
    assert effects("task.record") == {f"from-author-{ok.pk}": 1}
    del failing


# -- order: priority and run_after ------------------------------------------------------------
def test_higher_priority_runs_first_then_enqueue_order():
    import random

    rng = random.Random(5)
    wanted = []
    for i in range(30):
        priority = rng.choice([-100, -5, 0, 0, 7, 100])
        tasks.ordered.using(priority=priority).enqueue(i)
        wanted.append((-priority, i))
    run(concurrency=1)
    order = [int(k) for k in Effect.objects.filter(worker="task.ordered").order_by("id")
             .values_list("source_id", flat=True)]
    assert order == [i for _, i in sorted(wanted)]


def test_a_deferred_task_runs_not_before_its_run_after():
    later = tasks.add.using(run_after=timezone.now() + dt.timedelta(hours=1)).enqueue(1, 2)
    soon = tasks.add.using(run_after=timezone.now() + dt.timedelta(seconds=2)).enqueue(3, 4)
    now = tasks.add.enqueue(5, 6)
    deadline = time.monotonic() + 60
    while not tasks.add.get_result(soon.id).is_finished:
        assert time.monotonic() < deadline
        run()
    assert tasks.add.get_result(now.id).status == TaskResultStatus.SUCCESSFUL
    finished = tasks.add.get_result(soon.id)
    assert finished.status == TaskResultStatus.SUCCESSFUL
    assert finished.started_at >= soon.task.run_after  # not before its time
    assert tasks.add.get_result(later.id).status == TaskResultStatus.READY


def test_a_running_coordinator_starts_a_deferred_task_at_its_time_by_itself():
    coordinator = Coordinator([DEFAULT])
    coordinator.start()
    try:
        time.sleep(0.5)  # idle: it knows of nothing due
        due = timezone.now() + dt.timedelta(seconds=1.5)
        result = tasks.add.using(run_after=due).enqueue(7, 8)
        wait_for(lambda: tasks.add.get_result(result.id).is_finished, timeout=30, interval=0.05)
    finally:
        coordinator.stop()
    assert tasks.add.get_result(result.id).started_at >= due


# -- failures, crashes, timeouts --------------------------------------------------------------
def test_a_task_past_its_queues_timeout_fails_with_the_timeout_in_its_errors():
    result = tasks.hang.enqueue("slow")
    run("tasks.default.emails")
    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    assert [e.exception_class_path for e in result.errors] == ["builtins.TimeoutError"]
    assert effects("task.hang") == {}


def test_a_killed_child_never_loses_a_task():
    result = tasks.record.enqueue("crash", sleep=1.5)
    from tests.testapp.workers import pid_file

    marker = pid_file("task.record", "crash")
    marker.unlink(missing_ok=True)
    coordinator = Coordinator([DEFAULT], concurrency=1)
    coordinator.start()
    try:
        wait_for(marker.exists, timeout=60)
        os.kill(int(marker.read_text()), signal.SIGKILL)
        marker.unlink()
        wait_for(lambda: tasks.record.get_result(result.id).is_finished, timeout=60)
    finally:
        coordinator.stop()
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL and result.attempts == 2
    assert effects("task.record") == {"crash": 1}


def test_a_killed_coordinator_never_loses_a_task():
    result = tasks.record.enqueue("killed", sleep=30)
    from tests.testapp.workers import pid_file

    marker = pid_file("task.record", "killed")
    marker.unlink(missing_ok=True)
    proc = runworkers("--queue", "default")
    wait_for(marker.exists, timeout=60)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    assert executions(result).status == "working"
    Task.objects.filter(pk=result.id).update(kwargs={"sleep": 0})
    wait_for(lambda: run()["finished"] == 1, timeout=60, interval=0.5)
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL and result.attempts == 2
    assert effects("task.record") == {"killed": 1}


@pytest.mark.solo  # on a busy machine of its own making
def test_two_coordinators_run_a_thousand_tasks_none_twice():
    n = 1000
    with transaction.atomic():
        for i in range(n):
            tasks.record.enqueue(i)
    with busy_machine(1):
        procs = [runworkers("--drain", "--queue", "default") for _ in range(2)]
        outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert effects("task.record") == {str(i): 1 for i in range(n)}
    # Each coordinator's last line counts its claims and the rows it gave back unrun (rows
    # waiting behind a handler that ran long, on a busy machine): each of those was claimed
    # once more. Every claim is accounted for, and both coordinators took part.
    claimed = [int(re.search(r"claimed (\d+)", o).group(1)) for o, _ in outs]
    released = [int(re.search(r"released (\d+)", o).group(1)) for o, _ in outs]
    assert sum(claimed) - sum(released) == n and all(c > 0 for c in claimed), (
        claimed, released, [o[-2000:] + e[-2000:] for o, e in outs])


# -- retention and the admin ------------------------------------------------------------------
def test_prune_deletes_old_ended_tasks_and_nothing_else(capsys):
    done, failed, waiting = tasks.add.enqueue(1, 1), tasks.fail.enqueue("x"), None
    run()
    waiting = tasks.add.using(run_after=timezone.now() + dt.timedelta(days=9)).enqueue(2, 2)
    long_ago = timezone.now() - dt.timedelta(days=40)
    Task.objects.filter(pk__in=[done.id, failed.id, waiting.id]).update(enqueued_at=long_ago)
    Task.objects.filter(pk__in=[done.id, failed.id]).update(finished_at=long_ago)
    Execution.objects.filter(worker=DEFAULT, status__in=["finished", "failed"]).update(
        finished_at=long_ago)
    call_command("prune_tasks", "--older-than", "30", "--dry-run")
    assert "Would delete 2 task(s)" in capsys.readouterr().out
    assert Task.objects.count() == 3
    call_command("prune_tasks", "--older-than", "30")
    assert "Deleted 2 task(s)" in capsys.readouterr().out
    assert list(Task.objects.values_list("pk", flat=True)) == [_uuid(waiting.id)]
    # Nothing dangling: the deleted tasks' executions went with them.
    assert Execution.objects.filter(worker=DEFAULT).count() == 1


def _uuid(text):
    import uuid

    return uuid.UUID(text)


def test_admin_actions_need_the_change_permission(admin_client, client, django_user_model):
    from django.contrib.auth.models import Permission
    from django.urls import reverse

    failed, done = tasks.fail.enqueue("admin"), tasks.add.enqueue(1, 2)
    run()
    url = reverse("admin:django_dbworker_task_changelist")
    page = admin_client.get(url)
    assert page.status_code == 200 and "dbworker-status--failed" in page.text
    assert admin_client.get(reverse("admin:django_dbworker_task_change", args=[failed.id])).status_code == 200
    viewer = django_user_model.objects.create_user("viewer", password="pw", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_task"))
    client.force_login(viewer)
    assert client.get(url).context["action_form"] is None
    client.post(url, {"action": "retry_failed", "_selected_action": [failed.id]})
    assert executions(failed).status == "failed"
    response = admin_client.post(url, {"action": "retry_failed",
                                       "_selected_action": [failed.id, done.id]}, follow=True)
    assert "Retried failed tasks: 1 changed, 1 skipped (not failed)." in response.text
    assert executions(failed).status == "unfinished"
    assert LogEntry.objects.filter(change_message="Retried failed task.").count() == 1
    admin_client.post(url, {"action": "run_again", "_selected_action": [done.id]})
    assert executions(done).status == "unfinished"


# -- claim cost ---------------------------------------------------------------------------------
def test_the_claim_plan_reads_the_priority_index_not_the_backlog_or_history():
    """100,000 ready tasks of mixed priorities and 20,000 finished ones: the claim reads
    the first rows of the claimable index in (priority, id) order, sorting nothing."""
    import random

    from django_dbworker.registration.registry import registry
    from django_dbworker.store.bridge import Bridge

    rng = random.Random(1)
    ready = int(os.environ.get("DBWORKER_EXPLAIN_BACKLOG", "100000"))
    rows = [Task(backend="default", queue_name="default", task_path="tests.testapp.tasks.add",
                 priority=rng.randrange(-100, 101), args=[1, 2]) for _ in range(ready + 20_000)]
    Task.objects.bulk_create(rows, batch_size=5000)
    done = list(Execution.objects.filter(worker=DEFAULT).order_by("id")
                .values_list("id", flat=True)[:20_000])
    for i in range(0, len(done), 10_000):
        Execution.objects.filter(id__in=done[i:i + 10_000]).update(status="finished")
    analyze(Execution, Task)
    expected = list(Execution.objects.filter(worker=DEFAULT, status="pending")
                    .order_by("-priority", "id").values_list("id", flat=True)[:32])
    bridge = Bridge()
    try:
        sql = claim_sql(bridge, registry[DEFAULT], 32)
        prefix = "EXPLAIN QUERY PLAN " if connection.vendor == "sqlite" else "EXPLAIN "
        plan = "\n".join(" ".join(str(c) for c in r) for r in execute(bridge, prefix + sql))
        claims = bridge.claim(registry[DEFAULT], 32, "test:plan")
    finally:
        bridge.close()
    print(plan)
    assert "dbworker_claimable_priority" in plan
    if connection.vendor == "postgresql":
        assert "Sort" not in plan and "Seq Scan" not in plan
    elif connection.vendor == "mysql":
        assert "filesort" not in plan and "temporary" not in plan
    else:
        assert "TEMP B-TREE" not in plan
    assert [c.execution_id for c in claims] == expected  # the 32 first, in claim order


# -- the backend under a real client: its path, its signals, old rows, its input --------------
@pytest.mark.parametrize("path", ["django_dbworker.tasks.backend.DatabaseBackend",
                                  "tests.testapp.backends.SubclassedBackend"])
def test_the_backend_is_recognised_by_its_class_not_its_path(path):
    from django.conf import settings
    from django.test import override_settings

    from django_dbworker.registration.registry import registry
    from django_dbworker.tasks.queues import QueueWorker, is_database_backend, register_queues

    def unregister_queues():
        for name in [n for n, w in registry.items() if isinstance(w, QueueWorker)]:
            registry.unregister(name)

    unregister_queues()
    try:
        with override_settings(TASKS={**settings.TASKS, "default": {
                **settings.TASKS["default"], "BACKEND": path}}):
            register_queues()  # what the app does when it is ready
            assert {DEFAULT, "tasks.default.emails", "tasks.default.retries"} <= set(registry)
            backend = task_backends["default"]
            assert f"{type(backend).__module__}.{type(backend).__qualname__}" == path
            assert backend.check() == []
            result = tasks.add.enqueue(20, 22)
            assert run()["finished"] == 1  # (it was: no worker named tasks.default.default)
            assert tasks.add.get_result(result.id).return_value == 42
    finally:
        unregister_queues()
        register_queues()  # as tests/settings.py has them
    assert not is_database_backend("django.tasks.backends.immediate.ImmediateBackend")
    assert not is_database_backend("tests.testapp.models.Author")  # a class, not ours
    assert not is_database_backend("no.such.Backend")


def _seen(kind):
    return sorted(SignalSeen.objects.filter(kind=kind).values_list("key", flat=True))


def test_task_started_is_committed_before_the_task_runs_and_outlives_a_failure():
    failing, looking = tasks.fail.enqueue("no"), tasks.sees_its_start.enqueue()
    run()
    looking.refresh()
    # Another connection saw the record of task_started while the task ran...
    assert looking.status == TaskResultStatus.SUCCESSFUL and looking.return_value is True
    # ... and a failed task's record of it was not rolled back with the task's writes.
    assert _seen("started") == sorted([f"{failing.id}:RUNNING", f"{looking.id}:RUNNING"])
    assert _seen("finished") == sorted([f"{failing.id}:FAILED", f"{looking.id}:SUCCESSFUL"])
    assert effects("task.fail") == {}


def test_a_group_announces_each_task_once_outside_its_transaction(monkeypatch):
    """A group's rows are announced before its transaction opens; rows the group does not
    reach (its time is up after each row here) are not announced again."""
    from collections import deque
    from multiprocessing.sharedctypes import RawArray, RawValue

    from django_dbworker.processes import child
    from django_dbworker.processes import groups as grouping
    from django_dbworker.registration.registry import registry
    from tests.helpers import claim

    results = [tasks.add.enqueue(1, 2), tasks.fail.enqueue("in a group"), tasks.nothing.enqueue(3)]
    monkeypatch.setattr(grouping, "GROUP_SECONDS", 0.0)
    pending = deque(c.delivery(c.execution_id) for c in claim(DEFAULT, 3, "test:group"))
    slot, groups = RawArray("d", child.SLOT_SIZE), 0
    while pending:
        child.run_group(registry[DEFAULT], "default", pending, slot, RawValue("b", 0))
        groups += 1
    assert groups == 3  # one row each: the others came back to the front, unrun
    assert _seen("started") == sorted(f"{r.id}:RUNNING" for r in results)
    for result in results:
        result.refresh()
    assert [r.status for r in results] == [TaskResultStatus.SUCCESSFUL, TaskResultStatus.FAILED,
                                           TaskResultStatus.SUCCESSFUL]


def test_a_receiver_that_raises_is_logged_and_the_task_runs(monkeypatch, caplog):
    from django_dbworker.tasks.compat import task_started

    def broken(sender, task_result, **kwargs):
        raise RuntimeError("the monitor is down")

    task_started.connect(broken, dispatch_uid="test-broken")
    try:
        result = tasks.add.enqueue(1, 1)
        _run_in_one_group(1, monkeypatch=monkeypatch)
    finally:
        task_started.disconnect(dispatch_uid="test-broken")
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL and result.return_value == 2
    assert "A task_started receiver" in caplog.text and "the monitor is down" in caplog.text


def test_get_result_of_a_task_that_no_longer_imports_is_the_stored_result():
    result = tasks.add.enqueue(2, 2)
    run()
    Task.objects.filter(pk=result.id).update(task_path="tests.testapp.renamed_module.add")
    stored = task_backends["default"].get_result(result.id)
    assert stored.status == TaskResultStatus.SUCCESSFUL and stored.return_value == 4
    assert stored.task.module_path == "tests.testapp.renamed_module.add"
    assert stored.args == [2, 2] and stored.attempts == 1
    with pytest.raises(ImportError, match="cannot be imported"):
        stored.task.call(2, 2)


def test_a_stored_task_path_runs_no_module_code_outside_the_project(capfd):
    import sys

    if "this" in sys.modules:
        pytest.skip("something imported the module this already")
    result = tasks.add.enqueue(1, 2)
    Task.objects.filter(pk=result.id).update(task_path="this.x")
    stored = task_backends["default"].get_result(result.id)  # in this process
    assert stored.status == TaskResultStatus.READY and stored.task.module_path == "this.x"
    run()  # and in a child
    failed = task_backends["default"].get_result(result.id)
    assert failed.status == TaskResultStatus.FAILED
    [error] = failed.errors
    assert error.exception_class_path == "builtins.ImportError"
    assert "'this.x' is not in an installed app" in error.traceback
    assert "this" not in sys.modules and "Zen of Python" not in "".join(capfd.readouterr())
    assert f"{result.id}:FAILED" in _seen("finished")


@pytest.mark.parametrize("argument,error,message", [
    (float("nan"), ValueError, "must be standard JSON: NaN and Infinity are not"),
    ({"x": [float("inf")]}, ValueError, "must be standard JSON"),
    (-float("inf"), ValueError, "must be standard JSON"),
    ("nested", ValueError, "nest lists or dicts more than 100 deep"),
    ("cycle", ValueError, "nest lists or dicts more than 100 deep"),
    ("x" * (1024 * 1024 + 1), ValueError, r"over the backend's MAX_ARGUMENT_BYTES \(1048576\)"),
])
def test_arguments_a_worker_could_not_read_back_are_refused_in_one_line(argument, error, message):
    if argument == "nested":
        argument = []
        for _ in range(5000):
            argument = [argument]
    elif argument == "cycle":
        argument = []
        argument.append(argument)
    with pytest.raises(error, match=message) as refused:
        tasks.ignore.enqueue(argument)
    assert "\n" not in str(refused.value) and "tests.testapp.tasks.ignore" in str(refused.value)
    assert not Task.objects.exists()


def test_arguments_up_to_the_limits_are_stored_and_run_and_one_more_is_refused():
    deepest = None
    for _ in range(100):
        deepest = [deepest]
    # The default size limit counts the stored JSON: ["x...x"] and {} (6 characters).
    results = [tasks.ignore.enqueue(deepest), tasks.ignore.enqueue("x" * (1024 * 1024 - 6))]
    with pytest.raises(ValueError, match="more than 100 deep"):
        tasks.ignore.enqueue([deepest])
    with pytest.raises(ValueError, match="are 1048577 bytes as JSON"):
        tasks.ignore.enqueue("x" * (1024 * 1024 - 5))
    run()
    for result in results:
        result.refresh()
        assert result.status == TaskResultStatus.SUCCESSFUL
    assert tasks.ignore.get_result(results[0].id).args == [deepest]


def test_the_argument_size_limit_is_an_option(settings):
    settings.TASKS = {**settings.TASKS, "default": {
        **settings.TASKS["default"],
        "OPTIONS": {**settings.TASKS["default"]["OPTIONS"], "MAX_ARGUMENT_BYTES": 100}}}
    tasks.ignore.enqueue("x" * 90)
    with pytest.raises(ValueError, match=r"are 106 bytes as JSON, over .* \(100\)"):
        tasks.ignore.enqueue("x" * 100)
    settings.TASKS["default"]["OPTIONS"]["MAX_ARGUMENT_BYTES"] = None
    tasks.ignore.enqueue("x" * (2 * 1024 * 1024))
    assert Task.objects.count() == 2


@pytest.mark.parametrize("value,ok", [(None, True), (10, True), (0, False), (-1, False),
                                      ("1MB", False), (True, False), (1.5, False)])
def test_the_check_says_what_a_good_argument_size_limit_is(value, ok, settings):
    settings.TASKS = {**settings.TASKS, "default": {
        **settings.TASKS["default"],
        "OPTIONS": {**settings.TASKS["default"]["OPTIONS"], "MAX_ARGUMENT_BYTES": value}}}
    errors = task_backends["default"].check()
    if ok:
        assert errors == []
    else:
        [error] = errors
        assert error.id == "django_dbworker.E020" and "MAX_ARGUMENT_BYTES must be a whole number" in error.msg
        with pytest.raises(Exception, match="MAX_ARGUMENT_BYTES must be a whole number"):
            tasks.nothing.enqueue(1)


def test_a_return_value_that_is_not_standard_json_fails_the_attempt_saying_so():
    result = tasks.returns_nan.enqueue()
    run()
    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    [error] = result.errors
    assert error.exception_class_path == "builtins.ValueError"
    assert "returned NaN or Infinity" in error.traceback


def test_the_task_admin_filters_by_status(admin_client):
    from django.urls import reverse

    failed, done = tasks.fail.enqueue("filtered"), tasks.add.enqueue(1, 2)
    run()
    waiting = tasks.add.enqueue(3, 4)
    url = reverse("admin:django_dbworker_task_changelist")
    page = admin_client.get(url)
    assert [c for c in page.context["cl"].filter_specs if c.title == "status"]
    listed = {status: {str(t.pk) for t in admin_client.get(url, {"status": status}).context["cl"].result_list}
              for status in ("failed", "finished", "pending", "working")}
    assert listed == {"failed": {failed.id}, "finished": {done.id}, "pending": {waiting.id},
                      "working": set()}
    assert admin_client.get(url, {"status": "bogus"}).status_code == 302  # ?e=1
