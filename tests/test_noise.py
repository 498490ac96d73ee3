"""What a user would call a bug even when nothing is lost: tracebacks where one line does."""

import os
import signal

import pytest

from tests.helpers import runworkers, wait_for
from tests.testapp.models import Document

pytestmark = pytest.mark.django_db(transaction=True)


def test_children_of_a_killed_coordinator_exit_quietly_in_one_line_each():
    from django_dbworker.models import Execution

    Document.objects.bulk_create([Document(title=f"d{i}") for i in range(4)])
    proc = runworkers("--worker", "docs")  # docs: concurrency 2
    wait_for(lambda: Execution.objects.filter(worker="docs", status="finished").count() == 4,
             timeout=120)
    os.kill(proc.pid, signal.SIGKILL)  # the coordinator only: its idle children stay
    _, err = proc.communicate(timeout=60)  # EOF once the children, holding stderr, exited
    assert err.count("its coordinator is gone; exiting") == 2, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
