"""System checks for the DBWORKER settings (ids django_dbworker.E001 ...)."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.checks import Error, register

from .conf import DEFAULTS
from .processes import failpoints
from .vendors import for_engine

ID = "django_dbworker.{}"
NUMBER_KEYS = ("LEASE_SECONDS", "POLL_SECONDS", "MAX_POLL_SECONDS", "PROBE_SECONDS")


def _positive(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


@register()
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    user = getattr(settings, "DBWORKER", {})
    if not isinstance(user, dict):
        return [Error("DBWORKER must be a dict.", hint='e.g. DBWORKER = {"LEASE_SECONDS": 30}',
                      id=ID.format("E001"))]
    errors = []
    for key in sorted(set(user) - set(DEFAULTS)):
        errors.append(Error(f"DBWORKER has an unknown key {key!r}.",
                            hint=f"Known keys: {', '.join(DEFAULTS)}.", id=ID.format("E002")))
    cfg = {**DEFAULTS, **user}
    alias = cfg["DATABASE"]
    if alias not in settings.DATABASES:
        errors.append(Error(f"DBWORKER['DATABASE'] is {alias!r}, which is not in DATABASES.",
                            hint=f"Use one of: {', '.join(settings.DATABASES)}.",
                            id=ID.format("E003")))
    for key in NUMBER_KEYS:
        if not _positive(cfg[key]):
            errors.append(Error(f"DBWORKER[{key!r}] must be a number of seconds > 0, "
                                f"got {cfg[key]!r}.",
                                hint=f"e.g. {key}: {DEFAULTS[key]}", id=ID.format("E004")))
    if all(_positive(cfg[k]) for k in NUMBER_KEYS) and cfg["POLL_SECONDS"] > cfg["MAX_POLL_SECONDS"]:
        errors.append(Error("DBWORKER['POLL_SECONDS'] is larger than MAX_POLL_SECONDS.",
                            hint="Make MAX_POLL_SECONDS >= POLL_SECONDS.", id=ID.format("E005")))
    modules = cfg["WORKER_MODULES"]
    if modules is not None and (
        isinstance(modules, str) or not all(isinstance(m, str) for m in modules)
    ):
        errors.append(Error("DBWORKER['WORKER_MODULES'] must be a list of module paths or None.",
                            hint='e.g. ["documents.workers"]; None autodiscovers workers.py.',
                            id=ID.format("E006")))
    if not isinstance(cfg["ENGINE_OPTIONS"], dict):
        errors.append(Error("DBWORKER['ENGINE_OPTIONS'] must be a dict of SQLAlchemy "
                            "create_engine() options.", hint='e.g. {"pool_size": 5}',
                            id=ID.format("E007")))
    else:
        errors.extend(_check_pool(cfg["ENGINE_OPTIONS"]))
    if alias in settings.DATABASES:
        errors.extend(_check_database(alias, settings.DATABASES[alias]))
    try:
        failpoints.parse(cfg["FAILPOINT"])
    except ValueError as exc:
        errors.append(Error(str(exc), hint="Remove DBWORKER['FAILPOINT']: it exists for the "
                            "crash tests.", id=ID.format("E011")))
    errors.extend(_check_schedules(cfg["SCHEDULES"]))
    listen = cfg["LISTEN_DATABASE"]
    if listen is not None and listen not in settings.DATABASES:
        errors.append(Error(f"DBWORKER['LISTEN_DATABASE'] is {listen!r}, which is not in "
                            "DATABASES.", hint="Name an alias that connects directly to the "
                            "same PostgreSQL (not through PgBouncer), or remove the key.",
                            id=ID.format("E013")))
    identity = cfg["IDENTITY"]
    if identity is not None and (not isinstance(identity, str) or not identity.strip()):
        errors.append(Error(f"DBWORKER['IDENTITY'] must be a non-empty string or None, got "
                            f"{identity!r}.", hint="e.g. the pod name: os.environ['HOSTNAME'], "
                            "or None for the host name.", id=ID.format("E012")))
    if not settings.USE_TZ:
        errors.append(Error("django-dbworker needs USE_TZ = True: leases are compared in UTC "
                            "on the database clock.", hint="Set USE_TZ = True in settings.",
                            id=ID.format("E010")))
    return errors


# A coordinator keeps one connection for LISTEN (or MariaDB's change wait), one for the
# change probe where there is no NOTIFY, and its loop uses a third: with fewer, one of them
# waits for the pool's timeout (30 s) and then fails.
CONNECTIONS_NEEDED = 3


def _check_pool(options: dict[str, Any]) -> list[Error]:
    from .store.engine import POOL_DEFAULTS

    if "poolclass" in options:
        return []  # NullPool and friends: no fixed size
    size, overflow = (options.get(k, POOL_DEFAULTS[k]) for k in ("pool_size", "max_overflow"))
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in (size, overflow)):
        return []  # SQLAlchemy reports a wrong type itself
    if overflow < 0 or size + overflow >= CONNECTIONS_NEEDED:
        return []  # (a negative max_overflow: no limit)
    return [Error(f"DBWORKER['ENGINE_OPTIONS'] lets the coordinator's pool open "
                  f"{size + overflow} connection(s) (pool_size + max_overflow); it needs "
                  f"{CONNECTIONS_NEEDED} at once.",
                  hint=f"Make pool_size + max_overflow at least {CONNECTIONS_NEEDED}, or leave "
                  f"them out (default {POOL_DEFAULTS['pool_size']} + "
                  f"{POOL_DEFAULTS['max_overflow']}).", id=ID.format("E014"))]


def _check_database(alias: str, db: dict[str, Any]) -> list[Error]:
    engine = db.get("ENGINE", "")
    vendor = for_engine(engine)
    if vendor is None:
        return [Error(f"DATABASES[{alias!r}] uses {engine!r}, which django-dbworker does not "
                      "support.", hint="Use PostgreSQL 13+, MySQL 8.0.1+, MariaDB 10.6+ or a "
                      "file-backed SQLite.", id=ID.format("E008"))]
    problem = vendor.settings_problem(alias, db)
    if problem is not None:
        return [Error(problem[0], hint=problem[1], id=ID.format("E009"))]
    return []


def _check_schedules(declared: Any) -> list[Error]:
    from . import schedules

    if not isinstance(declared, dict):
        return [Error("DBWORKER['SCHEDULES'] must be a dict of name -> schedule.",
                      hint='e.g. {"nightly": {"task": "app.tasks.cleanup", "cron": "0 3 * * *"}}',
                      id=ID.format("E030"))]
    errors = []
    for name, spec in declared.items():
        if not isinstance(spec, dict) or not spec.get("task"):
            errors.append(Error(f"DBWORKER['SCHEDULES'][{name!r}] must be a dict with a 'task' "
                                "path.", hint='e.g. {"task": "app.tasks.cleanup", "cron": "0 3 * * *"}',
                                id=ID.format("E030")))
            continue
        unknown = set(spec) - {"task", "cron", "every", "args", "kwargs", "catch_up"}
        if unknown:
            errors.append(Error(f"DBWORKER['SCHEDULES'][{name!r}] has unknown key(s) "
                                f"{', '.join(sorted(unknown))}.", hint="Known: task, cron, every, "
                                "args, kwargs, catch_up.", id=ID.format("E030")))
    if errors:
        return errors
    for schedule in schedules.schedules().values():
        problem = schedules.validate(schedule, check_task=True)
        if problem:
            errors.append(Error(problem, hint="See docs/schedules.md.", id=ID.format("E031")))
    return errors


@register()
def check_task_backends_without_the_backport_app(app_configs: Any = None,
                                                 **kwargs: Any) -> list[Any]:
    """On Django 5.2 the django-tasks backport checks task backends only when
    ``"django_tasks"`` is in INSTALLED_APPS. Without it, this app's backends are checked
    here (E020-E023: a hostile queue name is refused either way). Django 6 checks them
    itself."""
    from importlib.util import find_spec

    from django.apps import apps

    from .tasks.queues import backends

    if find_spec("django.tasks") is not None or apps.is_installed("django_tasks"):
        return []
    aliases = [alias for alias, _ in backends()]
    if not aliases:
        return []
    from .tasks.compat import task_backends

    return [message for alias in aliases for message in task_backends[alias].check()]
