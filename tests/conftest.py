import os

import pytest
from django.db import connection


def pytest_report_header(config):
    return f"dbworker test database: {os.environ.get('DBWORKER_TEST_DB', 'sqlite')}"


@pytest.fixture
def vendor(db):
    return connection.vendor
