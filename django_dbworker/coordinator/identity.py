"""Who a coordinator is: its host name, and the namespace in which its pid means something.

Claims and heartbeats carry ``host:pid``. The host is ``DBWORKER["IDENTITY"]`` when set
(a pod or container name), else the machine's host name. A pid is only meaningful inside
one PID namespace of one boot of one machine, so heartbeats also record that namespace
(Linux: the boot id and the PID namespace's inode). A coordinator judges another one dead
by its pid only when both host and namespace match: containers that share a host name
but not their PIDs never release each other's claims; their leases do that instead.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from .. import conf


def host() -> str:
    return str(conf.value("IDENTITY") or socket.gethostname())


def namespace() -> str:
    parts = []
    try:
        parts.append(Path("/proc/sys/kernel/random/boot_id").read_text().strip())
    except OSError:
        pass
    try:
        parts.append(os.readlink("/proc/self/ns/pid"))
    except OSError:
        pass
    # Elsewhere (macOS) a host name is all there is: one PID space per machine.
    return ":".join(parts) or socket.gethostname()
