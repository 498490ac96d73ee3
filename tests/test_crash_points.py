"""Kill a process at each point where a crash could lose or double work, then check
that every row ends FINISHED (FAILED where its handler fails) with its business effect
committed exactly once.

The points are failpoints in the package (django_dbworker/processes/failpoints.py), armed through
DBWORKER_FAILPOINT in one `runworkers` process only: it SIGKILLs itself the first time it
gets there. After a coordinator dies, a second coordinator on this machine takes over: its
heartbeat check sees the dead process and hands its rows over at once.
"""

import logging
import os
import signal
from collections import Counter

import pytest

from django_dbworker.models import CoordinatorHeartbeat, Execution
from tests.helpers import drain, effects, runworkers, session_processes, wait_for
from tests.testapp.models import Document

pytestmark = pytest.mark.django_db(transaction=True)

CHILD_POINTS = ["child.before_begin", "child.before_commit", "child.after_commit"]
COORDINATOR_POINTS = ["coordinator.after_claim", "coordinator.before_renew",
                      "coordinator.after_renew", "coordinator.stopping"]


def final() -> bool:
    return not Execution.objects.filter(worker="docs").exclude(
        status__in=["finished", "failed"]).exists()


@pytest.mark.parametrize("point", CHILD_POINTS + COORDINATOR_POINTS)
def test_a_crash_at_any_point_loses_nothing_and_commits_nothing_twice(point, tmp_path, caplog):
    # 0.1 s per handler: long enough that leases are renewed (every 1 s here) while
    # rows are held, short enough for the whole run to take a few seconds.
    ok = Document.objects.bulk_create([Document(behaviour="sleep:0.1") for _ in range(30)])
    failing = Document.objects.bulk_create([Document(behaviour="fail") for _ in range(2)])
    marker = tmp_path / "fired"
    proc = runworkers("--worker", "docs",
                      env={"DBWORKER_FAILPOINT": f"{point}:{marker}"})
    if point == "coordinator.stopping":
        wait_for(lambda: effects("docs"), timeout=60)  # handlers are running
        proc.send_signal(signal.SIGTERM)
    wait_for(marker.exists, timeout=60)

    if point in CHILD_POINTS:
        # The coordinator replaces the child, releases its rows and carries on.
        wait_for(final, timeout=60)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert "died" in err
    else:
        proc.wait(timeout=60)
        assert proc.returncode == -signal.SIGKILL
        # Its children finish the group they are in, then see the pipe close and exit.
        wait_for(lambda: not session_processes(proc.pid), timeout=60)
        docs = Execution.objects.filter(worker="docs")
        held = docs.filter(status="working", claimed_by__endswith=f":{proc.pid}").count()
        left = docs.exclude(status__in=["finished", "failed"]).count()
        assert left > 0, "the coordinator died after all the work was done: nothing was tested"
        # Another coordinator takes over: the dead one's claims at once, without waiting
        # for their leases, and all the rest.
        stats = Counter()
        with caplog.at_level(logging.WARNING, logger="django_dbworker.coordinator"):
            wait_for(lambda: stats.update(drain("docs")) or final(), timeout=60, interval=0.2)
        assert stats["recovered"] == held, (stats, held)
        assert stats["finished"] + stats["failed"] == left, (stats, left)
        assert not CoordinatorHeartbeat.objects.filter(pid=proc.pid).exists()
        assert f"Coordinator process(es) {proc.pid} of this host are gone" in caplog.text

    assert marker.exists()
    assert effects("docs") == {str(d.pk): 1 for d in ok}  # none lost, none twice
    statuses = dict(Execution.objects.filter(worker="docs").values_list("source_id", "status"))
    assert {statuses[str(d.pk)] for d in ok} == {"finished"}
    assert {statuses[str(d.pk)] for d in failing} == {"failed"}


def test_an_unset_failpoint_does_nothing():
    from django_dbworker.processes import failpoints

    failpoints.reached("child.before_commit")  # not armed in this process: returns
    assert os.environ.get("DBWORKER_FAILPOINT") is None
