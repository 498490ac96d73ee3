"""The child process: set up once (a fresh interpreter, ``spawn``; Django set up once),
then reused for many rows: it receives deliveries from the coordinator, runs them
(groups.py) and reports each one's result.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import traceback
from collections import deque
from importlib import import_module
from multiprocessing.connection import Connection
from typing import Any

from . import failpoints
from .attempts import Attempt, current_attempt
from .groups import GROUP_ROWS, GROUP_SECONDS, run, run_group
from .protocol import (
    READY,
    RESULTS,
    SETUP_FAILED,
    SLOT_REVOKE,
    SLOT_SIZE,
    Delivery,
    Timing,
)

__all__ = ["GROUP_ROWS", "GROUP_SECONDS", "SLOT_REVOKE", "SLOT_SIZE", "Attempt", "child_main",
           "current_attempt", "run", "run_group"]

logger = logging.getLogger("django_dbworker.child")


def child_main(conn: Connection, worker_name: str, handler_path: str,
               databases: dict[str, str], alias: str, slot: Any, stop: Any,
               log_level: int = logging.INFO) -> None:
    # Ctrl-C in a terminal signals the whole process group; the coordinator alone
    # decides when children stop (and kills them outright when it must).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        worker = _set_up(worker_name, handler_path, databases)
        _log_like_the_coordinator(log_level)
    except BaseException:
        _send(conn, (SETUP_FAILED, traceback.format_exc()))
        return
    if not _send(conn, (READY, os.getpid())):
        return
    pending: deque[Delivery] = deque()
    while True:
        try:
            if not pending:
                message = conn.recv()
                if message is None:
                    return
                pending.extend(message)
            while conn.poll():  # rows sent while the last group ran
                message = conn.recv()
                if message is None:
                    return
                pending.extend(message)
        except (EOFError, OSError):
            _parent_gone(worker_name)
            return
        started = time.monotonic()
        timings: dict[int, Timing] = {}
        results = run_group(worker, alias, pending, slot, stop, timings)
        failpoints.reached("child.after_commit")
        if not _send(conn, (RESULTS, results, time.monotonic() - started, timings)):
            return


def _send(conn: Connection, message: Any) -> bool:
    """Send to the coordinator; False (after one line on stderr) when it is gone."""
    try:
        conn.send(message)
        return True
    except (OSError, EOFError):  # BrokenPipeError among them
        _parent_gone(str(message[0]))
        return False


def _parent_gone(what: str) -> None:
    # Its coordinator was killed: what this child committed stays committed, the rows it
    # held come back to others when their leases end. Nothing to report to anyone else.
    print(f"django-dbworker child {os.getpid()}: its coordinator is gone; exiting",
          file=sys.stderr, flush=True)


def _log_like_the_coordinator(level: int) -> None:
    """Children log failures themselves (they have the exception, for Sentry & co). With
    no LOGGING of yours for these loggers, they go where the coordinator's go: stderr."""
    dbworker = logging.getLogger("django_dbworker")
    if not dbworker.level:
        dbworker.setLevel(level)
    if not dbworker.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        dbworker.addHandler(handler)


def _set_up(worker_name: str, handler_path: str, databases: dict[str, str]) -> Any:
    from django.conf import settings

    from ..vendors import prepare_child_settings

    # Use the very databases the coordinator uses (under a test runner they are the test
    # databases, whose names the settings module does not know).
    for db_alias, name in databases.items():
        settings.DATABASES[db_alias]["NAME"] = name
        prepare_child_settings(settings.DATABASES[db_alias])

    import django

    django.setup()
    module_name, _, _ = handler_path.partition(":")
    import_module(module_name)  # registers the worker if no workers.py did
    from ..registration.registry import registry

    # The store, imported and its table built here, not by the first row's commit.
    from ..store.tables import execution_table

    execution_table()
    worker = registry[worker_name]
    if worker.handler_path != handler_path:
        raise RuntimeError(
            f"Worker {worker_name!r} is {worker.handler_path} in the child but "
            f"{handler_path} in the coordinator"
        )
    return worker


