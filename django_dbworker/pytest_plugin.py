"""A pytest fixture for your own tests (registered through the ``pytest11`` entry point):

    def test_ocr(dbworker):
        doc = Document.objects.create(uploaded=True)
        dbworker.run("ocr")
        assert execution_status("ocr", doc) == ExecutionStatus.FINISHED

It uses pytest-django's ``db`` fixture: the rows run inside the test's transaction.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest


class Runner:
    def run(self, *workers: str, **options: Any) -> Counter[str]:
        from .testing import run_pending

        return run_pending(*workers, **options)


@pytest.fixture
def dbworker(db: Any) -> Runner:
    """Run pending work in the test's process and transaction: ``dbworker.run("ocr")``."""
    return Runner()
