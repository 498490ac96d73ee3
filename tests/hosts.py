"""Separate network "hosts" on this machine, for tests of coordinators on many machines.

Each host is a network namespace (``ip netns``) joined by a veth pair to a bridge in the
root namespace, with an address of its own on that bridge's /24, and every command run in
it gets a UTS namespace with the host's own host name (``unshare --uts``; optionally a PID
namespace of its own too, as in a container). Nothing in a host reaches the databases over
loopback: its database URLs name the bridge's address in the root namespace, where a
``socat`` relay per port (PostgreSQL, MariaDB, PgBouncer) passes connections on to the
servers, which listen on 127.0.0.1 only. A host's link can be cut (``ip link set down``:
packets are dropped, TCP connections hang as across a real partition) and healed.

Everything is removed when the ``Hosts`` block ends, at interpreter exit (atexit) for
anything a failed test left, and, for leftovers of a run that was killed outright, when
the next run takes the same subnet. Root, ``ip`` (iproute2), ``unshare`` and ``socat`` are
needed: without them ``require()`` skips the test with the reason (a failure with CI=true).
"""

from __future__ import annotations

import atexit
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

STATE = Path(os.environ.get("DBWORKER_HOSTS_STATE", "/run/dbworker-hosts"))
SUBNETS = range(0, 64)  # 10.213.K.0/24, one per Hosts block alive on the machine
RELAYED_PORTS = (5432, 3306, 6432)  # PostgreSQL, MariaDB, PgBouncer
_LIVE: list[Hosts] = []


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({result.returncode}): "
                           f"{result.stderr.strip() or result.stdout.strip()}")
    return result


def unavailable() -> str | None:
    """Why this machine cannot make namespace hosts (None: it can)."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces are Linux only (this is {sys.platform})"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux"), ("socat", "socat")):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (Debian package {package}; scripts/services.sh installs it)"
    probe = f"dbwprobe{os.getpid()}"
    made = _run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip()}"
    _run("ip", "netns", "delete", probe, check=False)
    return None


def require() -> None:
    """Skip the calling test, with the reason, where namespace hosts cannot be made; with
    CI=true fail it instead: CI must run these tests."""
    from tests.helpers import skip_or_fail

    reason = unavailable()
    if reason is not None:
        skip_or_fail("make network-namespace hosts", reason)


class Host:
    """One namespace host: ``run()`` commands in it, ``cut()`` and ``heal()`` its link."""

    def __init__(self, hosts: Hosts, index: int, name: str) -> None:
        self.hosts = hosts
        self.index = index
        self.name = name
        self.netns = f"dbw{hosts.subnet}n{index}"
        self.link = f"dbw{hosts.subnet}r{index}"  # its end in the root namespace
        self.address = f"10.213.{hosts.subnet}.{10 + index}"
        self.processes: list[subprocess.Popen] = []

    def _create(self) -> None:
        peer = f"dbw{self.hosts.subnet}p{self.index}"
        _run("ip", "netns", "add", self.netns)
        _run("ip", "link", "add", self.link, "type", "veth", "peer", "name", peer)
        _run("ip", "link", "set", peer, "netns", self.netns)
        _run("ip", "link", "set", self.link, "master", self.hosts.bridge)
        _run("ip", "link", "set", self.link, "up")
        inside = ("ip", "netns", "exec", self.netns)
        _run(*inside, "ip", "link", "set", peer, "name", "eth0")
        _run(*inside, "ip", "addr", "add", f"{self.address}/24", "dev", "eth0")
        _run(*inside, "ip", "link", "set", "eth0", "up")
        _run(*inside, "ip", "link", "set", "lo", "up")

    # -- processes ----------------------------------------------------------------------
    def command(self, argv: list[str], pid_namespace: bool = False, pad_pids: int = 0) -> list[str]:
        """``argv`` as run inside this host under its host name. ``pid_namespace``: in a
        PID namespace of its own (a container: its first process is pid 1); ``pad_pids``
        processes are started and gone first, so that argv's pid there is above them."""
        unshare = ["unshare", "--uts"]
        if pid_namespace:
            unshare += ["--pid", "--fork", "--mount-proc"]
        if pad_pids:  # argv a new process, after the padding ones (sh waits for it)
            script = (f'hostname "$0" && i=0 && while [ "$i" -lt {pad_pids} ]; do /bin/true; '
                      'i=$((i+1)); done && { "$@" & wait $!; }')
        else:
            script = 'hostname "$0" && exec "$@"'

        return ["ip", "netns", "exec", self.netns, *unshare, "sh", "-c", script, self.name, *argv]

    def run(self, argv: list[str], env: dict[str, str], log: Path, pid_namespace: bool = False,
            pad_pids: int = 0, cwd: Path | None = None) -> subprocess.Popen:
        """Start ``argv`` in this host (its own session: killed with all it started when
        the block ends); its stdout and stderr go to ``log``."""
        out = open(log, "ab")  # noqa: SIM115 - closed with the process, in cleanup
        proc = subprocess.Popen(self.command(argv, pid_namespace, pad_pids), env=env, cwd=cwd,
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        out.close()
        proc.log = log  # type: ignore[attr-defined]
        self.processes.append(proc)
        return proc

    def runworkers(self, *args: str, env: dict[str, str] | None = None, log: Path | None = None,
                   pid_namespace: bool = False, pad_pids: int = 0) -> subprocess.Popen:
        """``manage.py runworkers ARGS`` on the test database, from inside this host: the
        environment of tests.helpers.subprocess_env with the database URLs pointing at
        the root namespace's bridge address; ``env`` adds (or overrides) variables."""
        from tests.helpers import ROOT, subprocess_env

        full = subprocess_env(**self.hosts.database_env())
        full.update(env or {})
        log = log or self.hosts.logs / f"{self.name}-{len(self.processes)}.log"
        return self.run([sys.executable, "-m", "django", "runworkers", *args], full, log,
                        pid_namespace=pid_namespace, pad_pids=pad_pids, cwd=ROOT)

    def stop(self, proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
        """Signal ``proc``'s whole process group (it, unshare's child and its children)."""
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        if sig == signal.SIGKILL:
            proc.wait(timeout=30)

    # -- the link -----------------------------------------------------------------------
    def cut(self) -> None:
        """Partition this host: its link goes down, packets both ways are dropped."""
        _run("ip", "link", "set", self.link, "down")

    def heal(self) -> None:
        """The link back up. Addresses the host failed to resolve while cut off are
        forgotten on both sides, so that the next packet asks again at once (as a real
        network would after its ARP timers; here without their seconds)."""
        _run("ip", "link", "set", self.link, "up")
        _run("ip", "netns", "exec", self.netns, "ip", "neigh", "flush", "dev", "eth0", check=False)
        _run("ip", "neigh", "flush", "dev", self.hosts.bridge, check=False)

    def _destroy(self) -> None:
        for proc in self.processes:
            self.stop(proc)
        self.processes.clear()
        _kill_netns_pids(self.netns)
        _run("ip", "link", "delete", self.link, check=False)
        _run("ip", "netns", "delete", self.netns, check=False)


class Hosts:
    """``with Hosts(["a", "b", "c"]) as hosts:`` three hosts named a, b and c, on the
    bridge 10.213.K.1/24 (K: a subnet no other live block on this machine holds)."""

    def __init__(self, names: list[str], logs: Path) -> None:
        self.names = list(names)
        self.logs = logs
        self.subnet = -1
        self.bridge = ""
        self.address = ""
        self.hosts: list[Host] = []
        self.relays: list[subprocess.Popen] = []
        self._lock: int | None = None

    def __enter__(self) -> Hosts:
        self.logs.mkdir(parents=True, exist_ok=True)
        _LIVE.append(self)
        try:
            self._take_subnet()
            self._remove_leftovers()
            _run("ip", "link", "add", self.bridge, "type", "bridge", "forward_delay", "0")
            _run("ip", "addr", "add", f"{self.address}/24", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
            for index, name in enumerate(self.names, start=1):
                host = Host(self, index, name)
                self.hosts.append(host)
                host._create()
            self._start_relays()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]

    def __iter__(self):
        return iter(self.hosts)

    # -- set-up -------------------------------------------------------------------------
    def _take_subnet(self) -> None:
        """A subnet index held with a lock file for as long as this block lives (a killed
        run's lock goes with its process; its leftovers are removed next)."""
        STATE.mkdir(parents=True, exist_ok=True)
        used = _run("ip", "-4", "-o", "addr").stdout
        for k in SUBNETS:
            fd = os.open(STATE / f"{k}.lock", os.O_CREAT | os.O_RDWR, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            if f" 10.213.{k}." in used and f"dbwb{k} " not in used:
                os.close(fd)  # someone else's network: not ours to take
                continue
            self._lock, self.subnet = fd, k
            self.bridge, self.address = f"dbwb{k}", f"10.213.{k}.1"
            return
        raise RuntimeError("no free 10.213.K.0/24 subnet for namespace hosts")

    def _remove_leftovers(self) -> None:
        """What a run killed outright left on this subnet: its relays, processes and links."""
        pids = STATE / f"{self.subnet}.relays"
        if pids.exists():
            for pid in pids.read_text().split():
                try:
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                except OSError:
                    continue
                if b"socat" in cmdline and f"bind={self.address}".encode() in cmdline:
                    _kill_group(int(pid))
            pids.unlink()
        prefix = f"dbw{self.subnet}n"
        for line in _run("ip", "netns", "list", check=False).stdout.splitlines():
            netns = line.split()[0] if line.split() else ""
            if netns.startswith(prefix):
                _kill_netns_pids(netns)
                _run("ip", "netns", "delete", netns, check=False)
        for line in _run("ip", "-o", "link", "show").stdout.splitlines():
            name = line.split(":")[1].strip().split("@")[0]
            if name == self.bridge or name.startswith(f"dbw{self.subnet}r"):
                _run("ip", "link", "delete", name, check=False)

    def _start_relays(self) -> None:
        relayed = []
        for port in RELAYED_PORTS:
            if not _listening("127.0.0.1", port):
                continue
            relayed.append(port)
            relay = subprocess.Popen(
                ["socat", f"TCP-LISTEN:{port},bind={self.address},reuseaddr,fork,backlog=256",
                 f"TCP:127.0.0.1:{port}"],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=open(self.logs / f"socat-{port}.log", "ab"),  # noqa: SIM115
                start_new_session=True)
            self.relays.append(relay)
        (STATE / f"{self.subnet}.relays").write_text(" ".join(str(r.pid) for r in self.relays))
        # Only the relays started: a server that was down a moment ago may be up now (the
        # other database's lane of scripts/test.sh stops and starts its own server).
        for port in relayed:
            if _listening("127.0.0.1", port):
                deadline = time.monotonic() + 10
                while not _listening(self.address, port):
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"socat relay on {self.address}:{port} did not start")
                    time.sleep(0.05)

    # -- use ----------------------------------------------------------------------------
    def url(self, url: str) -> str:
        """``url`` with its host replaced by the bridge address (as seen from a host)."""
        parts = urlsplit(url)
        netloc = parts.netloc.rsplit("@", 1)
        hostport = f"{self.address}:{parts.port}" if parts.port else self.address
        netloc[-1] = hostport
        return urlunsplit(parts._replace(netloc="@".join(netloc)))

    def database_env(self) -> dict[str, str]:
        from django.conf import settings

        return {"DBWORKER_TEST_POSTGRES_URL": self.url(settings.POSTGRES_URL),
                "DBWORKER_TEST_MYSQL_URL": self.url(settings.MYSQL_URL)}

    def close(self) -> None:
        for host in self.hosts:
            host._destroy()
        self.hosts.clear()
        for relay in self.relays:
            _kill_group(relay.pid)
            relay.wait(timeout=30)
        self.relays.clear()
        if self.bridge:
            _run("ip", "link", "delete", self.bridge, check=False)
        if self.subnet >= 0:
            (STATE / f"{self.subnet}.relays").unlink(missing_ok=True)
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None
        if self in _LIVE:
            _LIVE.remove(self)


def _listening(address: str, port: int) -> bool:
    try:
        socket.create_connection((address, port), timeout=1).close()
        return True
    except OSError:
        return False


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_netns_pids(netns: str) -> None:
    """Every process still in this (our own) network namespace."""
    for pid in _run("ip", "netns", "pids", netns, check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


@atexit.register
def _clean_up_at_exit() -> None:
    for hosts in list(_LIVE):
        hosts.close()


def pid_namespace_members(proc: subprocess.Popen) -> dict[int, int]:
    """For a process started with ``pid_namespace=True``: every live process in its PID
    namespace, as {pid inside: pid here}."""
    children = [p for p in _all_pids() if _status(p).get("PPid") == str(proc.pid)]
    if not children:
        return {}
    try:
        inode = os.readlink(f"/proc/{children[0]}/ns/pid")
    except OSError:
        return {}
    members = {}
    for pid in _all_pids():
        try:
            if os.readlink(f"/proc/{pid}/ns/pid") != inode:
                continue
        except OSError:
            continue
        status = _status(pid)
        if status.get("State", "").startswith("Z"):
            continue
        nspids = status.get("NSpid", "").split()
        if nspids:
            members[int(nspids[-1])] = pid
    return members


def _all_pids() -> list[int]:
    return [int(e) for e in os.listdir("/proc") if e.isdigit()]


def _status(pid: int) -> dict[str, str]:
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    return dict(line.split(":\t", 1) for line in lines if ":\t" in line)


_AT_PIDS = r"""
import os, sys
targets, argv = [int(t) for t in sys.argv[1].split(",")], sys.argv[2:]
started = 0
while started < len(targets):
    pid = os.fork()
    if pid == 0:
        if os.getpid() in targets:
            os.execv(argv[0], argv)
        os._exit(0)
    if pid in targets:
        started += 1
    elif pid > max(targets):
        sys.exit(f"pid {pid} is past the targets {targets}: other processes in this namespace")
    else:
        os.waitpid(pid, 0)
while True:  # as pid 1: reap everything, until nothing is left
    try:
        os.wait()
    except ChildProcessError:
        break
"""


def at_pids(pids: list[int], argv: list[str]) -> list[str]:
    """``argv`` started once per pid in ``pids``, each with exactly that pid: for the first
    process of a new PID namespace (``Host.run(..., pid_namespace=True)``), which forks
    short-lived processes until the namespace's next pid is the one wanted."""
    return [sys.executable, "-c", _AT_PIDS, ",".join(map(str, sorted(pids))), *argv]
