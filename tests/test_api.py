import pytest
from django.db.models import Q

from django_dbworker import (
    ExecutionStatus,
    annotate_execution_status,
    execution_status,
    has_execution_status,
    reset_failed,
    state,
)
from django_dbworker.models import Execution
from tests.helpers import mark_failed
from tests.testapp.models import Document


def test_has_execution_status_builds_sql_only():
    expr = has_execution_status("docs", [ExecutionStatus.FAILED, "finished"])
    qs = Document.objects.filter(expr)  # no database access here (not marked django_db)
    assert "django_dbworker_execution" in str(qs.query)


def test_unknown_statuses_and_workers_fail_clearly():
    with pytest.raises(ValueError, match="not an execution status"):
        has_execution_status("docs", ["done"])
    with pytest.raises(LookupError, match="Registered workers"):
        has_execution_status("nope", ExecutionStatus.FAILED)


@pytest.mark.django_db
def test_has_execution_status_in_filter_exclude_q_and_annotations():
    a, b, c = (Document.objects.create() for _ in range(3))
    mark_failed(Execution.objects.filter(worker="docs", source_id=str(a.pk)))
    Execution.objects.filter(worker="docs", source_id=str(b.pk)).update(status="finished")
    failed = has_execution_status("docs", ExecutionStatus.FAILED)
    assert list(Document.objects.filter(failed)) == [a]
    assert set(Document.objects.exclude(failed)) == {b, c}
    assert set(Document.objects.filter(Q(failed) | Q(pk=c.pk))) == {a, c}
    assert set(Document.objects.filter(has_execution_status("docs", ["failed", "finished"]))) == {a, b}
    flags = dict(Document.objects.annotate(done=has_execution_status("docs", "finished"))
                 .values_list("pk", "done"))
    assert flags == {a.pk: False, b.pk: True, c.pk: False}
    # An explicit source: a primary key.
    assert Document.objects.filter(has_execution_status("docs", "pending", source=c.pk)).count() == 3


@pytest.mark.django_db
def test_annotate_execution_status_in_one_query(django_assert_num_queries):
    docs = [Document.objects.create() for _ in range(5)]
    mark_failed(Execution.objects.filter(worker="docs", source_id=str(docs[0].pk)))
    with django_assert_num_queries(1):
        rows = list(annotate_execution_status(Document.objects.order_by("pk"), "docs", "summaries"))
    assert [r.docs_execution_status for r in rows] == ["failed"] + ["pending"] * 4
    assert {r.summaries_execution_status for r in rows} == {"pending"}


@pytest.mark.django_db
def test_state_and_execution_status():
    doc = Document.objects.create()
    assert execution_status("docs", doc) is ExecutionStatus.PENDING
    s = state("docs", doc)
    assert s["execution_status"] is ExecutionStatus.PENDING
    assert s["error"] is None and s["attempts"] == 0 and s["lease_expires_at"] is None
    assert {"claimed_by", "created_at", "updated_at", "started_at", "finished_at"} <= set(s)
    with pytest.raises(TypeError):
        s["attempts"] = 3  # read-only
    assert state("docs", 10**9) is None
    assert execution_status("docs", 10**9) is None
    with pytest.raises(LookupError):
        state("nope", doc)


@pytest.mark.django_db
def test_reset_failed_only_touches_failed_rows():
    from datetime import timedelta

    from django.utils import timezone

    from tests.helpers import execution, mark_failed

    doc, other = Document.objects.create(), Document.objects.create()
    assert reset_failed("docs", doc) is False
    assert execution_status("docs", doc) is ExecutionStatus.PENDING
    # Failed as a handler leaves it, plus what an interrupted claim could leave behind.
    mark_failed(Execution.objects.filter(worker="docs", source_id__in=[str(doc.pk), str(other.pk)]))
    Execution.objects.filter(worker="docs", source_id=str(doc.pk)).update(
        attempts=2, claim_token="t", lease_expires_at=timezone.now() + timedelta(hours=1),
        next_attempt_at=timezone.now() + timedelta(hours=1))
    before = execution("docs", doc)
    assert before.error_message and before.error_traceback and before.claimed_by  # set
    assert reset_failed("docs", doc) is True
    e = execution("docs", doc)
    assert (e.status, e.attempts) == ("unfinished", 0)
    # The error, its traceback, the claim and the lease are gone: a clean slate.
    assert (e.error_type, e.error_message, e.error_traceback) == (None, None, None)
    assert (e.claim_token, e.claimed_by, e.lease_expires_at) == (None, None, None)
    assert (e.next_attempt_at, e.finished_at) == (None, None)
    assert e.updated_at > before.updated_at
    assert execution_status("docs", other) is ExecutionStatus.FAILED  # only the one asked for
    assert reset_failed("docs", doc) is False  # no longer failed: nothing to reset


def test_status_enum_values():
    assert [s.value for s in ExecutionStatus] == ["pending", "working", "unfinished", "finished", "failed"]
    assert ExecutionStatus("failed") is ExecutionStatus.FAILED
