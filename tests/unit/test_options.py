"""The Coordinator's options, checked once when it is made (no database, nothing started):
every bad value is a one-line error naming the fix, never a silent default; concurrency has
an upper bound; what is not given comes from the DBWORKER settings."""

from __future__ import annotations

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings

from django_dbworker import Coordinator
from django_dbworker.registration.options import (
    MAX_CONCURRENCY,
    METRICS_HOST,
    WAIT_FOR_DATABASE_SECONDS,
    Options,
    seconds,
)
from django_dbworker.registration.registry import registry


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


def build(*names: str, **overrides) -> Options:
    return Options.build([registry[name] for name in names], overrides)


def test_what_is_not_given_comes_from_the_dbworker_settings():
    with override_settings(DBWORKER={"LEASE_SECONDS": 7, "POLL_SECONDS": 0.5,
                                     "MAX_POLL_SECONDS": 4, "PROBE_SECONDS": 0.1}):
        options = build("docs")
    assert (options.lease_seconds, options.poll_seconds, options.max_poll_seconds,
            options.probe_seconds) == (7.0, 0.5, 4.0, 0.1)
    assert options.wait_for_database == WAIT_FOR_DATABASE_SECONDS
    assert (options.shutdown_timeout, options.metrics_port, options.metrics_host) == (
        None, None, METRICS_HOST)
    assert options.schedules is True and options.database == "default"


def test_poll_seconds_may_equal_max_poll_seconds():
    options = build("docs", poll_seconds=1, max_poll_seconds=1)
    assert options.poll_seconds == options.max_poll_seconds == 1.0


def test_wait_for_database_and_shutdown_timeout_may_be_zero_but_a_lease_may_not():
    options = build("docs", wait_for_database=0, shutdown_timeout=0)
    assert (options.wait_for_database, options.shutdown_timeout) == (0.0, 0.0)
    with pytest.raises(ImproperlyConfigured, match="lease_seconds must be a number of seconds > 0"):
        build("docs", lease_seconds=0.0)


def test_seconds_are_floats_and_a_bool_is_no_number():
    assert seconds("x", 3) == 3.0 and isinstance(seconds("x", 3), float)
    with pytest.raises(ImproperlyConfigured, match=r"x must be a number of seconds >= 0, got False"):
        seconds("x", False, zero=True)


def test_each_worker_runs_with_its_own_concurrency_unless_told_otherwise():
    docs, tags = registry["docs"].concurrency, registry["tags"].concurrency
    assert build("docs", "tags").concurrency == {"docs": docs, "tags": tags}
    assert build("docs", "tags", concurrency=3).concurrency == {"docs": 3, "tags": 3}
    assert build("docs", "tags", concurrency={"tags": 5}).concurrency == {"docs": docs, "tags": 5}


def test_a_concurrency_for_an_unknown_worker_names_the_known_ones():
    with pytest.raises(KeyError, match="No worker named 'dcos'. Registered workers: .*docs"):
        build("docs", concurrency={"dcos": 2})


@pytest.mark.parametrize("port", [-1, 65536, True, "9100", 9100.0])
def test_a_metrics_port_must_be_a_tcp_port(port):
    with pytest.raises(ImproperlyConfigured, match=r"metrics_port must be a TCP port \(0-65535"):
        build("docs", metrics_port=port)


def test_metrics_port_zero_picks_a_free_one_and_any_port_up_to_65535_is_kept():
    assert build("docs", metrics_port=0).metrics_port == 0
    assert build("docs", metrics_port=65535).metrics_port == 65535


@pytest.mark.parametrize("host", ["", "   ", "127.0.0.1 ", "my host", 8080])
def test_a_metrics_host_must_be_one_address_or_name(host):
    with pytest.raises(ImproperlyConfigured, match="metrics_host must be an address or host name"):
        build("docs", metrics_host=host)


def test_the_metrics_listen_on_every_interface_unless_told_otherwise():
    assert METRICS_HOST == "0.0.0.0"
    assert build("docs", metrics_host="127.0.0.1").metrics_host == "127.0.0.1"
    assert build("docs", metrics_host="::1").metrics_host == "::1"


def test_schedules_may_be_turned_off_for_one_coordinator():
    assert build("docs", schedules=False).schedules is False
