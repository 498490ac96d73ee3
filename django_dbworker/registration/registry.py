"""Registration: ``@worker`` records which handler works on which model's rows."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django.core.exceptions import ImproperlyConfigured
from django.db import models

from ..store.retry import MAX_CRASHES, RetryPolicy
from .rates import Rate, is_rate, parse_rate

# Each unit of concurrency is a spawned interpreter with its own database connection
# (tens of megabytes): past this, run more coordinators instead.
MAX_CONCURRENCY = 128

if TYPE_CHECKING:
    from ..vendors import TriggerSource

NAME_RE = re.compile(r"[a-z][a-z0-9_]*\Z")
# Trigger and function names embed the worker name; 63 is PostgreSQL's identifier limit.
MAX_NAME_LENGTH = 40
SOURCE_KEY_LENGTH = 255  # Execution.source_id holds the key as text, up to this long
FLOW_KEY_LENGTH = 255  # Execution.flow_key: a flow-control key as text, up to this long


def _number(v: Any, *, minimum: float, strict: bool) -> bool:
    return (isinstance(v, int | float) and not isinstance(v, bool)
            and (v > minimum if strict else v >= minimum))


def _whole(v: Any) -> bool:
    return v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 1)


OPTIONS: dict[str, tuple[Callable[[Any], bool], str]] = {
    # name: (check, what a valid value is)
    "max_attempts": (_whole, "an int >= 1 (or None)"),
    "max_crashes": (lambda v: v is not None and _whole(v), "an int >= 1"),
    "retry_backoff": (lambda v: _number(v, minimum=0, strict=False), "a number of seconds >= 0"),
    "timeout": (lambda v: v is None or _number(v, minimum=0, strict=True),
                "a number of seconds > 0 (or None)"),
    "max_tasks_per_child": (_whole, "an int >= 1 (or None)"),
    "rerun_on": (lambda v: isinstance(v, list | tuple) and bool(v)
                 and all(isinstance(f, str) for f in v),
                 "a tuple of field names, e.g. ('file', 'language')"),
    "rerun_every": (lambda v: v is None or (isinstance(v, timedelta) and v.total_seconds() > 0),
                    "a positive datetime.timedelta, e.g. timedelta(days=1)"),
    # Flow control (docs/flow-control.md), decided in the claim across every host.
    "key": (lambda v: v is None or (isinstance(v, str) and bool(v)),
            "a field name of the source model, e.g. 'customer'"),
    "per_key": (_whole, "an int >= 1 (or None)"),
    "total": (_whole, "an int >= 1 (or None)"),
    "rate": (lambda v: v is None or is_rate(v),
             "a rate such as '100/m' (N per s, m or h, or per k seconds: '10/30s')"),
    "rate_per_key": (lambda v: isinstance(v, bool), "True or False"),
    "fair": (lambda v: isinstance(v, bool), "True or False"),
}


class UnknownWorker(KeyError):  # a LookupError, as KeyError is one
    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


@dataclass(eq=False)
class Worker:
    name: str
    source: type[models.Model]
    handler: Callable[[Any], Any]
    eligible: Callable[[], models.QuerySet[Any]] | None = None
    concurrency: int = 1
    max_attempts: int | None = None  # None: a failure is final until reset_failed()
    retry_backoff: float = 10.0  # seconds before the first retry; doubles per attempt
    max_crashes: int = MAX_CRASHES  # the row's process died this often in a row: FAILED
    timeout: float | None = None
    max_tasks_per_child: int | None = None
    rerun_on: tuple[str, ...] = ()  # field names: a change makes a done row pending again
    rerun_every: timedelta | None = None  # a finished row runs again this long after
    key: str | None = None  # field name: rows with the same value share per_key
    per_key: int | None = None  # at most this many rows of one key WORKING, every host
    total: int | None = None  # at most this many rows of the worker WORKING, every host
    rate: str | None = None  # at most this many claims in any window of the period ("100/m")
    rate_per_key: bool = False  # the rate holds for each key apart, not for the worker
    fair: bool = False  # claims take turns across keys (round-robin), not rows in id order
    options: dict[str, Any] = field(default_factory=dict)
    # Claims order by priority first (task queues); row workers claim in creation order.
    prioritized = False

    def __post_init__(self) -> None:
        self.rerun_on = tuple(self.rerun_on)

    def on_failure(self, alias: str, source_id: str, exc: BaseException, final: bool) -> None:
        """Called in the child, inside the transaction that records a failed attempt
        (task queues keep the error on their own row); ``final``: no retry follows."""

    # Whether on_interrupted() keeps a record of its own (task queues): the coordinator
    # then reads what it needs for it (when the attempt began, who held it).
    records_interruptions = False

    def on_interrupted(self, conn: Any, source_table: Any, source_id: str, attempt: int,
                       error: tuple[str, str], final: bool, began: Any, claimer: str | None,
                       now: Any) -> None:
        """Called in the coordinator, inside the transaction (a SQLAlchemy ``conn``) that
        records an attempt the coordinator ended: past its timeout, its child dead, its
        lease expired. ``error`` is (type, message); ``final``: no retry follows;
        ``began``: when it was claimed; ``claimer``: who held it; ``now``: the database's
        clock (an SQL expression)."""

    def after_interrupted(self, source_id: str, final: bool) -> None:
        """Called in the coordinator once such a record committed."""

    def before_attempts(self, alias: str, pending: Any) -> None:
        """Called in the child before it opens the transaction of the next rows it runs
        (the front of ``pending``, its deliveries), with no transaction open."""

    def before_outcomes(self, alias: str, sources: list[Any]) -> None:
        """Called in the child once its handlers returned, in their transaction, just
        before their outcomes are written, with the source rows they returned for (task
        queues write the rows' results here: one statement for a whole group)."""

    def trigger_source(self) -> TriggerSource:
        """What migrate's triggers need to know about this worker's source table."""
        from ..vendors import TriggerSource

        meta = self.source._meta
        return TriggerSource(
            base=self.name, table=self.table, pk_column=self.pk_column, pk_field=self.pk_field,
            worker=lambda row, constant: constant(self.name), key_column=self.key_column,
            rerun_on=tuple(str(meta.get_field(f).column)  # type: ignore[union-attr]
                           for f in self.rerun_on))

    @property
    def key_column(self) -> str | None:
        """The source column the flow-control key is read from (a foreign key's own)."""
        if self.key is None:
            return None
        return str(self.source._meta.get_field(self.key).column)  # type: ignore[union-attr]

    @property
    def rate_limit(self) -> Rate | None:
        return None if self.rate is None else parse_rate(self.rate)

    @property
    def limited(self) -> bool:
        """Whether claims must respect a limit shared by every host (per_key, total,
        rate), or take turns across keys (fair)."""
        return (self.per_key is not None or self.total is not None or self.rate is not None
                or self.fair)

    @property
    def retry_policy(self) -> RetryPolicy:
        return RetryPolicy(self.max_attempts, self.retry_backoff, self.max_crashes)

    @property
    def handler_path(self) -> str:
        return f"{self.handler.__module__}:{self.handler.__qualname__}"

    @property
    def table(self) -> str:
        return self.source._meta.db_table

    @property
    def pk_field(self) -> models.Field[Any, Any]:
        return self.source._meta.pk

    @property
    def pk_column(self) -> str:
        """The primary key's column name (a concrete field always has one)."""
        column = self.pk_field.column
        if column is None:  # only non-concrete fields lack a column; a pk never does
            raise ImproperlyConfigured(f"Worker {self.name!r}: {self.source.__name__} has no primary-key column")
        return column

    def eligible_queryset(self) -> models.QuerySet[Any]:
        """The eligibility QuerySet, evaluated anew (it is called before every claim)."""
        if self.eligible is None:
            return self.source._default_manager.all()
        qs = self.eligible()
        if not isinstance(qs, models.QuerySet):
            raise ImproperlyConfigured(
                f"Worker {self.name!r}: eligible() returned {type(qs).__name__}, not a QuerySet. "
                f"Return e.g. {self.source.__name__}.objects.filter(...)."
            )
        if qs.model._meta.concrete_model is not self.source._meta.concrete_model:
            raise ImproperlyConfigured(
                f"Worker {self.name!r}: eligible() returned a QuerySet of "
                f"{qs.model.__name__}, but the worker's source is {self.source.__name__}. "
                f"Return {self.source.__name__}.objects.filter(...)."
            )
        if qs.query.is_sliced:
            raise ImproperlyConfigured(
                f"Worker {self.name!r}: eligible() must not be sliced; the claim takes "
                "as many rows as there are free children."
            )
        return qs

    def __repr__(self) -> str:
        return f"<Worker {self.name} on {self.source._meta.label} -> {self.handler_path}>"


class Registry(Mapping[str, Worker]):
    """Registered workers by name. ``registry["ocr"]`` names the known workers when it fails."""

    def __init__(self) -> None:
        self._workers: dict[str, Worker] = {}

    def __getitem__(self, name: str) -> Worker:
        try:
            return self._workers[name]
        except (KeyError, TypeError):
            known = ", ".join(sorted(self._workers)) or "none"
            raise UnknownWorker(
                f"No worker named {name!r}. Registered workers: {known}. Workers register "
                "with @worker(name=...) in a workers.py module of an installed app."
            ) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._workers)

    def __len__(self) -> int:
        return len(self._workers)

    def register(self, w: Worker) -> Worker:
        existing = self._workers.get(w.name)
        if existing is not None:
            if existing.handler_path == w.handler_path:
                # The same module imported again (autoreload, a test re-import): not a clash.
                self._workers[w.name] = w
                return w
            raise ImproperlyConfigured(
                f"Two workers are named {w.name!r}: {existing.handler_path} and "
                f"{w.handler_path}. Give one of them another name=."
            )
        self._workers[w.name] = w
        return w

    def unregister(self, name: str) -> None:
        self._workers.pop(name, None)


registry = Registry()


def validate(
    *,
    name: Any,
    source: Any,
    handler: Any,
    eligible: Any,
    concurrency: Any,
    options: dict[str, Any],
) -> None:
    if not isinstance(name, str) or not NAME_RE.match(name) or len(name) > MAX_NAME_LENGTH:
        raise ImproperlyConfigured(
            f"Worker name {name!r} is invalid: use lowercase letters, digits and underscores, "
            f"starting with a letter, at most {MAX_NAME_LENGTH} characters (e.g. 'ocr')."
        )
    if not (isinstance(source, type) and issubclass(source, models.Model)):
        raise ImproperlyConfigured(
            f"Worker {name!r}: source must be a Django model class, got {source!r}."
        )
    if source._meta.abstract:
        raise ImproperlyConfigured(
            f"Worker {name!r}: source {source.__name__} is abstract; use a concrete model."
        )
    pk = source._meta.pk
    if pk is None or len(getattr(pk, "fields", ())) > 1 or type(pk).__name__ == "CompositePrimaryKey":
        raise ImproperlyConfigured(
            f"Worker {name!r}: source {source.__name__} must have exactly one primary-key "
            "column (int, big int, UUID or string), not a composite key."
        )
    if not callable(handler):
        raise ImproperlyConfigured(f"Worker {name!r}: the handler must be a function.")
    qualname = getattr(handler, "__qualname__", "")
    if "<locals>" in qualname or "<lambda>" in qualname or not qualname:
        raise ImproperlyConfigured(
            f"Worker {name!r}: handler {qualname or handler!r} is nested or a lambda; children "
            "import handlers by name, so define it at module level (e.g. in workers.py)."
        )
    if eligible is not None and not callable(eligible):
        raise ImproperlyConfigured(
            f"Worker {name!r}: eligible must be a callable returning a QuerySet "
            f"(e.g. lambda: {source.__name__}.objects.filter(...)), got {type(eligible).__name__}."
        )
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or not (
            1 <= concurrency <= MAX_CONCURRENCY):
        raise ImproperlyConfigured(
            f"Worker {name!r}: concurrency must be an int >= 1 (at most {MAX_CONCURRENCY}), "
            f"got {concurrency!r}."
        )
    _check_key(name, source)
    for key, val in options.items():
        if key not in OPTIONS:
            raise ImproperlyConfigured(
                f"Worker {name!r}: unknown option {key!r}. Known options: "
                f"{', '.join(sorted(OPTIONS))}."
            )
        check, wanted = OPTIONS[key]
        if not check(val):
            raise ImproperlyConfigured(
                f"Worker {name!r}: {key} must be {wanted}, got {val!r}."
            )
    for field_name in options.get("rerun_on") or ():
        _check_rerun_field(name, source, field_name)
    _check_flow(name, source, options)


def _check_flow(name: str, source: type[models.Model], options: dict[str, Any]) -> None:
    key, per_key = options.get("key"), options.get("per_key")
    per_key_rate = bool(options.get("rate_per_key"))
    if per_key_rate and options.get("rate") is None:
        raise ImproperlyConfigured(
            f"Worker {name!r}: rate_per_key=True needs rate=, the rate each key gets "
            "(e.g. rate='10/m').")
    fair = bool(options.get("fair"))
    if (per_key is not None or per_key_rate or fair) and key is None:
        what = (f"per_key={per_key}" if per_key is not None
                else "rate_per_key=True" if per_key_rate else "fair=True")
        raise ImproperlyConfigured(
            f"Worker {name!r}: {what} needs key=, the field whose value the "
            "limit counts by (e.g. key='customer').")
    if key is not None and per_key is None and not per_key_rate and not fair:
        raise ImproperlyConfigured(
            f"Worker {name!r}: key={key!r} is given without per_key=, rate_per_key= or "
            "fair=; give per_key=N (at most N rows of one key run at once).")
    if key is not None:
        _check_column(name, source, key, "key")


def _check_key(name: str, source: type[models.Model]) -> None:
    """The key must fit Execution.source_id as text: else the trigger would fail the
    user's own INSERT. Refused here, the same on every database."""
    from ..vendors.base import TEXT_KEY_TYPES

    pk = source._meta.pk
    if pk is None or pk.get_internal_type() not in TEXT_KEY_TYPES:
        return
    length = getattr(pk, "max_length", None)
    if length is None or length > SOURCE_KEY_LENGTH:
        raise ImproperlyConfigured(
            f"Worker {name!r}: the primary key of {source.__name__} ({pk.name}, "
            f"max_length={length}) can be longer than the {SOURCE_KEY_LENGTH} characters an "
            f"execution stores. Give it max_length <= {SOURCE_KEY_LENGTH}, or use an "
            "integer or UUID key.")


def _check_rerun_field(name: str, source: type[models.Model], field_name: str) -> None:
    _check_column(name, source, field_name, "rerun_on")


def _check_column(name: str, source: type[models.Model], field_name: str, option: str) -> None:
    from django.core.exceptions import FieldDoesNotExist

    try:
        f = source._meta.get_field(field_name)
    except FieldDoesNotExist:
        fields = ", ".join(f.name for f in source._meta.concrete_fields)
        raise ImproperlyConfigured(
            f"Worker {name!r}: {option} names {field_name!r}, which {source.__name__} does not "
            f"have. Its fields: {fields}.") from None
    if not getattr(f, "concrete", False) or getattr(f, "column", None) is None or getattr(
            f, "primary_key", False):
        raise ImproperlyConfigured(
            f"Worker {name!r}: {option} field {field_name!r} must be a concrete column of "
            f"{source.__name__} other than its primary key.")
    if option == "key":
        target: Any = getattr(f, "target_field", None) or f  # (a foreign key's column)
        length = getattr(target, "max_length", None)
        if target.get_internal_type() in ("TextField", "JSONField", "BinaryField") or (
                length is not None and length > FLOW_KEY_LENGTH):
            raise ImproperlyConfigured(
                f"Worker {name!r}: key field {field_name!r} can hold values longer than the "
                f"{FLOW_KEY_LENGTH} characters a key may have. Use a CharField with "
                f"max_length <= {FLOW_KEY_LENGTH}, an integer, a UUID or a foreign key.")


def worker(
    *,
    name: str,
    source: type[models.Model],
    eligible: Callable[[], models.QuerySet[Any]] | None = None,
    concurrency: int = 1,
    registry: Registry = registry,
    **options: Any,
) -> Callable[[Callable[[Any], Any]], Callable[[Any], Any]]:
    """Register the decorated function as the handler for rows of ``source``.

    Returns the function unchanged. Options: ``max_attempts`` (retry failures with
    exponential back-off), ``retry_backoff`` (first delay in seconds), ``max_crashes``
    (a row whose process dies this many times in a row ends FAILED; default 3), ``timeout``
    (seconds; the child is killed past it), ``max_tasks_per_child`` (recycle children).
    """
    # Check the arguments now, so a bad registration fails even before decoration.
    validate(name=name, source=source, handler=_placeholder, eligible=eligible,
             concurrency=concurrency, options=options)

    def decorate(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
        validate(name=name, source=source, handler=fn, eligible=eligible,
                 concurrency=concurrency, options=options)
        registry.register(
            Worker(name=name, source=source, handler=fn, eligible=eligible,
                   concurrency=concurrency, options=dict(options), **options)
        )
        return fn

    return decorate


def _placeholder(obj: Any) -> None:  # lets bad arguments fail before a function is given
    return None
