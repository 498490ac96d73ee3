"""Signals about executions, sent **in the child process** after the outcome committed.

Each is sent with ``sender`` the Worker object and the keyword arguments ``worker`` (its
name), ``execution_id``, ``source_id`` (the key as text) and ``attempt``. Connect receivers
in code that every child imports: an ``AppConfig.ready()`` or your ``workers.py``.
"""

from __future__ import annotations

from django.dispatch import Signal

execution_finished = Signal()  # the handler returned Finished(), or Unfinished()
execution_failed = Signal()  # it failed, with no retry left
execution_retried = Signal()  # it failed, and a retry is scheduled
