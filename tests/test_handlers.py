"""Handler semantics (SPEC section 2), end to end through real spawned children."""

import os
import uuid

import pytest

from django_dbworker import ExecutionStatus, execution_status, reset_failed, state
from django_dbworker.models import Execution
from django_dbworker.registration.registry import registry
from tests.helpers import (
    claim,
    claim_and_run_group,
    drain,
    effects,
    insert_raw,
    statements_of,
)
from tests.testapp.models import Document, Effect, Tag, UuidItem

pytestmark = pytest.mark.django_db(transaction=True)


def test_rows_from_orm_bulk_create_and_raw_sql_run_exactly_once():
    Document.objects.create(title="orm")
    Document.objects.bulk_create([Document(title=f"bulk{i}") for i in range(30)])
    insert_raw(Document, title="raw", behaviour="ok", uploaded=True, steps=0, text="")
    stats = drain("docs")
    ids = {str(pk) for pk in Document.objects.values_list("pk", flat=True)}
    assert effects("docs") == {i: 1 for i in ids}
    assert stats["finished"] == 32
    assert all(t.startswith("handled") for t in Document.objects.values_list("text", flat=True))
    # Finished rows are never claimed again.
    assert drain("docs")["claimed"] == 0
    assert effects("docs") == {i: 1 for i in ids}


def test_eligibility_filter_and_late_eligible_rows():
    later = Document.objects.create(uploaded=False)
    now = Document.objects.create(uploaded=True)
    drain("docs")
    assert execution_status("docs", now) == ExecutionStatus.FINISHED
    assert execution_status("docs", later) == ExecutionStatus.PENDING
    Document.objects.filter(pk=later.pk).update(uploaded=True)
    drain("docs")
    assert execution_status("docs", later) == ExecutionStatus.FINISHED
    assert effects("docs") == {str(now.pk): 1, str(later.pk): 1}


def test_unfinished_runs_the_handler_again_from_the_start():
    doc = Document.objects.create(behaviour="steps:3")
    stats = drain("docs")
    doc.refresh_from_db()
    assert doc.steps == 3
    assert stats["unfinished"] == 2 and stats["finished"] == 1
    assert execution_status("docs", doc) == ExecutionStatus.FINISHED
    assert effects("docs") == {str(doc.pk): 1}


def test_failure_is_recorded_with_traceback_and_rolls_back_the_handlers_writes():
    doc = Document.objects.create(behaviour="fail")
    drain("docs")
    assert execution_status("docs", doc) == ExecutionStatus.FAILED
    assert effects("docs") == {}  # the effect written before the raise was rolled back
    s = state("docs", doc)
    assert s["error"]["type"] == "ValueError"
    assert s["error"]["message"] == f"cannot handle document {doc.pk}"
    assert "Traceback" in s["error"]["traceback"] and "handle_document" in s["error"]["traceback"]
    assert s["attempts"] == 1
    # FAILED is never retried automatically.
    assert drain("docs")["claimed"] == 0
    # Fix the cause, reset, and it runs.
    Document.objects.filter(pk=doc.pk).update(behaviour="ok")
    assert reset_failed("docs", doc) is True
    assert reset_failed("docs", doc) is False
    assert execution_status("docs", doc) == ExecutionStatus.UNFINISHED
    assert state("docs", doc)["error"] is None
    drain("docs")
    assert execution_status("docs", doc) == ExecutionStatus.FINISHED
    assert effects("docs") == {str(doc.pk): 1}


def test_commit_inside_the_handler_is_rejected_and_rolled_back():
    doc = Document.objects.create(behaviour="commit")
    drain("docs")
    assert execution_status("docs", doc) == ExecutionStatus.FAILED
    error = state("docs", doc)["error"]
    assert "TransactionManagementError" in error["type"]
    # Django's generic words alone do not say what to do: the message does.
    assert "Don't commit in a handler" in error["message"]
    assert effects("docs") == {}


def test_wrong_return_type_fails_and_rolls_back():
    doc = Document.objects.create(behaviour="wrong_return")
    drain("docs")
    assert execution_status("docs", doc) == ExecutionStatus.FAILED
    err = state("docs", doc)["error"]
    assert err["type"] == "TypeError" and "return Finished() or Unfinished()" in err["message"]
    assert effects("docs") == {}


def test_a_source_deleted_while_claimed_fails_with_the_reason():
    doc = Document.objects.create()
    [held] = claim("docs")
    Document.objects.filter(pk=doc.pk).delete()
    # The claimer vanished: its lease runs out, another coordinator takes the row.
    Execution.objects.filter(pk=held.execution_id).update(lease_expires_at="2000-01-01T00:00:00Z")
    drain("docs")
    execution = Execution.objects.get(pk=held.execution_id)
    assert execution.status == ExecutionStatus.FAILED
    assert "DoesNotExist" in execution.error_type


@pytest.mark.parametrize("model,worker", [(UuidItem, "uuids"), (Tag, "tags")])
def test_uuid_and_string_primary_keys(model, worker):
    if model is Tag:
        objs = [Tag.objects.create(slug=s) for s in ("a", "b-c", "ünï", "x y")]
    else:
        objs = [UuidItem.objects.create(id=uuid.uuid4()) for _ in range(4)]
    drain(worker)
    assert all(execution_status(worker, o) == ExecutionStatus.FINISHED for o in objs)
    assert effects(worker) == {str(o.pk): 1 for o in objs}


def test_big_integer_keys():
    doc = Document.objects.create(id=2**40 + 7)
    drain("docs")
    assert execution_status("docs", doc) == ExecutionStatus.FINISHED
    assert effects("docs") == {str(2**40 + 7): 1}


def test_retries_with_backoff_until_attempts_run_out():
    tag = Tag.objects.create(slug="retry-me")
    drain("retrying")
    # max_attempts=3: two failures wait for a retry (UNFINISHED), the third is final.
    for _ in range(10):
        if execution_status("retrying", tag) == ExecutionStatus.FAILED:
            break
        Execution.objects.filter(worker="retrying").update(next_attempt_at=None)
        drain("retrying")
    s = state("retrying", tag)
    assert s["execution_status"] == ExecutionStatus.FAILED
    assert s["attempts"] == 3
    assert s["error"]["message"] == "always fails"
    assert effects("retrying") == {}


def test_a_waiting_retry_is_not_claimed_before_its_time():
    """retry_later: max_attempts=2, retry_backoff=3600 s. The failed attempt waits out its
    back-off (a drain that finds it waiting ends); once due it runs at once."""
    from datetime import timedelta

    from django.utils import timezone

    tag = Tag.objects.create(slug="later-1")
    assert drain("retry_later")["failed"] == 0  # the failure was retried later, not final
    execution = Execution.objects.get(worker="retry_later")
    assert execution.status == ExecutionStatus.UNFINISHED
    assert execution.next_attempt_at > timezone.now() + timedelta(minutes=25)  # 3600 s x [0.5, 1]
    assert drain("retry_later")["claimed"] == 0  # not before its time
    Execution.objects.filter(pk=execution.pk).update(
        next_attempt_at=timezone.now() - timedelta(seconds=1))  # its time has come
    stats = drain("retry_later")
    assert stats["claimed"] == 1 and stats["failed"] == 1  # the second and last attempt
    assert state("retry_later", tag)["attempts"] == 2


def test_dependent_worker_runs_only_after_the_first_finished():
    docs = [Document.objects.create() for _ in range(3)]
    assert drain("summaries")["claimed"] == 0
    drain("docs")
    drain("summaries")
    assert effects("summaries") == {str(d.pk): 1 for d in docs}


def test_one_coordinator_claims_rows_a_finishing_handler_made_eligible():
    docs = [Document.objects.create() for _ in range(3)]
    drain("docs", "summaries")
    assert effects("summaries") == {str(d.pk): 1 for d in docs}
    assert Effect.objects.count() == 6


# -- groups: quick rows share a transaction, each keeps its own outcome -------------------
def test_a_failing_row_in_a_group_rolls_back_only_its_own_writes(monkeypatch):
    docs = [Document.objects.create(behaviour="fail" if i in (2, 5) else "ok")
            for i in range(8)]
    claims, results, pending = claim_and_run_group("docs", 8, monkeypatch=monkeypatch)
    assert len(results) == 8 and not pending  # one group ran them all
    ok = {str(d.pk) for d in docs if d.behaviour == "ok"}
    assert effects("docs") == {pk: 1 for pk in ok}  # the failures' effects rolled back
    for d in docs:
        expected = ExecutionStatus.FAILED if d.behaviour == "fail" else ExecutionStatus.FINISHED
        assert execution_status("docs", d) == expected


def test_a_lost_claim_in_a_group_discards_that_row_and_keeps_the_others(monkeypatch):
    docs = [Document.objects.create() for _ in range(6)]

    def take_over(claims):  # another coordinator took the third row (its lease ran out)
        Execution.objects.filter(pk=claims[2].execution_id).update(claim_token="someone-else")

    claims, results, _ = claim_and_run_group("docs", 6, take_over, monkeypatch=monkeypatch)
    kinds = {execution_id: kind for kind, execution_id, _ in results}
    assert kinds.pop(claims[2].execution_id) == "lost"
    assert set(kinds.values()) == {"done"}
    lost_source = claims[2].source_id
    assert effects("docs") == {str(d.pk): 1 for d in docs if str(d.pk) != lost_source}
    assert Execution.objects.get(pk=claims[2].execution_id).status == ExecutionStatus.WORKING


@pytest.mark.parametrize("rows", [3, 1])  # a group, and a row that arrived alone
@pytest.mark.parametrize("why", ["stopping", "revoked"])
def test_a_child_hands_back_rows_it_has_not_started(why, rows):
    from collections import deque
    from multiprocessing.sharedctypes import RawArray, RawValue

    from django_dbworker.processes.groups import run_group
    from django_dbworker.processes.protocol import SLOT_REVOKE, SLOT_SIZE

    [Document.objects.create() for _ in range(rows)]
    claims = claim("docs", rows, "test:stop")
    pending = deque(c.delivery(i) for i, c in enumerate(claims, 1))
    slot, stop = RawArray("d", SLOT_SIZE), RawValue("b", why == "stopping")
    slot[SLOT_REVOKE] = why == "revoked"
    results = run_group(registry["docs"], "default", pending, slot, stop)
    assert [kind for kind, _, _ in results] == ["skipped"] * rows
    assert slot[SLOT_REVOKE] == 0  # a revocation is answered once
    assert effects("docs") == {}


def _keeps_savepoints():
    """Whether the child spares the savepoint round trips: only where the driver tells
    that a handler left its transaction open (mysqlclient cannot: RELEASE checks it)."""
    from django.db import connection

    return connection.vendor != "mysql"


def _count(statements, prefix):
    return len([sql for sql in statements if sql.upper().startswith(prefix)])


@pytest.mark.parametrize("behaviour", ["ok", "fail"])
def test_a_group_keeps_each_handlers_savepoint_rather_than_releasing_it(behaviour,
                                                                       monkeypatch):
    docs = [Document.objects.create(behaviour=behaviour if i == 1 else "ok") for i in range(3)]
    sent, (_, results, _) = statements_of(
        lambda: claim_and_run_group("docs", 3, monkeypatch=monkeypatch))
    assert [kind for kind, _, _ in results] == ["done"] * 3
    # One SAVEPOINT per handler, never released: a round trip fewer per row of a drain.
    # A failure is rolled back to its savepoint, then recorded in a savepoint of its own.
    failed = behaviour == "fail"
    released = failed if _keeps_savepoints() else 3 + failed
    assert (_count(sent, "SAVEPOINT"), _count(sent, "RELEASE"), _count(sent, "ROLLBACK TO")) == (
        3 + failed, released, failed)
    assert effects("docs") == {str(d.pk): 1 for d in docs if d.behaviour == "ok"}


@pytest.mark.parametrize("failing", ["on_commit+fail", "on_commit+discard"])
def test_on_commit_callbacks_of_a_rolled_back_handler_in_a_group_do_not_run(failing,
                                                                           monkeypatch):
    docs = [Document.objects.create(behaviour=failing if i == 1 else "on_commit")
            for i in range(3)]
    _, results, _ = claim_and_run_group("docs", 3, monkeypatch=monkeypatch)
    assert [kind for kind, _, _ in results] == ["done"] * 3
    assert effects("docs.on_commit") == {str(docs[0].pk): 1, str(docs[2].pk): 1}


def _run_until_done(worker_name, pending):
    from multiprocessing.sharedctypes import RawArray, RawValue

    from django_dbworker.processes.groups import run_group
    from django_dbworker.processes.protocol import SLOT_SIZE

    results = []
    while pending:
        results += run_group(registry[worker_name], "default", pending,
                             RawArray("d", SLOT_SIZE), RawValue("b", 0))
    return results


def test_a_handler_that_ends_the_groups_transaction_and_raises_sends_the_group_one_row_at_a_time(
        monkeypatch):
    """Its savepoint is gone, so nothing can be rolled back to it: the group's earlier
    writes went with the transaction, and each row runs again in a transaction of its own."""
    docs = [Document.objects.create(behaviour="abort" if i == 1 else "ok") for i in range(3)]
    _, results, pending = claim_and_run_group("docs", 3, monkeypatch=monkeypatch)
    # The two rows it reached ran again alone; the third waits for the next group.
    assert [kind for kind, _, _ in results] == ["done"] * 2 and len(pending) == 1
    assert [kind for kind, _, _ in _run_until_done("docs", pending)] == ["done"]
    assert effects("docs") == {str(docs[0].pk): 1, str(docs[2].pk): 1}
    assert [execution_status("docs", d) for d in docs] == [
        ExecutionStatus.FINISHED, ExecutionStatus.FAILED, ExecutionStatus.FINISHED]


@pytest.mark.parametrize("rows", [1, 3])  # alone, and in a group
@pytest.mark.parametrize("behaviour", ["abort_quietly", "swallow_error"])
def test_a_handler_that_leaves_its_transaction_ended_or_aborted_fails_without_losing_writes(
        behaviour, rows, monkeypatch):
    """It returns Finished() all the same. Its row must not be recorded as finished in a
    transaction its writes are not in, nor its neighbours lose theirs."""
    from django.db import connection

    docs = [Document.objects.create(behaviour=behaviour if i == rows // 2 else "ok")
            for i in range(rows)]
    _, results, pending = claim_and_run_group("docs", rows, monkeypatch=monkeypatch)
    results += _run_until_done("docs", pending)
    assert [kind for kind, _, _ in results] == ["done"] * rows
    odd = docs[rows // 2]
    # A caught error aborts the transaction on PostgreSQL only; elsewhere only the
    # statement failed, and the handler finishes with its write.
    harmless = behaviour == "swallow_error" and connection.vendor != "postgresql"
    ok = [d for d in docs if d is not odd or harmless]
    assert effects("docs") == {str(d.pk): 1 for d in ok}
    assert [execution_status("docs", d) for d in ok] == [ExecutionStatus.FINISHED] * len(ok)
    if not harmless:
        assert execution_status("docs", odd) == ExecutionStatus.FAILED
        # ... blamed on it, with what to do about it (not on the next statement's failure)
        error = Execution.objects.get(worker="docs", source_id=str(odd.pk)).error_message
        if _keeps_savepoints():
            assert ("caught a database error" if behaviour == "swallow_error"
                    else "ended its transaction") in error


# -- a row that arrives alone: its own transaction, no savepoint ---------------------------
@pytest.mark.parametrize("behaviour", ["ok", "fail"])
def test_a_row_that_arrives_alone_runs_in_one_transaction_without_a_savepoint(behaviour,
                                                                              monkeypatch):
    doc = Document.objects.create(behaviour=behaviour)
    sent, (claims, results, pending) = statements_of(
        lambda: claim_and_run_group("docs", 1, monkeypatch=monkeypatch))
    assert [kind for kind, _, _ in results] == ["done"] and not pending
    # Two round trips fewer before the handler starts (a group's savepoint and release):
    # what the pickup of one row into an idle worker waits for. (Not on MySQL: there the
    # RELEASE is what tells that the handler left its transaction open.)
    assert _count(sent, "SAVEPOINT") == (0 if _keeps_savepoints() else 1)
    if behaviour == "ok":
        assert effects("docs") == {str(doc.pk): 1}
        assert execution_status("docs", doc) == ExecutionStatus.FINISHED
    else:  # its writes rolled back with it, the failure recorded after
        assert effects("docs") == {}
        assert execution_status("docs", doc) == ExecutionStatus.FAILED
        assert Execution.objects.get(pk=claims[0].execution_id).error_type == "ValueError"


@pytest.mark.parametrize("rows", [1, 3])  # alone (no savepoint), and a group
def test_a_handler_that_sets_rollback_loses_its_writes_and_its_row_still_finishes(rows,
                                                                                 monkeypatch):
    docs = [Document.objects.create(behaviour="discard") for _ in range(rows)]
    _, results, pending = claim_and_run_group("docs", rows, monkeypatch=monkeypatch)
    assert [kind for kind, _, _ in results] == ["done"] * rows and not pending
    assert effects("docs") == {}
    assert {execution_status("docs", d) for d in docs} == {ExecutionStatus.FINISHED}


def test_a_row_revoked_as_it_is_about_to_start_alone_is_handed_back_unrun(monkeypatch):
    from collections import deque
    from multiprocessing.sharedctypes import RawArray, RawValue

    from django_dbworker.processes import failpoints
    from django_dbworker.processes.groups import run_group
    from django_dbworker.processes.protocol import SLOT_REVOKE, SLOT_SEQ, SLOT_SIZE

    doc = Document.objects.create()
    [held] = claim("docs", 1, "test:alone")
    pending = deque([held.delivery(held.execution_id)])
    slot, stop = RawArray("d", SLOT_SIZE), RawValue("b", 0)

    def revoked_now(point):  # the coordinator revokes after the child's first look
        if point == "child.before_begin":
            slot[SLOT_REVOKE] = 1

    monkeypatch.setattr(failpoints, "reached", revoked_now)
    assert run_group(registry["docs"], "default", pending, slot, stop) == []  # not started
    assert len(pending) == 1 and slot[SLOT_SEQ] == 0
    results = run_group(registry["docs"], "default", pending, slot, stop)
    assert [kind for kind, _, _ in results] == ["skipped"]
    assert effects("docs") == {} and execution_status("docs", doc) == ExecutionStatus.WORKING


@pytest.mark.skipif(os.environ.get("DBWORKER_TEST_DB", "sqlite") == "sqlite", reason="a SQLite file has no connection "
                    "to lose (PostgreSQL and MariaDB runs only)")
@pytest.mark.parametrize("rows", [1, 3])  # alone, and a group
def test_a_row_whose_connection_is_lost_under_it_is_interrupted_not_failed(rows, monkeypatch):
    """Django drops a connection whose rollback failed and connects again at once: the
    child must still tell the server's failure from the handler's, and count no attempt."""
    docs = [Document.objects.create(behaviour="lose_connection") for _ in range(rows)]
    _, results, _ = claim_and_run_group("docs", rows, monkeypatch=monkeypatch)
    assert "interrupted" in [kind for kind, _, _ in results]
    assert "done" not in [kind for kind, _, _ in results]
    assert effects("docs") == {}
    for d in docs:  # held by the claim until the coordinator gives it back: not failed
        e = Execution.objects.get(worker="docs", source_id=str(d.pk))
        assert e.status == ExecutionStatus.WORKING and e.error_type is None
