"""With opentelemetry-api installed, each execution is one ``dbworker.execute`` span with
the worker, the source key, the attempt and the outcome (docs/operations.md). The spans
come from the child's own code path, run here by run_pending()."""

from __future__ import annotations

from django.test import TestCase
from opentelemetry import trace  # the test extra installs the API and the SDK
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from django_dbworker.testing import run_pending
from tests.testapp.models import Document

EXPORTER = InMemorySpanExporter()


def setUpModule() -> None:
    # The global provider can be set once per process; the app's tracer is a proxy that
    # follows it even though it was made earlier.
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(EXPORTER))
    trace.set_tracer_provider(provider)


class Spans(TestCase):
    def test_one_span_per_execution_with_its_outcome(self):
        EXPORTER.clear()
        ok = Document.objects.create()
        bad = Document.objects.create(behaviour="fail")
        run_pending("docs")
        spans = {s.attributes["dbworker.source_id"]: s for s in EXPORTER.get_finished_spans()
                 if s.name == "dbworker.execute"}
        self.assertEqual(set(spans), {str(ok.pk), str(bad.pk)})
        for doc, outcome in ((ok, "finished"), (bad, "failed")):
            attributes = dict(spans[str(doc.pk)].attributes)
            self.assertEqual(attributes, {
                "dbworker.worker": "docs", "dbworker.source_id": str(doc.pk),
                "dbworker.attempt": 1, "dbworker.outcome": outcome})
