"""A PostgreSQL primary and its streaming replica on this machine, for the failover tests.

``ReplicaPair`` makes two clusters of its own with Debian's postgresql-common
(``pg_createcluster``; never the ``main`` cluster the other tests use): a primary on
127.0.0.1:5441 and a replica on 127.0.0.1:5442 made from it with ``pg_basebackup -R``,
streaming through a physical replication slot. Both trust local TCP connections (user
``postgres``). The pair can stop the primary as a crash would (``-m immediate``), promote
the replica, cut the replica off the primary's WAL stream (replication lag, on purpose),
and switch to synchronous replication.

Both clusters are dropped when the ``with`` block ends, at interpreter exit (atexit) for
anything a failed or interrupted test left, and before a new pair is made (leftovers of a
run that was killed outright). Root and the PostgreSQL server tools are needed: without
them ``require()`` skips the calling test with the reason (a failure with CI=true).
"""

from __future__ import annotations

import atexit
import fcntl
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

VERSION = os.environ.get("DBWORKER_REPLICA_PG_VERSION", "15")
BINDIR = Path(f"/usr/lib/postgresql/{VERSION}/bin")
SLOT = "dbw_replica_slot"
USER = "postgres"  # the clusters' superuser (clusters are owned by postgres, not root)
_LIVE: list[ReplicaPair] = []


def _run(*argv: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({result.returncode}): "
                           f"{result.stderr.strip() or result.stdout.strip()}")
    return result


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def unavailable(ports: tuple[int, ...] = (), prefix: str = "dbw") -> str | None:
    """Why this machine cannot make a primary/replica pair (None: it can)."""
    if not sys.platform.startswith("linux"):
        return f"the pair is made with Debian's postgresql-common (this is {sys.platform})"
    if os.geteuid() != 0:
        return "making PostgreSQL clusters with pg_createcluster needs root"
    for tool in ("pg_createcluster", "pg_ctlcluster", "pg_dropcluster", "runuser"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (Debian packages postgresql-common, util-linux)"
    for tool in ("pg_basebackup", "psql", "postgres"):
        if not (BINDIR / tool).exists():
            return (f"{BINDIR / tool} is missing (Debian package postgresql-{VERSION}; "
                    "DBWORKER_REPLICA_PG_VERSION chooses another version)")
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "psycopg is not installed"
    for port in ports:
        if _listening(port) and not _ours_on(port, prefix):
            return f"port {port} is taken by something else than this harness's clusters"
    return None


def _ours_on(port: int, prefix: str) -> bool:
    """A leftover cluster of this harness (its pair ``prefix``) listens on ``port``."""
    for name in (f"{prefix}_primary", f"{prefix}_replica"):
        conf = Path(f"/etc/postgresql/{VERSION}/{name}/postgresql.conf")
        if conf.exists() and f"port = {port}" in conf.read_text():
            return True
    return False


def require(ports: tuple[int, ...] = (5441, 5442), prefix: str = "dbw") -> None:
    """Skip the calling test, with the reason, where the pair cannot be made; with CI=true
    fail it instead: CI must run these tests."""
    from tests.helpers import skip_or_fail

    reason = unavailable(ports, prefix)
    if reason is not None:
        skip_or_fail("make a PostgreSQL primary/replica pair", reason)


class Cluster:
    """One cluster of the pair (``pg_ctlcluster VERSION NAME ...``)."""

    def __init__(self, name: str, port: int) -> None:
        self.name, self.port = name, port
        self.confdir = Path(f"/etc/postgresql/{VERSION}/{name}")
        self.datadir = Path(f"/var/lib/postgresql/{VERSION}/{name}")
        self.log = Path(f"/var/log/postgresql/postgresql-{VERSION}-{name}.log")

    def exists(self) -> bool:
        return self.confdir.exists()

    def ctl(self, action: str, *options: str, check: bool = True) -> subprocess.CompletedProcess:
        return _run("pg_ctlcluster", "--skip-systemctl-redirect", VERSION, self.name, action,
                    *options, check=check)

    def create(self) -> None:
        _run("pg_createcluster", "--quiet", "--start-conf=manual", "--port", str(self.port),
             "-o", "ssl=off", VERSION, self.name)
        # Trust for local TCP and the socket, replication included: a test machine only.
        (self.confdir / "pg_hba.conf").write_text(
            "local all all trust\n"
            "local replication all trust\n"
            "host all all 127.0.0.1/32 trust\n"
            "host replication all 127.0.0.1/32 trust\n")
        # Small and quiet: another test run shares this machine.
        (self.confdir / "conf.d" / "dbworker-replica.conf").write_text(
            "listen_addresses = '127.0.0.1'\n"
            "wal_level = replica\n"
            "max_wal_senders = 4\n"
            "max_replication_slots = 4\n"
            "hot_standby = on\n"
            "max_connections = 60\n"
            "shared_buffers = 32MB\n"
            "wal_receiver_status_interval = 1s\n"
            "wal_retrieve_retry_interval = 1s\n"
            "autovacuum = off\n"
            "log_min_messages = warning\n")

    def drop(self) -> None:
        if self.exists() or self.datadir.exists():
            _run("pg_dropcluster", "--stop", VERSION, self.name, check=False)
        if self.exists():  # pg_dropcluster gave up (a half-made cluster): by hand
            self.ctl("stop", "-m", "immediate", check=False)
            shutil.rmtree(self.confdir, ignore_errors=True)
        shutil.rmtree(self.datadir, ignore_errors=True)

    def start(self) -> None:
        self.ctl("start")
        self.wait_ready()

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if _run(str(BINDIR / "pg_isready"), "-q", "-h", "127.0.0.1", "-p", str(self.port),
                    check=False).returncode == 0:
                return
            time.sleep(0.2)
        raise RuntimeError(f"cluster {self.name} did not accept connections within {timeout}s")

    def url(self, database: str = "postgres") -> str:
        return f"host=127.0.0.1 port={self.port} user={USER} dbname={database} connect_timeout=5"

    def query(self, sql: str, params: tuple = (), database: str = "postgres") -> list[tuple]:
        """Rows of one statement, on a connection of its own (autocommit)."""
        import psycopg

        with psycopg.connect(self.url(database), autocommit=True) as conn:
            cursor = conn.execute(sql, params)
            return cursor.fetchall() if cursor.description else []


class ReplicaPair:
    """A primary and a streaming replica of it (see the module's docstring)."""

    def __init__(self, primary_port: int = 5441, replica_port: int = 5442,
                 prefix: str = "dbw") -> None:
        self.primary = Cluster(f"{prefix}_primary", primary_port)
        self.replica = Cluster(f"{prefix}_replica", replica_port)
        self.failed_over = False
        self.lock_path = Path(f"/run/dbworker-replica-{prefix}.lock")
        self._lock: int | None = None

    # -- making and removing --------------------------------------------------------------
    def __enter__(self) -> ReplicaPair:
        # One run at a time per pair: create() drops the clusters of that name first
        # (a killed run's leftovers), which must never be another live run's.
        fd = os.open(self.lock_path, os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RuntimeError(f"another run holds the {self.primary.name}/"
                               f"{self.replica.name} pair ({self.lock_path})") from None
        self._lock = fd
        _LIVE.append(self)
        try:
            self.create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def create(self) -> None:
        self._drop()  # leftovers of a run killed outright
        self.primary.create()
        self.primary.start()
        self.primary.query("SELECT pg_create_physical_replication_slot(%s)", (SLOT,))
        # The replica: a cluster's configuration (/etc/postgresql/...), its data directory
        # replaced by a base backup of the primary. -R writes standby.signal and
        # primary_conninfo/primary_slot_name (postgresql.auto.conf).
        self.replica.create()
        for entry in self.replica.datadir.iterdir():  # emptied, kept (postgres owns it)
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        _run("runuser", "-u", USER, "--", str(BINDIR / "pg_basebackup"),
             "-h", "127.0.0.1", "-p", str(self.primary.port), "-U", USER,
             "-D", str(self.replica.datadir), "-R", "-X", "stream", "-S", SLOT,
             "--checkpoint=fast", timeout=300)
        self.replica.start()
        self.wait_streaming()

    def _drop(self) -> None:
        for cluster in (self.replica, self.primary):
            cluster.drop()

    def close(self) -> None:
        self._drop()
        if self in _LIVE:
            _LIVE.remove(self)
        if self._lock is not None:
            os.close(self._lock)  # (the lock goes with it)
            self._lock = None

    # -- watching -------------------------------------------------------------------------
    def host_settings(self) -> dict:
        """DATABASES["default"] entries naming both hosts: libpq tries them in turn and
        keeps the one that takes writes (the primary, or the replica once promoted)."""
        return {"HOST": "127.0.0.1,127.0.0.1",
                "PORT": f"{self.primary.port},{self.replica.port}",
                "USER": USER, "PASSWORD": "",
                "OPTIONS": {"target_session_attrs": "read-write"}}

    def replication(self) -> list[tuple]:
        """(application_name, state, sync_state) of the primary's WAL senders."""
        return self.primary.query(
            "SELECT application_name, state, sync_state FROM pg_stat_replication")

    def wait_streaming(self, sync_state: str | None = None, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rows = self.replication()
            if any(state == "streaming" and sync_state in (None, sync) for _, state, sync in rows):
                return
            time.sleep(0.2)
        raise RuntimeError(f"the replica is not streaming ({sync_state or 'any'}) within "
                           f"{timeout}s: {self.replication()}")

    def wait_caught_up(self, timeout: float = 30) -> None:
        """Until the replica has replayed everything the primary has flushed now."""
        [(target,)] = self.primary.query("SELECT pg_current_wal_flush_lsn()::text")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            [(done,)] = self.replica.query(
                "SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", (target,))
            if done:
                return
            time.sleep(0.1)
        raise RuntimeError(f"the replica did not replay up to {target} within {timeout}s")

    def wait_replayed(self, timeout: float = 30) -> None:
        """Until the replica has replayed all the WAL it has received (the state a
        promotion starts from, once the primary is gone or the stream is cut)."""
        deadline = time.monotonic() + timeout
        last, still_since = None, time.monotonic()
        while time.monotonic() < deadline:
            [(done, replayed)] = self.replica.query(
                "SELECT pg_last_wal_receive_lsn() IS NULL "
                "OR pg_last_wal_replay_lsn() >= pg_last_wal_receive_lsn(), "
                "pg_last_wal_replay_lsn()::text")
            if done:
                return
            # What was received may end inside a record whose rest never came (the stream
            # was cut): replay stops short of it for good.
            if replayed != last:
                last, still_since = replayed, time.monotonic()
            elif time.monotonic() - still_since >= 1.0:
                return
            time.sleep(0.05)
        raise RuntimeError(f"the replica did not replay what it received within {timeout}s")

    # -- what the tests do to it ----------------------------------------------------------
    def synchronous(self) -> None:
        """Synchronous replication: a commit on the primary returns once the replica has
        flushed it (synchronous_commit = on, the default). Set on the primary only (its
        postgresql.auto.conf, not copied to the replica, which is made already): once
        promoted, the replica has no standby to wait for."""
        self.primary.query("ALTER SYSTEM SET synchronous_standby_names = '*'")
        self.primary.query("SELECT pg_reload_conf()")
        self.wait_streaming(sync_state="sync")

    def cut_replication(self) -> None:
        """The replica stops receiving WAL (its walreceiver ends; primary_conninfo is
        reloadable since PostgreSQL 13): what the primary commits from now on is not
        replicated, as in a replication lag. With synchronous replication this would hold
        every commit: asynchronous only."""
        self.replica.query("ALTER SYSTEM SET primary_conninfo = ''")
        self.replica.query("SELECT pg_reload_conf()")
        deadline = time.monotonic() + 30
        while self.replication():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the replica still streams: {self.replication()}")
            time.sleep(0.05)

    def stop_primary(self) -> None:
        """Stop the primary as a crash would: no shutdown checkpoint, connections cut."""
        self.primary.ctl("stop", "-m", "immediate")

    def promote(self) -> None:
        """Make the replica a primary (waits until it takes writes)."""
        self.replica.ctl("promote")
        deadline = time.monotonic() + 60
        while self.replica.query("SELECT pg_is_in_recovery()") != [(False,)]:
            if time.monotonic() > deadline:
                raise RuntimeError("the promoted replica is still in recovery after 60s")
            time.sleep(0.05)
        self.failed_over = True

    @property
    def current(self) -> Cluster:
        """The cluster that takes writes now."""
        return self.replica if self.failed_over else self.primary


@atexit.register
def _clean_up_at_exit() -> None:
    for pair in list(_LIVE):
        try:
            pair.close()
        except Exception as exc:  # noqa: BLE001 - exit: report, go on with the others
            print(f"tests/replica.py: could not drop {pair.primary.name}/{pair.replica.name}: "
                  f"{exc}", file=sys.stderr)
