"""django_dbworker.testing: pending work runs in the test's own process and transaction,
under the same outcome rules, in a django.test.TestCase and with the pytest fixture."""

from __future__ import annotations

import os

from django.test import TestCase

from django_dbworker import ExecutionStatus, execution_status, state
from django_dbworker.testing import run_pending
from tests.helpers import effects
from tests.testapp import tasks
from tests.testapp.models import Document, Tag


class RunPendingInATestCase(TestCase):
    def test_a_handler_runs_in_this_transaction(self):
        doc = Document.objects.create()
        stats = run_pending("docs")
        self.assertEqual(stats["finished"], 1)
        self.assertEqual(execution_status("docs", doc), ExecutionStatus.FINISHED)
        self.assertEqual(effects("docs"), {str(doc.pk): 1})
        self.assertEqual(Document.objects.get(pk=doc.pk).text, f"handled {doc.pk}")

    def test_a_dependency_chain_runs_in_order(self):
        doc = Document.objects.create()
        run_pending("docs", "summaries")
        self.assertEqual(effects("summaries"), {str(doc.pk): 1})

    def test_a_failure_rolls_back_its_writes_and_is_recorded(self):
        doc = Document.objects.create(behaviour="fail")
        stats = run_pending("docs")
        self.assertEqual(stats["failed"], 1)
        self.assertEqual(effects("docs"), {})
        self.assertEqual(state("docs", doc)["error"]["type"], "ValueError")

    def test_retries_count_attempts(self):
        tag = Tag.objects.create(slug="retry-here")
        stats = run_pending("retrying", include_waiting=True)
        self.assertEqual((stats["retried"], stats["failed"]), (2, 1))
        self.assertEqual(state("retrying", tag)["attempts"], 3)

    def test_unfinished_runs_again_until_done(self):
        doc = Document.objects.create(behaviour="steps:3")
        stats = run_pending("docs")
        self.assertEqual((stats["unfinished"], stats["finished"]), (2, 1))
        self.assertEqual(Document.objects.get(pk=doc.pk).steps, 3)

    def test_an_enqueued_task_runs(self):
        result = tasks.add.enqueue(2, 2)
        with self.captureOnCommitCallbacks(execute=True):
            run_pending("tasks.default.default")
        self.assertEqual(tasks.add.get_result(result.id).return_value, 4)

    def test_nothing_ran_in_another_process(self):
        Document.objects.create()
        run_pending("docs")
        from tests.testapp.models import Effect

        self.assertEqual(set(Effect.objects.values_list("pid", flat=True)), {os.getpid()})


def test_the_pytest_fixture(dbworker):
    doc = Document.objects.create()
    assert dbworker.run("docs")["finished"] == 1
    assert execution_status("docs", doc) == ExecutionStatus.FINISHED
