"""Coordinator options and runworkers arguments: every bad value is a one-line error
naming the fix, never a silent default; concurrency has an upper bound."""

import pytest
from django.core.exceptions import ImproperlyConfigured

from django_dbworker import Coordinator
from django_dbworker.options import MAX_CONCURRENCY
from tests.helpers import runworkers

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.parametrize("option,value,message", [
    ("lease_seconds", 0, "lease_seconds must be a number of seconds > 0, got 0"),
    ("lease_seconds", -5, "lease_seconds must be a number of seconds > 0, got -5"),
    ("poll_seconds", "1", "poll_seconds must be a number of seconds > 0, got '1'"),
    ("max_poll_seconds", True, "max_poll_seconds must be a number of seconds > 0, got True"),
    ("status_interval", 0, "status_interval must be a number of seconds > 0, got 0"),
    ("shutdown_timeout", -1, "shutdown_timeout must be a number of seconds >= 0, got -1"),
    ("wait_for_database", -1, "wait_for_database must be a number of seconds >= 0, got -1"),
    ("concurrency", 2.5, "Concurrency for 'docs' must be an int >= 1 and at most 128, got 2.5"),
    ("concurrency", "3", "Concurrency for 'docs' must be an int >= 1 and at most 128, got '3'"),
    ("concurrency", 10**9, "got 1000000000 (each unit is a child process"),
    ("concurrency", {"docs": 0}, "Concurrency for 'docs' must be an int >= 1"),
])
def test_a_bad_option_is_an_error_naming_the_option(option, value, message):
    with pytest.raises(ImproperlyConfigured) as info:
        Coordinator(["docs"], **{option: value})
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_poll_seconds_may_not_exceed_max_poll_seconds():
    with pytest.raises(ImproperlyConfigured, match="must not exceed max_poll_seconds"):
        Coordinator(["docs"], poll_seconds=2, max_poll_seconds=1)


def test_given_values_are_kept_not_replaced_by_defaults():
    c = Coordinator(["docs"], lease_seconds=0.5, status_interval=0.2, shutdown_timeout=0,
                    concurrency=MAX_CONCURRENCY)
    assert (c.settings.lease_seconds, c.settings.status_interval, c.settings.shutdown_timeout) == (
        0.5, 0.2, 0.0)
    assert c.settings.concurrency == {"docs": MAX_CONCURRENCY}


def test_an_unknown_option_names_the_known_ones():
    with pytest.raises(TypeError, match="Unknown Coordinator option.*lease.*Known: .*lease_seconds"):
        Coordinator(["docs"], lease=3)


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
