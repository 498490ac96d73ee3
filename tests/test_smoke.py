import pytest

from django_dbworker import Coordinator, ExecutionStatus, execution_status
from django_dbworker.models import Execution
from tests.testapp.models import Document, Effect


@pytest.mark.django_db(transaction=True)
def test_smoke():
    docs = [Document.objects.create(title=f"d{i}") for i in range(5)]
    assert Execution.objects.filter(worker="docs").count() == 5
    stats = Coordinator(["docs"]).drain()
    print(stats)
    assert all(execution_status("docs", d) == ExecutionStatus.FINISHED for d in docs)
    assert Effect.objects.filter(worker="docs").count() == 5
