"""Process helpers for the fault and stress tests: read a runworkers process's output while
it runs, find its worker children, restart the local PostgreSQL cluster."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import threading
from pathlib import Path
from urllib.parse import urlsplit

import pytest


class Output:
    """Collects a process's stdout and stderr in threads, so that a long run never blocks
    on a full pipe, and the text can be inspected while it runs."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self._out: list[str] = []
        self._err: list[str] = []
        self._threads = [
            threading.Thread(target=self._read, args=(proc.stdout, self._out), daemon=True),
            threading.Thread(target=self._read, args=(proc.stderr, self._err), daemon=True),
        ]
        for t in self._threads:
            t.start()

    @staticmethod
    def _read(stream, into: list[str]) -> None:
        for line in stream:
            into.append(line)

    @property
    def out(self) -> str:
        return "".join(self._out)

    @property
    def err(self) -> str:
        return "".join(self._err)

    def wait(self, timeout: float) -> int:
        code = self.proc.wait(timeout=timeout)
        for t in self._threads:
            t.join(timeout=10)
        return code


class Coordinators:
    """Several real `runworkers` processes with the same arguments, their output read as
    they run (killed, with their children, when the test ends: see conftest)."""

    def __init__(self, count: int, *args: str) -> None:
        from tests.helpers import runworkers

        self.procs = [runworkers(*args) for _ in range(count)]
        self.outputs = [Output(p) for p in self.procs]

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def report(self) -> str:
        return "\n".join(f"--- coordinator {p.pid} (exit {p.poll()}):\n{o.err[-4000:]}"
                         for p, o in zip(self.procs, self.outputs, strict=True))

    def wait_started(self, timeout: float = 120) -> None:
        """Until every one has started (its banner), failing if one ended first."""
        from tests.helpers import wait_for

        wait_for(lambda: all(BANNER in o.err for o in self.outputs) or not self.alive(),
                 timeout=timeout, interval=0.1)
        assert self.alive(), self.report()

    def stop(self, timeout: float = 120) -> list[int]:
        """SIGTERM to each; their exit codes."""
        for p in self.procs:
            p.send_signal(signal.SIGTERM)
        return [o.wait(timeout=timeout) for o in self.outputs]


def worker_children(parent: int) -> list[int]:
    """Pids of the spawned worker children of ``parent`` (not multiprocessing's resource
    tracker). Reads /proc: psutil may not be installed, and /proc/<pid>/task/*/children
    needs a kernel option that is not always set."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid != parent:
                continue
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue  # exited meanwhile
        if b"spawn_main" in cmdline:
            pids.append(int(entry))
    return pids


def process_state(pid: int) -> str | None:
    """``pid``'s state letter from /proc (R, S, T for stopped, Z for zombie...), or None
    once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def is_running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    return process_state(pid) not in (None, "Z")


def postgresql_restart_command(server_url: str) -> list[str]:
    """The command that restarts the local PostgreSQL cluster (fast shutdown: open
    connections are cut). Call it before setting anything up.

    Without pg_ctlcluster (or with a remote server) the test cannot run: a skip locally,
    a failure with CI=true, as for an unreachable server."""
    host = urlsplit(server_url).hostname
    ctl = shutil.which("pg_ctlcluster")
    problem = None
    if host not in ("127.0.0.1", "localhost", "::1", None, ""):
        problem = f"PostgreSQL at {host} is not local: this test restarts the local cluster"
    elif ctl is None or not Path("/etc/postgresql").is_dir() or not os.listdir("/etc/postgresql"):
        problem = ("pg_ctlcluster is missing: this test restarts the local PostgreSQL cluster "
                   "(install postgresql-common, see scripts/system-packages.sh)")
    if problem:
        if os.environ.get("CI") == "true":
            pytest.fail(problem)
        pytest.skip(problem)
    versions = sorted(os.listdir("/etc/postgresql"),
                      key=lambda v: [int(p) if p.isdigit() else 0 for p in v.split(".")])
    return [str(ctl), "--skip-systemctl-redirect", versions[-1], "main", "restart"]


def run_command(command: list[str], timeout: float = 180) -> None:
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(command)} failed: {result.stdout}{result.stderr}"


def _local_or_skip(server_url: str, what: str, tool: str | None) -> None:
    host = urlsplit(server_url).hostname
    problem = None
    if host not in ("127.0.0.1", "localhost", "::1", None, ""):
        problem = f"{what} at {host} is not local: this test stops and starts the local server"
    elif tool is None:
        problem = f"{what}'s control tools are missing: this test stops and starts the local server"
    if problem:
        if os.environ.get("CI") == "true":
            pytest.fail(problem)
        pytest.skip(problem)


def server_stop_start(vendor: str, server_url: str) -> tuple[list[str], list[str]]:
    """Commands that stop and start the local database server of ``vendor`` (its open
    connections are cut). Skips (fails with CI=true) where that cannot be done."""
    if vendor == "postgresql":
        restart = postgresql_restart_command(server_url)
        return [*restart[:-1], "stop"], [*restart[:-1], "start"]
    admin = shutil.which("mariadb-admin") or shutil.which("mysqladmin")
    server = "/usr/sbin/mariadbd" if Path("/usr/sbin/mariadbd").exists() else shutil.which("mysqld")
    _local_or_skip(server_url, "MariaDB/MySQL", admin and server)
    port = str(urlsplit(server_url).port or 3306)
    return ([str(admin), "-uroot", "-h127.0.0.1", f"-P{port}", "shutdown"],
            ["start-stop-daemon", "--start", "--oknodo", "--background", "--exec", str(server)])


def kill_one_child(coordinators: list[int], rng: random.Random | None = None) -> int | None:
    """SIGKILL one random worker child of these coordinators; its pid (None: none alive)."""
    children = [pid for parent in coordinators for pid in worker_children(parent)]
    if not children:
        return None
    pid = (rng or random).choice(children)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return None
    return pid


# runworkers' start-up line on stderr: it is claiming from here on.
BANNER = "django-dbworker coordinator"


class Killer(threading.Thread):
    """SIGKILLs one random worker child of the given coordinators every ~``every`` s."""

    def __init__(self, coordinators: list[int], every: float = 0.3) -> None:
        super().__init__(daemon=True)
        self.coordinators = coordinators
        self.every = every
        self.stopped = threading.Event()
        self.killed: list[int] = []

    def run(self) -> None:
        rng = random.Random()
        while not self.stopped.wait(self.every * rng.uniform(0.5, 1.5)):
            pid = kill_one_child(self.coordinators, rng)
            if pid is not None:
                self.killed.append(pid)

    def stop(self) -> None:
        self.stopped.set()
        self.join(timeout=10)
