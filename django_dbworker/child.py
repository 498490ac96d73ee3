"""The documented path of ``current_attempt()``: the child lives in
``django_dbworker.processes.child``."""

from .processes.child import Attempt, current_attempt

__all__ = ["Attempt", "current_attempt"]
