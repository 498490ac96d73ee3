"""Freeze a coordinator (SIGSTOP) between its transactions, never inside one.

A process frozen inside a transaction keeps its locks until it continues: on SQLite the
one write lock, so every other writer waits; on PostgreSQL and MariaDB the rows it was
renewing, which recovery skips (it never waits on a dead holder). Either way no other
coordinator can take the frozen one's rows over, which is not the case a test means when
it freezes a coordinator "so that its lease runs out". Under load the freeze lands inside
a transaction often enough to fail such a test, so it retries until it lands outside.

MariaDB serves information_schema.innodb_trx from a cache that it refreshes only when it
has not been read for 0.1 s: read more often, it shows the same old snapshot every time
(a coordinator caught once in a COMMIT would seem to stay in it). So its reads are spaced;
the cache is the server's, so nothing else may read that table meanwhile.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

from django.db import connection

from tests.helpers import wait_for
from tests.processes import process_state

# MariaDB's cache of innodb_trx is refreshed only after this long without a read.
INNODB_TRX_FRESH_AFTER = 0.12
_innodb_trx_read_at = 0.0


def freeze_between_transactions(pid: int, attempts: int = 200) -> None:
    for _ in range(attempts):
        os.kill(pid, signal.SIGSTOP)
        wait_for(lambda: process_state(pid) == "T", timeout=10, interval=0.001)
        if not in_a_transaction(pid):
            return
        os.kill(pid, signal.SIGCONT)
        # On MariaDB, the wait for a fresh innodb_trx is spent here, while pid runs.
        time.sleep(INNODB_TRX_FRESH_AFTER if connection.vendor == "mysql" else 0.02)
    raise AssertionError(f"process {pid} was inside a transaction at every one of "
                         f"{attempts} attempts to freeze it")


def in_a_transaction(pid: int) -> bool:
    """Whether ``pid`` holds an open transaction (or, on SQLite, the write lock)."""
    if connection.vendor == "sqlite":
        return _holds_sqlite_write_lock(pid)
    ports = _tcp_ports(pid)
    if not ports:
        return False
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SELECT client_port FROM pg_stat_activity WHERE state <> 'idle'")
            busy = {port for (port,) in cursor.fetchall()}
        else:  # MariaDB: a transaction that has begun, and the host:port of its client
            clients = (host.rpartition(":")[2] for host in _hosts_in_transactions(cursor))
            busy = {int(port) for port in clients if port.isdigit()}
    return bool(busy & ports)


def _hosts_in_transactions(cursor) -> list[str]:
    """The host:port of every MariaDB client in a transaction, read from a fresh cache."""
    global _innodb_trx_read_at
    time.sleep(max(0.0, _innodb_trx_read_at + INNODB_TRX_FRESH_AFTER - time.monotonic()))
    cursor.execute("SELECT p.host FROM information_schema.innodb_trx t "
                   "JOIN information_schema.processlist p ON p.id = t.trx_mysql_thread_id")
    hosts = [host for (host,) in cursor.fetchall()]
    _innodb_trx_read_at = time.monotonic()
    return hosts


def _holds_sqlite_write_lock(pid: int) -> bool:
    """A POSIX write lock of ``pid`` on the database's -shm file (/proc/locks): WAL mode's
    write lock."""
    inode = os.stat(connection.settings_dict["NAME"] + "-shm").st_ino
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if (len(fields) >= 6 and fields[3] == "WRITE" and fields[4] == str(pid)
                and fields[5].rsplit(":", 1)[-1] == str(inode)):
            return True
    return False


def _tcp_ports(pid: int) -> set[int]:
    """The local ports of ``pid``'s TCP sockets: how the server names its connections."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            match = re.fullmatch(r"socket:\[(\d+)\]", os.readlink(fd))
        except OSError:
            continue
        if match:
            inodes.add(match.group(1))
    ports = set()
    for table in ("tcp", "tcp6"):
        path = Path(f"/proc/{pid}/net/{table}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            if fields[9] in inodes:
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports
