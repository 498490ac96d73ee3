"""The options a Coordinator runs with: the DBWORKER settings, overridden per process.

Every value is checked here, once, with a one-line error naming the fix: a zero lease
is an error, not a silent default, and a concurrency of 2.5 says what a concurrency is.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from django.core.exceptions import ImproperlyConfigured

from .. import conf
from .registry import MAX_CONCURRENCY, registry

# How long set-up waits for a database that does not answer yet (orchestrators start
# databases and workers in any order).
WAIT_FOR_DATABASE_SECONDS = 60.0
SECONDS = {
    # option: (settings key or None, default when there is no settings key, may be zero)
    "lease_seconds": ("LEASE_SECONDS", None, False),
    "poll_seconds": ("POLL_SECONDS", None, False),
    "max_poll_seconds": ("MAX_POLL_SECONDS", None, False),
    "probe_seconds": ("PROBE_SECONDS", None, False),
    "status_interval": (None, 60.0, False),
    "wait_for_database": (None, WAIT_FOR_DATABASE_SECONDS, True),
}
# Where /metrics, /healthz and /readyz listen: every interface, because Prometheus and
# Kubernetes' probes connect from outside the process's host or pod. They only read (counts
# and liveness: no row data, no action); where nothing outside needs them, bind 127.0.0.1.
METRICS_HOST = "0.0.0.0"
KNOWN = {"database", "concurrency", "shutdown_timeout", "schedules", "metrics_port",
         "metrics_host", *SECONDS}


def seconds(name: str, value: Any, *, zero: bool = False) -> float:
    """``value`` as a number of seconds, or an error naming ``name`` and what it must be."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0 or (
            value == 0 and not zero):
        wanted = ">= 0" if zero else "> 0"
        raise ImproperlyConfigured(f"{name} must be a number of seconds {wanted}, got {value!r}.")
    return float(value)


def concurrency_value(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_CONCURRENCY:
        raise ImproperlyConfigured(
            f"Concurrency for {name!r} must be an int >= 1 and at most {MAX_CONCURRENCY}, got "
            f"{value!r} (each unit is a child process; run more coordinators for more).")
    return value


@dataclass
class Options:
    database: str
    lease_seconds: float
    poll_seconds: float
    max_poll_seconds: float
    probe_seconds: float
    status_interval: float
    wait_for_database: float
    shutdown_timeout: float | None = None
    concurrency: dict[str, int] = field(default_factory=dict)
    schedules: bool = True  # enqueue the slots of schedules (runworkers --no-schedules)
    metrics_port: int | None = None  # serve /metrics, /healthz, /readyz there
    metrics_host: str = METRICS_HOST  # on this address

    @classmethod
    def build(cls, workers: Iterable[Any], overrides: Mapping[str, Any]) -> Options:
        """``workers``: the Worker objects the coordinator runs (their own concurrency is
        the default, ``concurrency`` an int for all or ``{name: int}``)."""
        unknown = set(overrides) - KNOWN
        if unknown:
            raise TypeError(f"Unknown Coordinator option(s): {', '.join(sorted(unknown))}. "
                            f"Known: {', '.join(sorted(KNOWN))}.")
        values: dict[str, Any] = {}
        for name, (key, default, zero) in SECONDS.items():
            value = overrides.get(name)
            if value is None:
                value = conf.value(key) if key else default
            values[name] = seconds(name, value, zero=zero)
        if values["poll_seconds"] > values["max_poll_seconds"]:
            raise ImproperlyConfigured(
                f"poll_seconds ({values['poll_seconds']}) must not exceed max_poll_seconds "
                f"({values['max_poll_seconds']}).")
        timeout = overrides.get("shutdown_timeout")
        workers = list(workers)
        return cls(
            database=overrides.get("database") or conf.value("DATABASE"),
            shutdown_timeout=None if timeout is None else seconds("shutdown_timeout", timeout,
                                                                  zero=True),
            concurrency=_concurrency(workers, overrides.get("concurrency")),
            schedules=bool(overrides.get("schedules", True)),
            metrics_port=_port(overrides.get("metrics_port")),
            metrics_host=_host(overrides.get("metrics_host")),
            **values,
        )


def _concurrency(workers: list[Any], given: Any) -> dict[str, int]:
    if given is None:
        given = {}
    elif not isinstance(given, Mapping):
        # One number for every worker: checked as such (2.5 and "3" are not numbers of
        # children, and must not be mistaken for worker names).
        given = {w.name: concurrency_value(w.name, given) for w in workers}
    for name in given:
        registry[name]  # an unknown name fails here, naming the known ones
    return {w.name: concurrency_value(w.name, given.get(w.name, w.concurrency))
            for w in workers}


def _port(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
        raise ImproperlyConfigured(f"metrics_port must be a TCP port (0-65535; 0 picks a free "
                                   f"one), got {value!r}.")
    return value


def _host(value: Any) -> str:
    if value is None:
        return METRICS_HOST
    if not isinstance(value, str) or not value.strip() or any(c.isspace() for c in value):
        raise ImproperlyConfigured(f"metrics_host must be an address or host name to listen on "
                                   f"(0.0.0.0 for every interface, 127.0.0.1 for this machine "
                                   f"only), got {value!r}.")
    return value
