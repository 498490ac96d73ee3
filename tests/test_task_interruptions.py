"""Tasks whose attempts the coordinator ends: past the queue's TIMEOUT, or their child dead.

The child never commits such an attempt, so the coordinator keeps its record on the Task
row (an error per attempt, its times, its worker) and sends ``task_finished`` when no
retry follows. Before, a task killed twice read FAILED with no times and one error, no
``task_finished`` reached a monitor, and a crashed task came back at once (or, with
retries, after the loop's longest sleep instead of its back-off).
"""

from __future__ import annotations

import pytest

from django_dbworker import Coordinator
from django_dbworker.tasks.compat import TaskResultStatus
from tests.helpers import drain, effects, wait_for
from tests.testapp import tasks
from tests.testapp.models import SignalSeen

pytestmark = pytest.mark.django_db(transaction=True)


def finished_signals(result) -> list[str]:
    return list(SignalSeen.objects.filter(kind="finished", key__startswith=f"{result.id}:")
                .values_list("key", flat=True))


def test_a_task_whose_child_dies_waits_its_back_off_and_its_result_lists_every_attempt():
    result = tasks.crash.enqueue("x")  # queue "crashes": MAX_ATTEMPTS 2, RETRY_BACKOFF 1
    coordinator = Coordinator(["tasks.default.crashes"])
    coordinator.start()
    try:
        wait_for(lambda: tasks.crash.get_result(result.id).status == TaskResultStatus.FAILED,
                 timeout=60, interval=0.05)
    finally:
        coordinator.stop()
    result.refresh()
    assert result.attempts == 2
    assert [e.exception_class_path for e in result.errors] == [
        "django_dbworker.exceptions.ChildDied"] * 2
    assert "exit code 3" in result.errors[-1].traceback
    assert result.started_at is not None and result.finished_at is not None
    assert result.started_at < result.last_attempted_at <= result.finished_at
    # The second attempt came after the queue's back-off (1 s, jitter [0.5, 1]), not at
    # once and not after the loop's longest sleep (MAX_POLL_SECONDS).
    gap = (result.last_attempted_at - result.started_at).total_seconds()
    assert 0.5 <= gap < 5, gap
    assert len(result.worker_ids) == 2
    assert finished_signals(result) == [f"{result.id}:{TaskResultStatus.FAILED}"]
    assert effects("task.crash") == {}


def test_a_task_past_its_timeout_has_its_times_and_a_finished_signal():
    result = tasks.hang.enqueue("slow")  # queue "emails": TIMEOUT 3, no retries
    drain("tasks.default.emails")
    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    assert [e.exception_class_path for e in result.errors] == ["builtins.TimeoutError"]
    assert result.started_at is not None and result.last_attempted_at is not None
    assert result.finished_at is not None and result.finished_at >= result.started_at
    assert finished_signals(result) == [f"{result.id}:{TaskResultStatus.FAILED}"]
