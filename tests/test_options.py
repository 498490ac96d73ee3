"""runworkers arguments: every bad value is a one-line error naming the fix. (The
Coordinator's options themselves, checked without a database: tests/unit/test_options.py.)"""

import pytest

from tests.helpers import runworkers

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.parametrize("args,message", [
    (["--concurrency", "docs=1000"], "Concurrency for 'docs' must be an int >= 1 and at most 128"),
    (["--status-interval", "0"], "status_interval must be a number of seconds > 0"),
    (["--shutdown-timeout", "-3"], "shutdown_timeout must be a number of seconds >= 0"),
])
def test_bad_values_on_the_command_line_are_one_line(args, message):
    proc = runworkers("--drain", "--worker", "docs", *args)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err
    [line] = err.strip().splitlines()
    assert line.startswith("CommandError: ") and message in line
