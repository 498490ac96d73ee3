"""One OpenTelemetry span per execution, when ``opentelemetry-api`` is installed (it is
optional: without it this costs nothing). Configure the SDK and an exporter as usual."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

try:
    from opentelemetry import trace
except ImportError:  # pragma: no cover - the optional dependency is absent
    trace = None  # type: ignore[assignment]


@functools.cache
def _tracer() -> Any:
    # Once per process: get_tracer() per row cost a twentieth of a quick row's time. The
    # API's proxy tracer follows a provider that is configured later.
    return trace.get_tracer("django_dbworker")


@contextmanager
def span(worker: str, source_id: str, attempt: int) -> Iterator[Any]:
    """A ``dbworker.execute`` span around one handler; set ``dbworker.outcome`` on it."""
    if trace is None:
        yield None
        return
    with _tracer().start_as_current_span("dbworker.execute", attributes={
            "dbworker.worker": worker, "dbworker.source_id": source_id,
            "dbworker.attempt": attempt}) as current:
        yield current
