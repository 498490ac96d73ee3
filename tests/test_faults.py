"""Faults runworkers must survive (issue 4): a handler past its timeout, recycled children,
and bad input, which must get a clear error and change nothing.

Bad input already covered elsewhere (not repeated here):
- unknown worker in has_execution_status() and state(): test_api.test_unknown_statuses_and_workers_fail_clearly,
  test_api.test_state_and_execution_status; registry["nope"]:
  test_registry.test_unknown_worker_lookup_names_the_registered_ones
- runworkers --worker nope / --concurrency nope=2 (status unchanged):
  test_runworkers.test_bad_input_exits_nonzero_with_one_line_and_no_traceback
- --concurrency docs=zero: test_runworkers.test_bad_concurrency_syntax_is_an_argument_error
- system checks E001-E010, one bad value each: test_checks.test_invalid_settings_have_ids_and_hints,
  test_checks.test_in_memory_sqlite_and_unsupported_backends (":memory:", the Oracle backend)
- bad names, concurrency, options, nested handlers, eligible not callable, eligible of another
  model (eligible_queryset()): test_registry
- a handler returning something else (FAILED, TypeError naming the fix, writes rolled back):
  test_handlers.test_wrong_return_type_fails_and_rolls_back
"""

import dataclasses
import os
import sys
from collections import Counter
from datetime import timedelta

import pytest
from django.core.checks import run_checks
from django.core.exceptions import ImproperlyConfigured
from django.db import connection, models
from django.test import override_settings
from django.test.utils import isolate_apps
from django.utils import timezone

from django_dbworker import (
    Coordinator,
    Finished,
    annotate_execution_status,
    execution_status,
    registry,
    reset_failed,
    worker,
)
from django_dbworker.models import CoordinatorHeartbeat, Execution
from tests.helpers import (
    drain,
    effects,
    execution,
    mark_failed,
    run_with_settings,
    runworkers,
    wait_for,
)
from tests.processes import (
    is_running,
    worker_children,
)
from tests.testapp.models import Document, Effect, FaultJob, Tag
from tests.testapp.workers import pid_file

pytestmark = pytest.mark.django_db(transaction=True)


# -- deadlines: a per-worker timeout ----------------------------------------------------

def test_a_handler_past_its_timeout_is_killed_with_its_child_and_its_writes_rolled_back():
    """`timed` (timeout=3, concurrency 2) writes its business effect, then hangs for 120 s
    (leaving its pid in a file: outside the database, it survives the rollback)."""
    hang = FaultJob.objects.create(behaviour="hang")
    pid_path = pid_file("timed", hang.pk)
    pid_path.unlink(missing_ok=True)
    coordinator = Coordinator(["timed"])
    coordinator.start()
    try:
        wait_for(lambda: pid_path.exists() and pid_path.read_text(), timeout=60)
        hung_pid = int(pid_path.read_text())
        assert hung_pid in worker_children(os.getpid())
        # The other child carries on meanwhile (on SQLite only once the hung handler's
        # transaction, which holds the single write lock, is gone).
        others = [FaultJob.objects.create() for _ in range(4)]
        wait_for(lambda: execution("timed", hang).status == "failed", timeout=60)
        wait_for(lambda: all(execution("timed", o).status == "finished" for o in others), timeout=60)
        # The pool is whole again: a row created after the kill runs too.
        late = FaultJob.objects.create()
        wait_for(lambda: execution("timed", late).status == "finished", timeout=60)
        children_after = worker_children(os.getpid())
    finally:
        coordinator.stop(timeout=10)
        pid_path.unlink(missing_ok=True)

    e = execution("timed", hang)
    assert e.status == "failed" and e.error_type == "TimeoutError"
    assert "timeout of 3" in e.error_message
    assert e.claim_token is None and e.lease_expires_at is None and e.attempts == 1
    # Killed past its timeout, not before, and long before the handler's own 120 s.
    assert timedelta(seconds=3) <= e.finished_at - e.started_at < timedelta(seconds=60)
    # Its child was killed (and reaped), and replaced: the pool has two children again.
    assert not is_running(hung_pid)
    assert hung_pid not in children_after and len(children_after) == 2
    # Its write before hanging was rolled back; every other row ran exactly once.
    assert effects("timed") == {str(o.pk): 1 for o in [*others, late]}
    assert {execution("timed", o).attempts for o in [*others, late]} == {1}
    if connection.vendor != "sqlite":
        # The other child did not wait for the hung one.
        assert all(execution("timed", o).finished_at < e.finished_at for o in others)


def test_a_timed_out_attempt_is_retried_when_the_worker_has_retries():
    """`timed_retry` (timeout=3, max_attempts=2, retry_backoff=3600) hangs on its first
    attempt only. The timeout is a failed attempt: it waits for its retry like any other
    failure (deterministic: the back-off keeps it waiting until the test ends the wait)."""
    job = FaultJob.objects.create(behaviour="hang_once")
    stats = drain("timed_retry")
    e = execution("timed_retry", job)
    assert stats["claimed"] == 1
    assert (e.status, e.error_type, e.attempts) == ("unfinished", "TimeoutError", 1), e.error_message
    assert e.next_attempt_at > timezone.now() + timedelta(minutes=25)  # 3600 s x [0.5, 1]
    assert e.claim_token is None
    assert effects("timed_retry") == {}  # the first attempt's write was rolled back
    assert drain("timed_retry")["claimed"] == 0  # not before its time

    Execution.objects.filter(pk=e.pk).update(next_attempt_at=None)  # the back-off is over
    drain("timed_retry")
    e.refresh_from_db()
    assert (e.status, e.attempts, e.error_type) == ("finished", 2, None)
    assert effects("timed_retry") == {str(job.pk): 1}


# -- memory guard: max_tasks_per_child --------------------------------------------------

def test_max_tasks_per_child_recycles_children_and_runs_every_row_once():
    """`recycled`: concurrency 1, max_tasks_per_child=2; each run records its child's pid."""
    jobs = [FaultJob.objects.create(behaviour="recycle") for _ in range(6)]
    stats = drain("recycled")
    assert stats["finished"] == 6
    assert stats["crashed"] == stats["lost"] == stats["failed"] == 0
    assert effects("recycled") == {str(j.pk): 1 for j in jobs}
    pids = Counter(Effect.objects.filter(worker="recycled").values_list("pid", flat=True))
    assert sorted(pids.values()) == [2, 2, 2], pids  # three children, two rows each
    # Consecutive rows share a child: a child is replaced after its second row.
    order = list(Effect.objects.filter(worker="recycled").order_by("id").values_list("pid", flat=True))
    assert order[0::2] == order[1::2]
    assert set(Execution.objects.filter(worker="recycled").values_list("status", "attempts")) == {
        ("finished", 1)}


# -- bad input: a clear error naming the fix, and nothing changed -----------------------

def snapshot():
    """Everything the bad input could have touched."""
    return {
        "executions": sorted(Execution.objects.values_list(
            "worker", "source_id", "status", "attempts", "claim_token", "lease_expires_at",
            "error_type", "updated_at", "started_at")),
        "effects": Effect.objects.count(),
        "coordinators": CoordinatorHeartbeat.objects.count(),
        "documents": sorted(Document.objects.values_list("pk", "text", "steps")),
    }


def failed_document():
    """A pending row and a failed one: a wrong call must neither claim nor reset them."""
    Document.objects.create()
    doc = Document.objects.create()
    mark_failed(Execution.objects.filter(worker="docs", source_id=str(doc.pk)))
    return doc


@pytest.mark.parametrize("call", [
    pytest.param(lambda doc: execution_status("nope", doc), id="execution_status"),
    pytest.param(lambda doc: reset_failed("nope", doc), id="reset_failed"),
    pytest.param(lambda doc: list(annotate_execution_status(Document.objects.all(), "docs", "nope")),
                 id="annotate_execution_status"),
    pytest.param(lambda doc: Coordinator(["nope"]), id="Coordinator-workers"),
    pytest.param(lambda doc: Coordinator(["docs"], concurrency={"nope": 2}), id="Coordinator-concurrency"),
])
def test_an_unknown_worker_name_in_the_api_names_the_registered_workers(call):
    doc = failed_document()
    before = snapshot()
    with pytest.raises(LookupError) as info:
        call(doc)
    message = str(info.value)
    assert "No worker named 'nope'" in message
    assert "Registered workers:" in message and "docs" in message and "stress" in message
    assert snapshot() == before


def test_a_source_of_another_model_in_the_api_names_the_model_to_pass():
    doc = failed_document()
    tag = Tag.objects.create(slug=str(doc.pk))  # same key text, wrong model
    before = snapshot()
    with pytest.raises(TypeError, match="works on Document, not Tag: pass a Document or its primary key"):
        reset_failed("docs", tag)
    assert snapshot() == before
    assert execution_status("docs", doc) == "failed"


def test_a_concurrency_below_one_for_the_coordinator_is_rejected():
    failed_document()
    before = snapshot()
    with pytest.raises(ImproperlyConfigured, match="Concurrency for 'docs' must be an int >= 1"):
        Coordinator(["docs"], concurrency={"docs": 0})
    assert snapshot() == before


@pytest.mark.parametrize("args", [
    ["--worker", "nope"],
    ["--worker", "docs", "--worker", "nope"],
    ["--concurrency", "nope=2"],
], ids=["worker", "one-of-two-workers", "concurrency"])
def test_an_unknown_worker_on_the_command_line_is_one_line_naming_the_registered_workers(args):
    failed_document()
    before = snapshot()
    proc = runworkers("--drain", *args)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err
    [line] = err.strip().splitlines()
    assert line.startswith("CommandError: No worker named 'nope'. Registered workers: ")
    assert "docs" in line and "stress" in line
    assert out == ""
    assert snapshot() == before


@pytest.mark.parametrize("value", ["docs=0", "docs=-1", "docs"])
def test_a_concurrency_below_one_on_the_command_line_says_what_is_expected(value):
    failed_document()
    before = snapshot()
    proc = runworkers("--drain", "--concurrency", value)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    assert "Traceback" not in err
    error = err.strip().splitlines()[-1]  # argparse: the usage, then "...: error: <message>"
    assert "--concurrency" in error and value in error
    # The message itself names the fix, not only the parser's name for the converter.
    assert "NAME=N" in error and ">= 1" in error, error
    assert snapshot() == before


# Running runworkers under another settings module: bad DBWORKER settings, a database it
# does not support. The module imports the test settings and changes one thing.

@pytest.mark.parametrize("value,check_id,names", [
    ('"nope"', "E001", "DBWORKER must be a dict"),
    ('{"LEASE": 3}', "E002", "LEASE_SECONDS"),
    ('{"LEASE_SECONDS": 0}', "E004", "LEASE_SECONDS"),
    ('{"POLL_SECONDS": 5, "MAX_POLL_SECONDS": 1}', "E005", "MAX_POLL_SECONDS"),
    ('{"WORKER_MODULES": "app.workers"}', "E006", "WORKER_MODULES"),
    ('{"ENGINE_OPTIONS": []}', "E007", "ENGINE_OPTIONS"),
])
def test_runworkers_refuses_invalid_dbworker_settings_before_claiming(tmp_path, value, check_id, names):
    failed_document()
    before = snapshot()
    code, out, err = run_with_settings(tmp_path, f"DBWORKER = {value}\n")
    assert code == 1, err
    assert f"django_dbworker.{check_id}" in err and "HINT" in err and names in err, err
    assert "Traceback" not in err and "Drained" not in out
    assert snapshot() == before


@pytest.mark.parametrize("value,key", [
    ("nope", "DBWORKER"),
    ({"LEASE": 3}, "LEASE"),
    ({"DATABASE": "other"}, "DATABASE"),
    ({"LEASE_SECONDS": -1}, "LEASE_SECONDS"),
    ({"POLL_SECONDS": "1"}, "POLL_SECONDS"),
    ({"MAX_POLL_SECONDS": 0}, "MAX_POLL_SECONDS"),
    ({"POLL_SECONDS": 5, "MAX_POLL_SECONDS": 1}, "POLL_SECONDS"),
    ({"WORKER_MODULES": [1]}, "WORKER_MODULES"),
    ({"ENGINE_OPTIONS": "pool_size=5"}, "ENGINE_OPTIONS"),
])
def test_every_settings_error_names_its_key_and_gives_a_hint(value, key):
    with override_settings(DBWORKER=value):
        errors = [e for e in run_checks() if e.id.startswith("django_dbworker.")]
    assert len(errors) == 1, errors
    assert key in errors[0].msg and errors[0].hint


@pytest.mark.filterwarnings("ignore:Overriding setting DATABASES")
@pytest.mark.parametrize("name", ["", "file:memdb1?mode=memory&cache=shared"])
def test_other_spellings_of_in_memory_sqlite_are_reported(name):
    mem = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": name}}
    with override_settings(DATABASES=mem):
        errors = [e for e in run_checks() if e.id.startswith("django_dbworker.")]
    assert [e.id for e in errors] == ["django_dbworker.E009"]
    assert "file path" in errors[0].hint


@pytest.mark.filterwarnings("ignore:Overriding setting DATABASES")
def test_a_backend_with_an_unknown_vendor_is_reported_by_the_checks():
    fake = {"default": {"ENGINE": "acme.db.backends.fancydb", "NAME": "x"}}
    with override_settings(DATABASES=fake):
        errors = [e for e in run_checks() if e.id.startswith("django_dbworker.")]
    assert [e.id for e in errors] == ["django_dbworker.E008"]
    assert "acme.db.backends.fancydb" in errors[0].msg
    assert "PostgreSQL 13+" in errors[0].hint and "SQLite" in errors[0].hint


FANCYDB = """\
from django.db.backends.sqlite3.base import DatabaseWrapper as SQLiteDatabaseWrapper


class DatabaseWrapper(SQLiteDatabaseWrapper):
    vendor = "fancydb"
    display_name = "FancyDB"
"""


@pytest.mark.parametrize("skip_checks", [False, True], ids=["checks", "skip-checks"])
def test_runworkers_refuses_an_unsupported_database(tmp_path, skip_checks):
    """A real (SQLite-based) backend whose vendor is "fancydb": the system check stops
    runworkers (E008); with --skip-checks the coordinator refuses it before connecting."""
    (tmp_path / "fancydb").mkdir()
    (tmp_path / "fancydb" / "__init__.py").write_text("")
    (tmp_path / "fancydb" / "base.py").write_text(FANCYDB)
    database = tmp_path / "fancy.sqlite3"
    failed_document()
    before = snapshot()
    code, out, err = run_with_settings(
        tmp_path, f'DATABASES = {{"default": {{"ENGINE": "fancydb", "NAME": {str(database)!r}}}}}\n',
        *(["--skip-checks"] if skip_checks else []))
    assert code == 1, err
    assert "Traceback" not in err
    if skip_checks:
        [line] = err.strip().splitlines()
        assert line.startswith("CommandError: The 'fancydb' database backend is not supported")
        assert "PostgreSQL 13+" in line
    else:
        assert "django_dbworker.E008" in err and "HINT" in err and "PostgreSQL 13+" in err
    assert not database.exists()  # never even connected
    assert snapshot() == before


@pytest.mark.parametrize("skip_checks", [False, True], ids=["checks", "skip-checks"])
def test_runworkers_refuses_in_memory_sqlite(tmp_path, skip_checks):
    failed_document()
    before = snapshot()
    code, out, err = run_with_settings(
        tmp_path,
        'DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}}\n',
        *(["--skip-checks"] if skip_checks else []))
    assert code == 1, err
    assert "Traceback" not in err and "Drained" not in out
    if skip_checks:
        [line] = err.strip().splitlines()
        assert line.startswith("CommandError: SQLite in memory cannot be shared with child processes")
        assert "file path" in line
    else:
        assert "django_dbworker.E009" in err and "file path" in err
    assert snapshot() == before


def module_level_handler(obj):
    return Finished()


@isolate_apps("tests.testapp")
def test_a_source_without_a_single_primary_key_is_rejected_at_registration():
    class Pair(models.Model):
        pk = models.CompositePrimaryKey("left", "right")
        left = models.IntegerField()
        right = models.IntegerField()

        class Meta:
            app_label = "testapp"

    before = dict(registry)
    with pytest.raises(ImproperlyConfigured,
                       match="source Pair must have exactly one primary-key column"):
        worker(name="pairs", source=Pair)(module_level_handler)
    assert dict(registry) == before  # nothing registered


class replaced_worker:
    """Temporarily register another definition under a name whose triggers exist."""

    def __init__(self, name, **changes):
        self.original = registry[name]
        self.replacement = dataclasses.replace(self.original, **changes)

    def __enter__(self):
        registry.unregister(self.original.name)
        registry.register(self.replacement)
        return self.replacement

    def __exit__(self, *exc):
        registry.unregister(self.original.name)
        registry.register(self.original)


def test_a_handler_the_child_cannot_import_stops_the_coordinator_before_claiming(tmp_path):
    """The coordinator imported the handler's module, the children cannot (it was removed
    by a deploy, say): the coordinator stops at start, naming the worker, the handler and
    the import error, and claims nothing."""
    (tmp_path / "dbworker_vanishing_handlers.py").write_text(
        "from django_dbworker import Finished\n\n\ndef handle(doc):\n    return Finished()\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import dbworker_vanishing_handlers as vanishing
    finally:
        sys.path.remove(str(tmp_path))
    (tmp_path / "dbworker_vanishing_handlers.py").unlink()
    failed_document()
    before = snapshot()
    try:
        with replaced_worker("docs", handler=vanishing.handle):
            with pytest.raises(ImproperlyConfigured) as info:
                drain("docs")
    finally:
        sys.modules.pop("dbworker_vanishing_handlers", None)
    message = str(info.value)
    assert "A child for worker 'docs' could not start (dbworker_vanishing_handlers:handle)" in message
    assert "ModuleNotFoundError" in message and "dbworker_vanishing_handlers" in message
    assert snapshot() == before
    assert wait_for(lambda: not worker_children(os.getpid()), timeout=30)  # no child left


def test_an_eligible_of_another_model_stops_the_coordinator_and_claims_nothing():
    failed_document()
    Tag.objects.create(slug="t")
    before = snapshot()
    with replaced_worker("docs", eligible=lambda: Tag.objects.all()):
        with pytest.raises(ImproperlyConfigured) as info:
            drain("docs")
    message = str(info.value)
    assert "eligible() returned a QuerySet of Tag, but the worker's source is Document" in message
    assert "Return Document.objects.filter(...)" in message
    assert snapshot() == before
    assert wait_for(lambda: not worker_children(os.getpid()), timeout=30)
