"""Your Django rows are already the queue.

Register a handler for a model with :func:`worker`; ``manage.py runworkers`` claims every
eligible row exactly once and runs the handler in a spawned child process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .exceptions import LostClaim
from .outcomes import Finished, Outcome, Unfinished
from .registration.registry import registry, worker
from .status import ExecutionStatus

if TYPE_CHECKING:
    from .api import (
        annotate_execution_status,
        execution_status,
        has_execution_status,
        reset_failed,
        state,
    )
    from .coordinator.loop import Coordinator

__all__ = [
    "Coordinator",
    "ExecutionStatus",
    "Finished",
    "LostClaim",
    "Outcome",
    "Unfinished",
    "annotate_execution_status",
    "execution_status",
    "has_execution_status",
    "registry",
    "reset_failed",
    "state",
    "worker",
]

# These touch models (or SQLAlchemy), so they load on first use: importing
# django_dbworker from a workers.py or settings must not need the app registry.
_LAZY = {
    "annotate_execution_status": "api",
    "execution_status": "api",
    "has_execution_status": "api",
    "reset_failed": "api",
    "state": "api",
    "Coordinator": "coordinator.loop",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from importlib import import_module

        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
