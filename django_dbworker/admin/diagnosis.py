"""Why is this row not running? Each part that decides it, with whether it blocks now.

Asks the same questions a claim asks, one at a time and in words: is there an execution,
what status, a live lease held by whom, a due time still ahead, a paused worker, the
``eligible`` filter (and each of its conditions, ``has_execution_status`` dependencies
among them), and whether any live coordinator runs the worker.

Most findings are about the source row (whether it exists, which conditions it meets), so
the admin's page shows them only to users who may view the source model (admin.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.core.exceptions import ValidationError
from django.db import connections
from django.db.models import Exists, Min, Sum
from django.db.models.sql.where import WhereNode

from .. import conf
from ..models import CoordinatorHeartbeat, Execution, WorkerPause
from ..registration.registry import Worker, registry
from ..status import ExecutionStatus
from ..store import clock


@dataclass(frozen=True)
class Finding:
    what: str
    blocking: bool
    detail: str


class InvalidKey(ValueError):
    """A key (from a URL) that no row of the worker's source model can have."""


def parse_key(w: Worker, text: str) -> Any:
    """``text`` as a primary key of ``w``'s source model, ready for ``diagnose()``; raises
    InvalidKey when it cannot be one (not a number for an integer key, not a UUID),
    rather than let the query fail."""
    from ..api import source_key

    try:
        pk = w.pk_field.to_python(text)
        source_key(w, pk)  # the database's own preparation of the key
    except (ValidationError, ValueError, TypeError, OverflowError):
        raise InvalidKey(f"{text!r} is not a key of {w.source._meta.verbose_name}.") from None
    return pk


def diagnose(worker: str, source: Any) -> list[Finding]:
    from ..api import source_key

    w = registry[worker]
    database = conf.value("DATABASE")
    key = source_key(w, source)
    pk = w.pk_field.to_python(getattr(source, "pk", source))
    now = clock.now(database)
    findings: list[Finding] = []
    execution = Execution.objects.using(database).filter(worker=w.name, source_id=key).first()
    if execution is None:
        exists = w.source._default_manager.using(database).filter(pk=pk).exists()
        return [Finding("execution", True,
                        "No execution for this row: its worker was registered after the last "
                        "migrate (run migrate)" if exists else "The source row does not exist.")]
    findings.append(_status(execution, now))
    if execution.next_attempt_at is not None and execution.next_attempt_at > now:
        due = f"{execution.next_attempt_at:%Y-%m-%d %H:%M:%S}"
        findings.append(Finding("due time", True,
                                f"Waits until {due} UTC ({_why_waiting(execution)})."))
    pause = WorkerPause.objects.using(database).filter(worker=w.name).first()
    if pause is not None:
        findings.append(Finding("paused", True, f"Worker {w.name} was paused "
                                f"{_by(pause.paused_by)} at {pause.paused_at:%Y-%m-%d %H:%M} UTC"
                                f"{': ' + pause.reason if pause.reason else ''}."))
    findings.extend(_eligibility(w, database, pk))
    findings.extend(_limits(w, database, pk, execution))
    if w.rate is not None:
        findings.append(_rate(w, database, now, execution, pk))
    findings.append(_coordinators(w, database, now))
    return findings


def _by(who: str) -> str:
    return f"by {who}" if who else "by someone"


def _limits(w: Worker, database: str, pk: Any, execution: Execution) -> list[Finding]:
    """The worker's limits (per_key, total) as the next claim would count them: the
    rows WORKING now, of the row's key and of the worker."""
    findings = []
    running = Execution.objects.using(database).filter(worker=w.name, status="working")
    claimable = execution.status in ("pending", "unfinished")
    if w.per_key is not None and w.key is not None:
        value = (w.source._default_manager.using(database).filter(pk=pk)
                 .values_list(w.key, flat=True).first())
        if value is None:
            findings.append(Finding("per-key limit", False,
                                    f"Its {w.key} is empty: no per-key limit applies."))
        else:
            # The key's text as the claim writes it: the database's own (vendor.text_key_sql),
            # not Python's (True, Decimal and dates read differently there).
            text = _key_text(w, database, pk)
            n = running.filter(flow_key=text).count()
            findings.append(Finding("per-key limit", claimable and n >= w.per_key,
                                    f"{w.key} {value}: {n} of {w.per_key} running."))
    if w.total is not None:
        n = running.count()
        findings.append(Finding("total limit", claimable and n >= w.total,
                                f"Worker {w.name}: {n} of {w.total} running."))
    return findings


def _rate(w: Worker, database: str, now: Any, execution: Execution, pk: Any) -> Finding:
    """The worker's rate (or its key's) as the next claim would count it: the rows
    claimed in the last period (the rate log), and when the oldest of them leaves the
    window."""
    from datetime import timedelta

    from ..models import RateLog

    rate = w.rate_limit
    assert rate is not None
    window = RateLog.objects.using(database).filter(
        worker=w.name, at__gt=now - timedelta(seconds=rate.seconds))
    detail = f"rate {rate}"
    if w.rate_per_key:
        text = _key_text(w, database, pk)
        if text is None:
            return Finding("rate", False, f"Its {w.key} is empty: no rate per key applies.")
        window = window.filter(key=text)
        detail += f" per {w.key}, {w.key} {text}"
    # (Summed by the database: a period of a busy rate holds many entries.)
    found = window.aggregate(used=Sum("claimed"), oldest=Min("at"))
    used, oldest = found["used"] or 0, found["oldest"]
    detail += f": {used} claimed in the last {rate.seconds:g} s"
    held = execution.status in ("pending", "unfinished") and used >= rate.limit
    if held:
        wait = (oldest + timedelta(seconds=rate.seconds) - now).total_seconds()
        detail += f"; the next row may be claimed in {max(wait, 0.0):.1f} s"
    return Finding("rate", held, detail + ".")


def _key_text(w: Worker, database: str, pk: Any) -> str | None:
    from django.db.models.expressions import RawSQL

    from ..vendors import for_connection

    vendor = for_connection(connections[database])
    column = f"{vendor.qn(w.table)}.{vendor.qn(w.key_column or '')}"
    return (w.source._default_manager.using(database).filter(pk=pk)
            .annotate(dbw_key=RawSQL(vendor.text_key_sql(column), []))
            .values_list("dbw_key", flat=True).first())


def _status(e: Execution, now: Any) -> Finding:
    status = e.status
    if status == ExecutionStatus.FINISHED:
        return Finding("status", True, "Finished: it never runs again"
                       + (" until it is stale" if e.next_attempt_at else "")
                       + " (run it again from the admin).")
    if status == ExecutionStatus.FAILED:
        return Finding("status", True, f"Failed ({e.error_type}): reset it to run it again.")
    if status == ExecutionStatus.WORKING:
        live = e.lease_expires_at is not None and e.lease_expires_at > now
        return Finding("status", live, f"Working: claimed by {e.claimed_by}, lease "
                       + (f"until {e.lease_expires_at:%H:%M:%S} UTC (renewed while it runs)." if live
                          else "expired: the next coordinator recovers it."))
    if status not in ExecutionStatus:
        return Finding("status", True, f"Status {status!r} is none this version knows (written "
                       "by hand, or by a newer version): no claim takes it.")
    return Finding("status", False, f"{status.title()}: claimable"
                   + (f" (attempt {e.attempts + 1})" if e.attempts else "") + ".")


def _why_waiting(e: Execution) -> str:
    if e.status == ExecutionStatus.FINISHED:
        return "rerun_every"
    if e.error_type:
        return f"a retry after {e.error_type}"
    return "run_after"


def _eligibility(w: Worker, database: str, pk: Any) -> list[Finding]:
    if w.eligible is None:
        return [Finding("eligible", False, "The worker has no eligible filter: every row is.")]
    qs = w.eligible_queryset().using(database)
    if qs.filter(pk=pk).exists():
        return [Finding("eligible", False, "The row is in the worker's eligible() QuerySet.")]
    findings = [Finding("eligible", True, "The row is not in the worker's eligible() QuerySet.")]
    where = qs.query.where
    if where.connector == "AND" and not where.negated:
        for child in where.children:  # which of the conditions it fails
            part = qs.all()
            part.query.where = WhereNode([child])
            if not part.filter(pk=pk).exists():
                findings.append(Finding("condition", True,
                                        f"It fails: {_describe(child, qs, database)}"))
    return findings


def _describe(condition: Any, qs: Any, database: str) -> str:
    """A condition in words: a has_execution_status dependency by its worker, anything
    else as the SQL Django compiles it to."""
    from django.db import connections

    inner = getattr(condition, "lhs", None) if getattr(condition, "rhs", None) is True else None
    exists = inner if isinstance(inner, Exists) else condition
    if isinstance(exists, Exists) and exists.query.model is Execution:
        lookups: dict[str, Any] = {}
        for c in exists.query.where.children:
            target = getattr(getattr(c, "lhs", None), "target", None)
            if target is not None:
                lookups[target.name] = getattr(c, "rhs", None)
        worker, statuses = lookups.get("worker"), lookups.get("status")
        return (f"has_execution_status({worker!r}, {statuses!r}): it waits for worker "
                f"{worker} to reach {', '.join(map(str, statuses or []))}.")
    try:
        compiler = qs.query.get_compiler(using=database)
        sql, params = condition.as_sql(compiler, connections[database])
        return sql % tuple(repr(p) for p in params)
    except Exception:  # noqa: BLE001 - a description only
        return str(condition)[:300]


def _coordinators(w: Worker, database: str, now: Any) -> Finding:
    live = now - timedelta(seconds=float(conf.value("LEASE_SECONDS")))
    serving = [c for c in CoordinatorHeartbeat.objects.using(database).filter(heartbeat_at__gte=live)
               if w.name in c.workers.split(",")]
    if not serving:
        return Finding("coordinators", True, f"No live coordinator runs worker {w.name}: start "
                       f"`manage.py runworkers` (with --worker {w.name}, or without --worker).")
    return Finding("coordinators", False, f"{len(serving)} live coordinator(s) run it: "
                   + ", ".join(f"{c.host}:{c.pid}" for c in serving[:5]) + ".")
