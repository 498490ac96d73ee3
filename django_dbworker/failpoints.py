"""Crash on purpose at named points, for the crash-safety tests.

``DBWORKER_FAILPOINT=<name>:<marker path>`` makes the process that reaches ``<name>`` kill
itself with SIGKILL, once: the first to create the marker file dies, later ones carry on
(so a replaced child or a restarted coordinator does not crash again). Unset, as in
production, a failpoint is a dictionary lookup that finds nothing.
"""

from __future__ import annotations

import os
import signal

_SPEC = os.environ.get("DBWORKER_FAILPOINT", "")
_NAME, _, _MARKER = _SPEC.partition(":")


def reached(name: str) -> None:
    if not _SPEC or name != _NAME:
        return
    try:
        os.close(os.open(_MARKER, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    os.kill(os.getpid(), signal.SIGKILL)
