from __future__ import annotations

from importlib import import_module

from django.utils.module_loading import autodiscover_modules

from . import conf


def discover_workers() -> None:
    """Import the modules that register workers: `workers.py` of every app by default."""
    modules = conf.value("WORKER_MODULES")
    if modules is None:
        autodiscover_modules("workers")
    else:
        for module in modules:
            import_module(module)
