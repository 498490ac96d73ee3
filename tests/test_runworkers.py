"""`manage.py runworkers` as real processes: drain, signals, bad input, several at once."""

import os
import signal

import pytest

from django_dbworker import ExecutionStatus, execution_status
from django_dbworker.models import Execution
from tests.helpers import effects, running_marker, runworkers, wait_for
from tests.testapp.models import Document

pytestmark = pytest.mark.django_db(transaction=True)


def status_of(doc):
    return Execution.objects.get(worker="docs", source_id=str(doc.pk)).status


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


def test_two_coordinators_never_run_a_row_twice():
    Document.objects.bulk_create([Document() for _ in range(300)])
    procs = [runworkers("--drain", "--worker", "docs") for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    ids = {str(pk) for pk in Document.objects.values_list("pk", flat=True)}
    assert effects("docs") == {i: 1 for i in ids}
    claimed = [int(o.split("claimed ")[1].split(",")[0]) for o, _ in outs]
    assert sum(claimed) == 300


def test_sigterm_finishes_running_handlers_then_exits_zero():
    doc = Document.objects.create(behaviour="sleep:2")
    started = running_marker("docs", doc.pk)
    proc = runworkers("--worker", "docs")
    wait_for(started.exists, timeout=60)  # the handler is running
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert status_of(doc) == "finished"
    assert effects("docs") == {str(doc.pk): 1}


def test_a_second_signal_terminates_handlers_and_releases_their_claims_at_once():
    doc = Document.objects.create(behaviour="sleep:60")
    started = running_marker("docs", doc.pk)
    proc = runworkers("--worker", "docs")
    wait_for(started.exists, timeout=60)  # the handler is running
    proc.send_signal(signal.SIGTERM)
    # Two signals sent at once reach Python's handler as one: wait for the first.
    while "finishing running handlers" not in proc.stderr.readline():
        pass
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    e = Execution.objects.get(worker="docs", source_id=str(doc.pk))
    # Claimable again right away (not after the lease), and nothing was committed.
    assert e.status == "pending" and e.claim_token is None and e.lease_expires_at is None
    assert effects("docs") == {}


def test_children_ignore_ctrl_c_sent_to_the_process_group():
    doc = Document.objects.create(behaviour="sleep:2")
    started = running_marker("docs", doc.pk)
    proc = runworkers("--worker", "docs")
    wait_for(started.exists, timeout=60)  # the handler is running
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert status_of(doc) == "finished"  # the child was not interrupted
    assert effects("docs") == {str(doc.pk): 1}


def test_shutdown_timeout_acts_as_a_second_signal():
    doc = Document.objects.create(behaviour="sleep:60")
    started = running_marker("docs", doc.pk)
    proc = runworkers("--worker", "docs", "--shutdown-timeout", "1")
    wait_for(started.exists, timeout=60)  # the handler is running
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert status_of(doc) == "pending"
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
