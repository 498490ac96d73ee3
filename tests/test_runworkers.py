"""`manage.py runworkers` as real processes: drain, signals, bad input, several at once."""

import os
import signal
import socket
from collections import Counter

import pytest

from django_dbworker import ExecutionStatus, execution_status
from django_dbworker.models import CoordinatorHeartbeat, Execution
from tests.helpers import effects, execution, held_handler, running_marker, runworkers, settings_module, wait_for
from tests.processes import Output, is_running
from tests.testapp.models import Document

pytestmark = pytest.mark.django_db(transaction=True)


def test_drain_runs_everything_and_exits_zero_with_a_banner():
    docs = [Document.objects.create() for _ in range(5)]
    proc = runworkers("--drain", "--worker", "docs", "--concurrency", "docs=3")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "docs x3" in err and "claims by" in err  # the startup banner
    assert "Drained: claimed 5, finished 5" in out
    assert effects("docs") == {str(d.pk): 1 for d in docs}


@pytest.mark.parametrize("args,message", [
    (["--worker", "nope"], "No worker named 'nope'"),
    (["--concurrency", "nope=2"], "No worker named 'nope'"),
])
def test_bad_input_exits_nonzero_with_one_line_and_no_traceback(args, message):
    doc = Document.objects.create()
    proc = runworkers("--drain", *args)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert message in err and "Traceback" not in err
    assert execution_status("docs", doc) == ExecutionStatus.PENDING  # nothing changed


def test_bad_concurrency_syntax_is_an_argument_error():
    proc = runworkers("--drain", "--concurrency", "docs=zero")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "--concurrency" in err and "Traceback" not in err


def test_two_coordinators_never_run_a_row_twice(tmp_path):
    """Both coordinators are up and idle before the rows exist, and each row takes a
    moment: both claim a share. Each row runs once, by one of them, in one attempt.

    Leases of 60 s, not the tests' 3: this is about two claims never taking one row.
    With 3 s leases a coordinator slowed by a loaded machine (each of its SQLite
    statements, renewals too, may wait a second for the write lock) can let a lease
    expire, and the other coordinator then rightly takes the row back and runs it again:
    the likeliest cause of stop 46's CI failure (one row finished in its second attempt,
    its effect written once; the coordinators' logs were not printed then, they are now).
    Any other second claim still fails here. Lease expiry has tests of its own
    (test_crash.py)."""
    env = settings_module(tmp_path, 'DBWORKER = {**DBWORKER, "LEASE_SECONDS": 60}\n')
    procs = [runworkers("--worker", "docs", env=env) for _ in range(2)]
    outputs = [Output(p) for p in procs]
    wait_for(lambda: CoordinatorHeartbeat.objects.filter(pid__in=[p.pid for p in procs]).count() == 2,
             timeout=120)
    Document.objects.bulk_create([Document(behaviour="sleep:0.01") for _ in range(300)])
    wait_for(lambda: Execution.objects.filter(worker="docs", status="finished").count() == 300,
             timeout=300, interval=0.2)
    for p in procs:
        p.send_signal(signal.SIGTERM)
    assert [o.wait(timeout=60) for o in outputs] == [0, 0], [o.err for o in outputs]
    ids = {str(pk) for pk in Document.objects.values_list("pk", flat=True)}
    assert effects("docs") == {i: 1 for i in ids}
    assert set(Execution.objects.filter(worker="docs").values_list("status", "attempts")) == {
        ("finished", 1)}, [o.err for o in outputs]  # no row claimed twice (a claim counts an attempt)
    by = Counter(Execution.objects.filter(worker="docs").values_list("claimed_by", flat=True))
    host = socket.gethostname()
    assert set(by) == {f"{host}:{p.pid}" for p in procs}, by  # both ran rows
    assert sum(by.values()) == 300


def test_sigterm_finishes_running_handlers_then_exits_zero():
    doc = Document.objects.create(behaviour="sleep:0")
    with held_handler("docs", doc.pk) as held:
        proc = runworkers("--worker", "docs")
        output = Output(proc)
        held.wait()  # the handler is running, and waits for us
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: "finishing running handlers" in output.err)  # the signal landed
        assert execution("docs", doc).status == "working" and effects("docs") == {}  # mid-handler
    assert output.wait(timeout=60) == 0, output.err
    assert execution("docs", doc).status == "finished"
    assert effects("docs") == {str(doc.pk): 1}


def test_a_second_signal_terminates_handlers_and_releases_their_claims_at_once():
    doc = Document.objects.create(behaviour="sleep:60")
    started = running_marker("docs", doc.pk)
    proc = runworkers("--worker", "docs")
    output = Output(proc)
    wait_for(started.exists, timeout=60)  # the handler is running
    proc.send_signal(signal.SIGTERM)
    # Two signals sent at once reach Python's handler as one: wait for the first.
    wait_for(lambda: "finishing running handlers" in output.err, timeout=60)
    proc.send_signal(signal.SIGTERM)
    assert output.wait(timeout=30) == 0, output.err
    e = execution("docs", doc)
    # Claimable again right away (not after the lease), and nothing was committed.
    assert e.status == "pending" and e.claim_token is None and e.lease_expires_at is None
    # An attempt interrupted from outside is not counted, and no process claims it now.
    assert e.attempts == 0 and e.claimed_by is None, (e.attempts, e.claimed_by)
    assert effects("docs") == {}


def test_children_ignore_ctrl_c_sent_to_the_process_group():
    doc = Document.objects.create(behaviour="sleep:0")
    with held_handler("docs", doc.pk) as held:
        proc = runworkers("--worker", "docs")
        output = Output(proc)
        child = held.wait()  # the handler is running, and waits for us
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        wait_for(lambda: "Received SIGINT" in output.err)  # it reached the group
        assert execution("docs", doc).status == "working" and is_running(child)  # mid-handler, untouched
    assert output.wait(timeout=60) == 0, output.err
    assert execution("docs", doc).status == "finished"  # the child was not interrupted
    assert effects("docs") == {str(doc.pk): 1}


def test_shutdown_timeout_acts_as_a_second_signal():
    doc = Document.objects.create(behaviour="sleep:60")
    started = running_marker("docs", doc.pk)
    proc = runworkers("--worker", "docs", "--shutdown-timeout", "1")
    wait_for(started.exists, timeout=60)  # the handler is running
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert execution("docs", doc).status == "pending"
    assert effects("docs") == {}


def test_previous_signal_handlers_are_restored():
    from django.core.management import call_command

    def mine(signum, frame):
        pass

    before = {sig: signal.signal(sig, mine) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        call_command("runworkers", "--worker", "docs", "--drain", "-v0")
        assert signal.getsignal(signal.SIGTERM) is mine
        assert signal.getsignal(signal.SIGINT) is mine
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
