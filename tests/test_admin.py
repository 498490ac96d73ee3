"""The Execution admin, its dashboard and reset button, and DBWorkerStatusMixin."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Permission
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from django_dbworker import ExecutionStatus, execution_status, registry
from django_dbworker.admin import format_age
from django_dbworker.models import CoordinatorHeartbeat, Execution
from django_dbworker.store import clock
from tests.helpers import mark_failed
from tests.testapp.models import Document, Tag, UuidItem

HOSTILE = "<script>alert(1)</script>"
ESCAPED = "&lt;script&gt;alert(1)&lt;/script&gt;"
CHANGELIST = reverse("admin:django_dbworker_execution_changelist")
DASHBOARD = reverse("admin:django_dbworker_dashboard")
DOCUMENTS = reverse("admin:testapp_document_changelist")

pytestmark = pytest.mark.django_db


# -- helpers -------------------------------------------------------------------------------
def make_documents(n: int) -> list[Document]:
    Document.objects.bulk_create([Document(title=f"d{i}") for i in range(n)])
    return list(Document.objects.order_by("id"))


def docs_executions(documents: list[Document]) -> Any:
    return Execution.objects.filter(worker="docs", source_id__in=[str(d.pk) for d in documents])


def finish(executions: Any) -> None:
    executions.update(status=ExecutionStatus.FINISHED, finished_at=timezone.now())


def statuses(documents: list[Document]) -> list[ExecutionStatus | None]:
    return [execution_status("docs", d) for d in documents]


def change_url(execution: Execution) -> str:
    return reverse("admin:django_dbworker_execution_change", args=[execution.pk])


def reset_url(execution: Execution) -> str:
    return reverse("admin:django_dbworker_execution_reset", args=[execution.pk])


def run_action(client: Client, url: str, action: str, pks: list[Any]) -> Any:
    return client.post(url, {"action": action, "_selected_action": [str(p) for p in pks]},
                       follow=True)


def messages_of(response: Any) -> list[str]:
    return [str(m) for m in response.context["messages"]]


@pytest.fixture
def viewer(django_user_model: Any) -> Any:
    """Staff with view permissions only."""
    user = django_user_model.objects.create_user("viewer", password="pw", is_staff=True)
    user.user_permissions.add(*Permission.objects.filter(
        codename__in=["view_execution", "view_document"]))
    return user


@pytest.fixture
def viewer_client(client: Client, viewer: Any) -> Client:
    client.force_login(viewer)
    return client


@pytest.fixture
def failed_doc() -> tuple[Document, Execution]:
    [doc] = make_documents(1)
    mark_failed(docs_executions([doc]))
    return doc, docs_executions([doc]).get()


# -- access --------------------------------------------------------------------------------
def test_anonymous_is_sent_to_login(client: Client, failed_doc: Any) -> None:
    _, execution = failed_doc
    for url in [CHANGELIST, DASHBOARD, change_url(execution), reset_url(execution),
                reverse("admin:app_list", args=["django_dbworker"])]:
        response = client.get(url)
        assert response.status_code == 302, url
        assert response["Location"].startswith(reverse("admin:login")), url
    assert client.post(reset_url(execution)).status_code == 302
    assert execution_status("docs", failed_doc[0]) == ExecutionStatus.FAILED


def test_no_add_no_delete_no_edit(admin_client: Client, failed_doc: Any) -> None:
    _, execution = failed_doc
    assert admin_client.get(reverse("admin:django_dbworker_execution_add")).status_code == 403
    assert admin_client.get(
        reverse("admin:django_dbworker_execution_delete", args=[execution.pk])).status_code == 403
    page = admin_client.get(change_url(execution))
    assert page.status_code == 200
    assert 'name="status"' not in page.text and 'name="_save"' not in page.text
    response = admin_client.post(change_url(execution), {"status": "finished"})
    assert response.status_code == 403
    assert execution_status("docs", failed_doc[0]) == ExecutionStatus.FAILED
    actions = admin_client.get(CHANGELIST).context["action_form"].fields["action"].choices
    assert "delete_selected" not in [name for name, _ in actions]


def test_app_index_links_to_dashboard(admin_client: Client) -> None:
    page = admin_client.get(reverse("admin:app_list", args=["django_dbworker"]))
    assert f'href="{DASHBOARD}"' in page.text


# -- changelist ----------------------------------------------------------------------------
def test_changelist_columns(admin_client: Client, failed_doc: Any) -> None:
    doc, execution = failed_doc
    Execution.objects.filter(pk=execution.pk).update(
        lease_expires_at=timezone.now(), claimed_by="box-7:4242")
    page = admin_client.get(CHANGELIST, {"worker": "docs"})
    assert page.status_code == 200
    text = page.text
    document_url = reverse("admin:testapp_document_change", args=[doc.pk])
    assert f'<a href="{document_url}">document {doc.pk}</a>' in text
    assert '<span class="dbworker-status dbworker-status--failed">Failed</span>' in text
    assert "ValueError: cannot handle it" in text and "second line" not in text
    assert "box-7:4242" in text
    assert f'href="{DASHBOARD}"' in text
    # Each column shows this row's own value: attempts, lease expiry, updated time.
    import re

    from django.utils import formats

    cells = dict(re.findall(r'<td class="field-([a-z_]+)[^"]*">(.*?)</td>', text, re.S))
    row = Execution.objects.get(pk=execution.pk)
    assert cells["attempts"] == "1" == str(row.attempts)
    # The claim with its lease's expiry, and the update time: short (today's time of
    # day), the full date and time on hover.
    lease = timezone.localtime(row.lease_expires_at)
    lease_short = (f"{lease:%H:%M:%S}" if lease.date() == timezone.localdate()
                   else f"{lease:%Y-%m-%d}")  # (just after midnight: yesterday's date)
    assert cells["claim"] == (f'<span title="lease until {formats.localize(lease)}">'
                              f'box-7:4242 · {lease_short}</span>'), cells
    updated = timezone.localtime(row.updated_at)
    short = f"{updated:%H:%M:%S}" if updated.date() == timezone.localdate() else f"{updated:%Y-%m-%d}"
    assert cells["updated"] == (f'<span title="{formats.localize(updated)}">{short}</span>'), cells
    Execution.objects.filter(pk=execution.pk).update(
        updated_at=timezone.now() - timedelta(days=3), lease_expires_at=None)
    cells = dict(re.findall(r'<td class="field-([a-z_]+)[^"]*">(.*?)</td>',
                            admin_client.get(CHANGELIST, {"worker": "docs"}).text, re.S))
    assert cells["claim"] == "box-7:4242"
    older = timezone.localtime(Execution.objects.get(pk=execution.pk).updated_at)
    assert f">{older:%Y-%m-%d}</span>" in cells["updated"], cells


def test_source_without_admin_is_plain_text(admin_client: Client) -> None:
    Tag.objects.create(slug="plain")
    text = admin_client.get(CHANGELIST, {"worker": "tags"}).text
    assert "plain" in text and "/testapp/tag/" not in text


def test_filters_and_search(admin_client: Client) -> None:
    documents = make_documents(6)
    mark_failed(docs_executions(documents[:2]), "disk full")
    finish(docs_executions(documents[2:3]))

    def shown(**params: str) -> set[tuple[str, str]]:
        response = admin_client.get(CHANGELIST, params)
        assert response.status_code == 200
        return {(e.worker, e.source_id) for e in response.context["cl"].result_list}

    assert shown(worker="docs", status="failed") == {("docs", str(d.pk)) for d in documents[:2]}
    assert shown(worker="docs", status="finished") == {("docs", str(documents[2].pk))}
    assert len(shown(worker="docs")) == 6
    assert {w for w, _ in shown(status="pending")} == {"docs", "summaries", "ordered_desc",
                                                       "by_author"}
    key = str(documents[4].pk)
    assert shown(q=key) == {(w, key) for w in ["docs", "summaries", "ordered_desc", "by_author"]}
    assert shown(q="disk full") == {("docs", str(d.pk)) for d in documents[:2]}
    assert shown(q="valueerror", worker="docs") == {("docs", str(d.pk)) for d in documents[:2]}
    filters = admin_client.get(CHANGELIST).text
    assert "?worker=docs" in filters and "?status__exact=failed" in filters
    assert "_facets" not in filters  # the dashboard gives counts without a COUNT per choice


def test_changelist_query_count_does_not_grow(admin_client: Client) -> None:
    make_documents(5)  # 20 executions over four workers

    def count() -> int:
        with CaptureQueriesContext(connection) as queries:
            response = admin_client.get(CHANGELIST, {"all": ""})
        assert response.status_code == 200
        return len(queries), len(response.context["cl"].result_list)

    small, rows = count()
    assert rows == 20
    make_documents(45)  # 200 executions: all of them on the page
    large, rows = count()
    assert rows == 200
    assert large == small <= 6, (small, large)


# -- detail page and the reset button ------------------------------------------------------
def test_detail_shows_full_traceback_read_only(admin_client: Client, failed_doc: Any) -> None:
    _, execution = failed_doc
    page = admin_client.get(change_url(execution))
    assert page.status_code == 200
    assert '<pre class="dbworker-traceback">Traceback (most recent call last):\n' in page.text
    assert "second line" in page.text
    assert "<textarea" not in page.text
    assert f'href="{reset_url(execution)}"' in page.text


def test_reset_button_flow(admin_client: Client, failed_doc: Any) -> None:
    doc, execution = failed_doc
    confirm = admin_client.get(reset_url(execution))
    assert confirm.status_code == 200
    assert "Yes, reset it" in confirm.text and "cannot handle it" in confirm.text
    assert execution_status("docs", doc) == ExecutionStatus.FAILED  # GET changes nothing
    response = admin_client.post(reset_url(execution))
    assert response.status_code == 302 and response["Location"] == change_url(execution)
    assert execution_status("docs", doc) == ExecutionStatus.UNFINISHED
    execution.refresh_from_db()
    assert execution.error_type is None and execution.attempts == 0
    assert LogEntry.objects.filter(object_id=str(execution.pk)).exists()
    page = admin_client.get(response["Location"])
    assert any("claimable again" in m for m in messages_of(page))
    assert f'href="{reset_url(execution)}"' not in page.text  # no longer failed


def test_reset_of_a_row_that_did_not_fail_changes_nothing(admin_client: Client) -> None:
    [doc] = make_documents(1)
    finish(docs_executions([doc]))
    execution = docs_executions([doc]).get()
    response = admin_client.post(reset_url(execution), follow=True)
    assert any("nothing to reset" in m for m in messages_of(response))
    assert execution_status("docs", doc) == ExecutionStatus.FINISHED


def test_reset_of_a_missing_row_redirects(admin_client: Client) -> None:
    response = admin_client.get(reverse("admin:django_dbworker_execution_reset", args=[999999]))
    assert response.status_code == 302


def test_reset_button_enforces_csrf(admin_user: Any, failed_doc: Any) -> None:
    doc, execution = failed_doc
    client = Client(enforce_csrf_checks=True)
    client.force_login(admin_user)
    assert client.post(reset_url(execution)).status_code == 403
    assert execution_status("docs", doc) == ExecutionStatus.FAILED
    client.get(reset_url(execution))  # sets the CSRF cookie, as a browser would
    token = client.cookies["csrftoken"].value
    response = client.post(reset_url(execution), {"csrfmiddlewaretoken": token})
    assert response.status_code == 302
    assert execution_status("docs", doc) == ExecutionStatus.UNFINISHED


# -- actions -------------------------------------------------------------------------------
def test_reset_failed_action_counts(admin_client: Client) -> None:
    documents = make_documents(5)
    mark_failed(docs_executions(documents[:3]))
    finish(docs_executions(documents[3:]))
    pks = list(docs_executions(documents).values_list("pk", flat=True))
    response = run_action(admin_client, CHANGELIST, "reset_failed", pks)
    assert messages_of(response) == ["Reset failed executions: 3 changed, 2 skipped (not failed)."]
    assert statuses(documents) == [ExecutionStatus.UNFINISHED] * 3 + [ExecutionStatus.FINISHED] * 2


def test_reset_failed_across_all_filtered_rows(admin_client: Client) -> None:
    documents = make_documents(4)
    mark_failed(docs_executions(documents))
    response = admin_client.post(
        CHANGELIST + "?worker=docs&status=failed",
        {"action": "reset_failed", "select_across": "1", "_selected_action": ["0"]}, follow=True)
    assert messages_of(response) == ["Reset failed executions: 4 changed."]
    assert statuses(documents) == [ExecutionStatus.UNFINISHED] * 4


def test_run_again_action(admin_client: Client) -> None:
    documents = make_documents(3)
    finish(docs_executions(documents[:2]))
    mark_failed(docs_executions(documents[2:]))
    pks = list(docs_executions(documents).values_list("pk", flat=True))
    response = run_action(admin_client, CHANGELIST, "run_again", pks)
    assert messages_of(response) == [
        "Queued finished executions to run again: 2 changed, 1 skipped (not finished)."]
    assert statuses(documents) == [ExecutionStatus.UNFINISHED] * 2 + [ExecutionStatus.FAILED]


def test_viewer_sees_pages_but_changes_nothing(viewer_client: Client, failed_doc: Any) -> None:
    doc, execution = failed_doc
    page = viewer_client.get(CHANGELIST)
    assert page.status_code == 200
    assert page.context["action_form"] is None  # no action is offered
    detail = viewer_client.get(change_url(execution))
    assert detail.status_code == 200 and "Traceback" in detail.text
    assert reset_url(execution) not in detail.text
    assert viewer_client.get(DASHBOARD).status_code == 200
    finished_doc = Document.objects.create()
    finish(docs_executions([finished_doc]))  # a row run_again would change, if allowed
    for action in ["reset_failed", "run_again"]:
        run_action(viewer_client, CHANGELIST, action,
                   [execution.pk, *docs_executions([finished_doc]).values_list("pk", flat=True)])
    assert viewer_client.get(reset_url(execution)).status_code == 403
    assert viewer_client.post(reset_url(execution)).status_code == 403
    assert execution_status("docs", doc) == ExecutionStatus.FAILED
    assert execution_status("docs", finished_doc) == ExecutionStatus.FINISHED


def test_staff_without_view_permission_is_refused(client: Client,
                                                  django_user_model: Any) -> None:
    client.force_login(django_user_model.objects.create_user("s", password="pw", is_staff=True))
    assert client.get(CHANGELIST).status_code == 403
    assert client.get(DASHBOARD).status_code == 403


# -- the "why not running?" page -------------------------------------------------------------
def why_url(worker: str, key: str) -> str:
    return reverse("admin:django_dbworker_why", args=[worker, key])


@pytest.mark.parametrize("worker,key", [("docs", "abc"), ("docs", "1.5"), ("docs", "_00"),
                                        ("uuids", "abc")])
def test_why_page_of_a_key_no_row_can_have_is_a_404(admin_client: Client, worker: str,
                                                      key: str) -> None:
    """Not a server error (the test client would re-raise it)."""
    assert admin_client.get(why_url(worker, key)).status_code == 404


def test_why_page_reads_the_key_as_the_database_does(admin_client: Client) -> None:
    [doc] = make_documents(1)
    page = admin_client.get(why_url("docs", f"00{doc.pk}"))
    assert page.status_code == 200
    assert f"Why is document {doc.pk} not running (docs)?" in page.text
    assert change_url(docs_executions([doc]).get()) in page.text


def test_why_page_needs_the_source_models_view_permission(client: Client,
                                                          django_user_model: Any) -> None:
    """The page says whether the row exists and which conditions it meets: facts about a
    document, which a user who may not view documents must not learn."""
    [doc] = make_documents(1)
    item = UuidItem.objects.create()
    user = django_user_model.objects.create_user("why", password="pw", is_staff=True)
    user.user_permissions.add(Permission.objects.get(codename="view_execution"))
    client.force_login(user)
    for url in [why_url("docs", str(doc.pk)), why_url("docs", "404404"), why_url("docs", "abc"),
                why_url("uuids", str(item.pk))]:
        assert client.get(url).status_code == 403, url
    # Documents through their ModelAdmin, UuidItem (no admin here) through its permissions;
    # the change permission is enough, as on Django's own admin pages.
    user.user_permissions.add(*Permission.objects.filter(
        codename__in=["view_document", "change_uuiditem"]))
    assert client.get(why_url("docs", str(doc.pk))).status_code == 200
    assert client.get(why_url("uuids", str(item.pk))).status_code == 200
    assert client.get(why_url("docs", "abc")).status_code == 404


def test_why_page_of_a_row_with_an_unknown_status(admin_client: Client) -> None:
    [doc] = make_documents(1)
    docs_executions([doc]).update(status="bogus")  # by hand, or by a newer version
    page = admin_client.get(why_url("docs", str(doc.pk)))
    assert page.status_code == 200
    assert 'data-what="status" data-blocking="yes"' in page.text
    assert "Status &#x27;bogus&#x27; is none this version knows" in page.text


# -- escaping ------------------------------------------------------------------------------
def test_hostile_text_is_escaped_everywhere(admin_client: Client) -> None:
    [doc] = make_documents(1)
    mark_failed(docs_executions([doc]), HOSTILE)
    execution = docs_executions([doc]).get()
    Tag.objects.create(slug=HOSTILE)
    CoordinatorHeartbeat.objects.create(host=HOSTILE, pid=1, workers=HOSTILE)
    pages = [
        admin_client.get(CHANGELIST),
        admin_client.get(CHANGELIST, {"q": HOSTILE}),
        admin_client.get(change_url(execution)),
        admin_client.get(reset_url(execution)),
        admin_client.get(DASHBOARD),
        admin_client.get(DOCUMENTS),
        admin_client.get(change_url(Execution.objects.get(worker="tags"))),
    ]
    for page in pages:
        assert page.status_code == 200
        assert HOSTILE not in page.text, page.request["PATH_INFO"]
    assert all(ESCAPED in page.text for page in pages[:5])


# -- dashboard -----------------------------------------------------------------------------
def test_dashboard_figures(admin_client: Client) -> None:
    documents = make_documents(6)
    mark_failed(docs_executions(documents[:2]))
    finish(docs_executions(documents[2:5]))
    two_hours_ago = timezone.now() - timedelta(hours=2)
    docs_executions(documents[1:2]).update(finished_at=two_hours_ago)  # an old failure
    Execution.objects.filter(worker="summaries").update(  # claimable for 90 minutes
        created_at=timezone.now() - timedelta(minutes=90),
        ready_at=timezone.now() - timedelta(minutes=90))
    docs_executions(documents[5:]).update(status=ExecutionStatus.WORKING,
                                          lease_expires_at=timezone.now() - timedelta(seconds=5))
    now = timezone.now()
    CoordinatorHeartbeat.objects.create(host="alive", pid=11, workers="docs,summaries",
                                        heartbeat_at=now)
    CoordinatorHeartbeat.objects.create(host="gone", pid=12, workers="docs",
                                        heartbeat_at=now - timedelta(minutes=10))
    response = admin_client.get(DASHBOARD)
    assert response.status_code == 200
    dashboard = response.context["dashboard"]
    docs = next(w for w in dashboard.workers if w.name == "docs")
    assert docs.counts == {"failed": 2, "finished": 3, "working": 1}
    assert docs.total == 6 and docs.failed_last_hour == 1 and docs.expired_leases == 1
    assert docs.oldest_waiting is None
    summaries = next(w for w in dashboard.workers if w.name == "summaries")
    assert summaries.counts == {"pending": 6}
    assert timedelta(minutes=89) < summaries.oldest_waiting < timedelta(minutes=91)
    assert summaries.oldest_waiting_display == "1h 30m"
    assert {w.name for w in dashboard.workers} >= {"docs", "summaries", "tags", "uuids"}
    assert [(c.host, c.live) for c in dashboard.coordinators] == [("alive", True), ("gone", False)]
    assert dashboard.live_coordinators == 1
    text = response.text
    assert "Coordinators: 1 live" in text and "docs, summaries" in text
    assert f"{CHANGELIST}?worker=docs&amp;status__exact=failed" in text
    # Five, the pauses, a capped FINISHED count per worker, and one per flow-control limit
    # with a figure of its own (per_key, rate).
    queries = 6 + len(registry) + limit_queries()
    assert f'id="dbworker-query-count">This page\'s figures took {queries} database queries' in text


def test_dashboard_caps_the_finished_count(admin_client: Client, monkeypatch: Any) -> None:
    monkeypatch.setattr("django_dbworker.admin.dashboard.FINISHED_COUNT_LIMIT", 2)
    documents = make_documents(3)
    finish(docs_executions(documents))
    response = admin_client.get(DASHBOARD)
    docs = next(w for w in response.context["dashboard"].workers if w.name == "docs")
    assert docs.counts == {"finished": 2} and docs.finished_capped
    assert ">2+</a>" in response.text and ">2+</td>" in response.text


def test_dashboard_query_count_is_constant(admin_client: Client) -> None:
    clock.now(connection.alias)  # (the database's clock, read once a minute: not counted)

    def count() -> int:
        with CaptureQueriesContext(connection) as queries:
            response = admin_client.get(DASHBOARD)
        assert response.status_code == 200
        return len(queries), response.context["query_count"]

    empty = count()
    documents = make_documents(50)  # 200 executions
    mark_failed(docs_executions(documents[:10]))
    CoordinatorHeartbeat.objects.create(host="h", pid=1, workers="docs")
    assert count() == empty
    # Six (the pauses among them), plus one capped FINISHED count per registered worker
    # and one per limit of a limited worker: none grows with rows.
    assert empty[1] == 6 + len(registry) + limit_queries() and empty[0] <= empty[1] + 2


def limit_queries() -> int:
    return sum((w.per_key is not None) + (w.rate is not None) for w in registry.values())


def test_format_age() -> None:
    assert format_age(timedelta(seconds=8)) == "8s"
    assert format_age(timedelta(minutes=12, seconds=5)) == "12m 5s"
    assert format_age(timedelta(days=3, hours=4, minutes=5)) == "3d 4h"
    assert format_age(timedelta(hours=1, seconds=5)) == "1h 0m"


# -- the mixin on the user's own admin -----------------------------------------------------
def test_mixin_columns_without_a_query_per_row(admin_client: Client) -> None:
    documents = make_documents(4)
    mark_failed(docs_executions(documents[:1]))

    def render() -> tuple[int, Any]:
        with CaptureQueriesContext(connection) as queries:
            response = admin_client.get(DOCUMENTS, {"all": ""})
        assert response.status_code == 200
        return len(queries), response

    small, page = render()
    assert page.text.count("dbworker-status--failed") == 1
    assert page.text.count("dbworker-status--pending") == 4 + 3  # summaries column
    assert "docs status" in page.text and "summaries status" in page.text
    assert "django_dbworker/dbworker.css" in page.text
    make_documents(196)
    large, page = render()
    assert len(page.context["cl"].result_list) == 200
    assert large == small <= 6, (small, large)


def test_mixin_status_filter(admin_client: Client) -> None:
    documents = make_documents(5)
    mark_failed(docs_executions(documents[:2]))
    finish(docs_executions(documents[2:3]))

    def shown(**params: str) -> set[int]:
        response = admin_client.get(DOCUMENTS, params)
        assert response.status_code == 200
        return {d.pk for d in response.context["cl"].result_list}

    assert shown(docs_status="failed") == {d.pk for d in documents[:2]}
    assert shown(docs_status="finished") == {documents[2].pk}
    assert shown(docs_status="pending") == {d.pk for d in documents[3:]}
    Execution.objects.filter(worker="docs", source_id=str(documents[4].pk)).delete()
    assert shown(docs_status="none") == {documents[4].pk}
    assert admin_client.get(DOCUMENTS, {"docs_status": "bogus"}).status_code == 302  # ?e=1


def test_mixin_reset_action(admin_client: Client) -> None:
    documents = make_documents(4)
    mark_failed(docs_executions(documents[:2]))
    response = run_action(admin_client, DOCUMENTS, "reset_failed_docs", [d.pk for d in documents])
    assert messages_of(response) == [
        "Reset failed docs work: 2 changed, 2 skipped (their docs work had not failed)."]
    assert statuses(documents) == [ExecutionStatus.UNFINISHED] * 2 + [ExecutionStatus.PENDING] * 2
    choices = dict(response.context["action_form"].fields["action"].choices)
    assert choices["reset_failed_docs"] == "Reset failed docs work of selected documents"


def test_mixin_reset_action_needs_execution_change_permission(viewer_client: Client) -> None:
    documents = make_documents(2)
    mark_failed(docs_executions(documents))
    page = viewer_client.get(DOCUMENTS)
    assert page.status_code == 200 and page.context["action_form"] is None
    run_action(viewer_client, DOCUMENTS, "reset_failed_docs", [d.pk for d in documents])
    assert statuses(documents) == [ExecutionStatus.FAILED] * 2


# -- every change a person makes is in the object's history ------------------------------
@pytest.mark.parametrize("changelist,action,prepare,logged", [
    (CHANGELIST, "reset_failed", mark_failed, "Reset failed execution."),
    (CHANGELIST, "run_again", lambda e: finish(e), "Queued finished execution to run again."),
    (DOCUMENTS, "reset_failed_docs", mark_failed, None),
])
def test_admin_actions_leave_a_log_entry_per_changed_execution(
        admin_client: Client, admin_user: Any, changelist: str, action: str, prepare: Any,
        logged: str | None) -> None:
    documents = make_documents(3)
    prepare(docs_executions(documents[:2]))  # the third is pending: not changed, not logged
    selected = ([d.pk for d in documents] if changelist == DOCUMENTS
                else list(docs_executions(documents).values_list("pk", flat=True)))
    run_action(admin_client, changelist, action, selected)
    changed = {str(pk) for pk in docs_executions(documents[:2]).values_list("pk", flat=True)}
    entries = LogEntry.objects.filter(content_type__model="execution")
    assert {e.object_id for e in entries} == changed
    assert all(e.user_id == admin_user.pk and e.is_change() for e in entries)
    if logged is not None:
        assert {e.get_change_message() for e in entries} == {logged}


def test_a_row_with_an_unknown_status_renders_on_both_changelists(admin_client: Client) -> None:
    documents = make_documents(2)
    docs_executions(documents[:1]).update(status="bogus")  # by hand, or by a newer version
    for url in (CHANGELIST, DOCUMENTS):
        page = admin_client.get(url)
        assert page.status_code == 200, url
        assert "Unknown (bogus)" in page.text, url
    detail = admin_client.get(reverse("admin:django_dbworker_execution_change",
                                      args=[docs_executions(documents[:1]).get().pk]))
    assert detail.status_code == 200 and "Unknown (bogus)" in detail.text


def test_an_execution_page_shows_how_often_it_crashed_its_process(admin_client: Client) -> None:
    executions = docs_executions(make_documents(1))
    executions.update(status=ExecutionStatus.FAILED, crashes=3, error_type="ChildDied",
                      error_message="The handler crashed its process 3 times in a row")
    page = admin_client.get(change_url(executions.get())).text
    assert re.search(r"Crashes:</label>\s*<div class=\"readonly\">3</div>", page), page
    assert "crashed its process 3 times in a row" in page
