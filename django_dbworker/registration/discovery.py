"""Finding the workers: imports ``workers.py`` of every installed app (like admin.py),
or the modules listed in ``DBWORKER["WORKER_MODULES"]``."""

from __future__ import annotations

from importlib import import_module

from django.utils.module_loading import autodiscover_modules

from .. import conf


def discover_workers() -> None:
    """Import the modules that register workers: `workers.py` of every app by default."""
    modules = conf.value("WORKER_MODULES")
    if modules is None:
        autodiscover_modules("workers")
    elif isinstance(modules, list | tuple) and all(isinstance(m, str) for m in modules):
        for module in modules:
            import_module(module)
    # Anything else is reported by the system check django_dbworker.E006, which can
    # only run if start-up gets that far.
