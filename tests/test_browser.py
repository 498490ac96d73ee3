"""The operator's path in a real browser: headless Chromium driven by Playwright.

Debian's ``chromium`` is used (Playwright's own browser download is not needed). Without
it the test skips locally and fails under CI=true, so a green CI always ran it.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import connections
from django.urls import reverse

from django_dbworker import Coordinator, ExecutionStatus, execution_status
from django_dbworker.models import CoordinatorHeartbeat, Execution
from tests.helpers import execution
from tests.testapp.models import Document

CHROMIUM = os.environ.get("DBWORKER_CHROMIUM", "/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
ASYNC_UNSAFE_AT_START = os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE")
LAUNCH_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--no-first-run"]


def _unavailable(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}; CI must run the browser test (scripts/system-packages.sh "
                    "installs chromium, the test extra installs playwright)")
    pytest.skip(reason)


@pytest.fixture
def browser() -> Iterator[Any]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("playwright is not installed")
    if not (os.access(CHROMIUM, os.X_OK) or shutil.which(CHROMIUM)):
        _unavailable(f"no Chromium at {CHROMIUM}")
    # Playwright's sync API runs an event loop; Django refuses ORM calls from a thread that
    # has one unless told that these tests, which never await, are safe. Only while this
    # fixture lasts: the rest of the session keeps Django's check.
    with pytest.MonkeyPatch.context() as env:
        env.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
        with sync_playwright() as p:
            b = p.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
            try:
                yield b
            finally:
                b.close()
                # Django's connections are per context, and Playwright runs the test in a
                # context of its own: close the connections opened there, or PostgreSQL
                # keeps a session open and the test database cannot be dropped.
                connections.close_all()


def log_in(page: Any, url: str) -> None:
    """As the superuser the tests make: ops / night-shift."""
    page.goto(url + reverse("admin:login"))
    page.fill("#id_username", "ops")
    page.fill("#id_password", "night-shift")
    page.click("input[type=submit]")
    page.wait_for_selector("#user-tools")


@pytest.mark.django_db(transaction=True)
def test_operator_finds_and_resets_failures(browser: Any, live_server: Any,
                                            django_user_model: Any) -> None:
    django_user_model.objects.create_superuser("ops", "ops@example.com", "night-shift")
    broken = [Document.objects.create(title=f"broken {i}", behaviour="fail") for i in range(2)]
    fine = Document.objects.create(title="fine")
    Coordinator(["docs"]).drain()  # real handlers: two fail, one finishes
    assert [execution_status("docs", d) for d in broken] == [ExecutionStatus.FAILED] * 2
    CoordinatorHeartbeat.objects.create(host="worker-1", pid=4242, workers="docs,summaries")

    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.set_default_timeout(15_000)
    url = live_server.url
    log_in(page, url)

    # From the dashboard to the failures.
    page.goto(url + reverse("admin:django_dbworker_dashboard"))
    assert page.inner_text('tr[data-worker="docs"] td[data-status="failed"]') == "2"
    assert "worker-1" in page.inner_text("body")
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
    page.click('tr[data-worker="docs"] td[data-status="failed"] a')
    page.wait_for_selector("#result_list")
    rows = page.locator("#result_list tbody tr")
    assert rows.count() == 2
    assert "ValueError: cannot handle document" in rows.first.inner_text()

    # The detail page of one failure: read the traceback, press Reset, confirm.
    first = execution("docs", broken[0])
    page.click(f'#result_list a[href*="/execution/{first.pk}/change/"]')
    assert "Traceback (most recent call last)" in page.inner_text(".dbworker-traceback")
    page.click("a.dbworker-reset-link")
    page.click("input[type=submit][value='Yes, reset it']")
    page.wait_for_selector(".messagelist .success")
    assert "claimable again" in page.inner_text(".messagelist")
    assert execution_status("docs", broken[0]) == ExecutionStatus.UNFINISHED

    # The other one through the changelist's "Reset failed" action, selecting all.
    page.goto(url + reverse("admin:django_dbworker_execution_changelist")
              + "?worker=docs&status__exact=failed")
    assert page.locator("#result_list tbody tr").count() == 1
    page.check("#action-toggle")
    page.select_option("select[name=action]", "reset_failed")
    page.click("button[name=index]")
    page.wait_for_selector(".messagelist .success")
    assert "Reset failed executions: 1 changed." in page.inner_text(".messagelist")
    assert [execution_status("docs", d) for d in broken] == [ExecutionStatus.UNFINISHED] * 2
    assert execution_status("docs", fine) == ExecutionStatus.FINISHED
    page.close()


@pytest.mark.django_db(transaction=True)
def test_the_dashboard_refreshes_itself_the_why_page_explains_and_the_list_fits(
        browser: Any, live_server: Any, django_user_model: Any) -> None:
    django_user_model.objects.create_superuser("ops", "ops@example.com", "night-shift")
    [Document.objects.create(title=f"broken {i}", behaviour="fail") for i in range(2)]
    Coordinator(["docs"]).drain()
    Execution.objects.filter(worker="docs").update(  # a long error, as real ones are
        error_message="cannot handle document: " + "a very long explanation " * 40)
    waiting = Document.objects.create(title="not uploaded", uploaded=False)

    page = browser.new_page(viewport={"width": 1300, "height": 900})
    page.set_default_timeout(15_000)
    url = live_server.url
    log_in(page, url)

    # The changelist fits a 1300 px laptop screen: no sideways scroll, one-line errors.
    page.goto(url + reverse("admin:django_dbworker_execution_changelist") + "?worker=docs")
    assert page.evaluate("document.documentElement.scrollWidth") <= 1300
    # (The list sits in a box that would scroll sideways by itself: it must not have to.)
    box = page.evaluate("(() => { const r = document.querySelector('#changelist .results');"
                        " return [r.scrollWidth, r.clientWidth]; })()")
    assert box[0] <= box[1], f"the list is {box[0]} px wide in a {box[1]} px box"
    right = page.evaluate("document.querySelector('#result_list').getBoundingClientRect().right")
    assert right <= 1300, right
    heights = page.eval_on_selector_all("#result_list tbody tr", "rows => rows.map(r => r.offsetHeight)")
    assert heights and max(heights) < 80, heights

    # The dashboard's figures refresh by themselves (a server-rendered fragment).
    page.goto(url + reverse("admin:django_dbworker_dashboard"))
    cell = 'tr[data-worker="docs"] td[data-status="failed"]'
    assert page.inner_text(cell) == "2"
    Document.objects.create(title="broken 3", behaviour="fail")
    Coordinator(["docs"]).drain()
    page.wait_for_function(f"document.querySelector('{cell}').innerText.trim() === '3'",
                           timeout=15_000)

    # "Why not running?" from the execution page: the eligible filter blocks this row.
    row = execution("docs", waiting)
    page.goto(url + reverse("admin:django_dbworker_execution_change", args=[row.pk]))
    page.click("a.dbworker-why-link")
    page.wait_for_selector(".dbworker-verdict")
    assert "Blocked by" in page.inner_text(".dbworker-verdict")
    assert page.locator('.dbworker-finding[data-blocking="yes"]').count() >= 1
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "why.png"), full_page=True)
    page.close()


def test_the_browser_fixture_leaves_djangos_async_check_as_it_was() -> None:
    """Runs after the browser test (file order): the variable it set is as before."""
    assert os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE") == ASYNC_UNSAFE_AT_START
