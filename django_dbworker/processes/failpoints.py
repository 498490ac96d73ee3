"""Crash on purpose at named points: for crash-safety tests, never armed in production.

Only the ``DBWORKER["FAILPOINT"]`` setting arms one: ``"<point>:<marker path>"`` makes the
process that reaches ``<point>`` kill itself with SIGKILL, once (the first process to
create the marker file dies, later ones carry on, so a replaced child or a restarted
coordinator does not crash again); ``"<point>:<marker path>:stop"`` makes it stop itself
(SIGSTOP) there instead, frozen as a debugger or a suspended machine would leave it.
Nothing else arms it (no environment variable): a settings module must say so, which
production settings never do. A malformed value is reported by system check
``django_dbworker.E011``. Unarmed, ``reached()`` is one comparison.
"""

from __future__ import annotations

import os
import signal
from typing import Any

POINTS = (
    "child.before_begin", "child.before_commit", "child.after_commit",
    "coordinator.after_claim", "coordinator.before_renew", "coordinator.after_renew",
    "coordinator.stopping", "coordinator.claim_locked", "scheduler.slot_inserted",
)
ACTIONS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}
_UNREAD: Any = object()
_armed: Any = _UNREAD  # (point, marker path), None when unarmed


def parse(spec: Any) -> tuple[str, str, signal.Signals] | None:
    """The (point, marker, signal) of a FAILPOINT setting; ValueError naming the fix if
    malformed."""
    if spec is None:
        return None
    parts = spec.split(":") if isinstance(spec, str) else []
    if len(parts) == 2:
        parts.append("kill")
    if len(parts) != 3 or parts[0] not in POINTS or not parts[1] or parts[2] not in ACTIONS:
        raise ValueError(f"DBWORKER['FAILPOINT'] is {spec!r}: use '<point>:<marker file>' or "
                         f"'<point>:<marker file>:stop' with a point among {', '.join(POINTS)} "
                         "(tests only; leave it unset).")
    return parts[0], parts[1], ACTIONS[parts[2]]


def reached(name: str) -> None:
    global _armed
    if _armed is _UNREAD:
        from .. import conf

        try:
            _armed = parse(conf.value("FAILPOINT"))
        except ValueError:
            _armed = None  # reported by the system check; never crash on a typo
    if _armed is None or name != _armed[0]:
        return
    try:
        os.close(os.open(_armed[1], os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    os.kill(os.getpid(), _armed[2])
