"""A lab for the many-machines promises, driven by hand: cut links, kill processes and
promote a replica at moments of your choosing, then count effects.

    sudo DBWORKER_TEST_DB=postgres .venv/bin/python scripts/lab.py hosts --rows 5000
    sudo DBWORKER_TEST_DB=mysql    .venv/bin/python scripts/lab.py hosts --hosts 2
    sudo .venv/bin/python scripts/lab.py failover --rows 2000 --delay 0.05

``hosts``: three (``--hosts N``) network-namespace hosts (tests/hosts.py), each running
``runworkers --worker stress`` over a veth network against the local PostgreSQL or MariaDB
(DBWORKER_TEST_DB), on a database of its own that is dropped at the end.
``failover``: a primary and its streaming replica (tests/replica.py, ports 5443/5444,
clusters of their own: dbwlab_primary, dbwlab_replica),
DATABASES naming both with target_session_attrs=read-write, one ``runworkers`` on this host.

Commands, one per line on stdin (or ``--commands "cut host-a; sleep 6; heal host-a; wait"``):

    status                   rows, finished, effects, twice, finished without an effect
    wait [SECONDS]           until every row is finished (default 300 s), then status
    add N                    N more rows
    sleep SECONDS
    kill [HOST]              SIGKILL one random worker child (of HOST's coordinator)
    kill-coordinator [HOST]  SIGKILL a coordinator and its children; `start` runs a new one
    start [HOST]
    cut HOST / heal HOST     (hosts) the host's link down: a partition / back up
    lag                      (failover) cut the replica off the WAL stream
    failover                 (failover) stop the primary as in a crash, promote the replica
    quit

Everything the lab made (processes, namespaces, clusters, its database) is removed when it
ends: at `quit`, end of input, Ctrl-C or SIGTERM. The lab exits 0 if, at the end, every
row finished with exactly one effect, 1 otherwise.
Every handler inserts its effect in the run's transaction, so "twice" counts rows whose
business effect committed more than once, and "lost" rows that finished without one.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
EXECUTIONS = "django_dbworker_execution"
FAILOVER_DATABASE = "dbworker_lab"


class Lab(ABC):
    """What both kinds of lab share: the counting, the processes, the command loop."""

    def __init__(self, query: Callable[[str], list[tuple]], delay: float) -> None:
        self.query = query
        self.delay = delay
        self.coordinators: dict[str, subprocess.Popen] = {}
        self.started = time.monotonic()

    # -- counting ---------------------------------------------------------------------------
    def counts(self) -> dict[str, int]:
        [(rows,)] = self.query("SELECT count(*) FROM testapp_stressjob")
        [(finished,)] = self.query(f"SELECT count(*) FROM {EXECUTIONS} "
                                   "WHERE worker = 'stress' AND status = 'finished'")
        per_row = self.query("SELECT source_id, count(*) FROM testapp_effect "
                             "WHERE worker = 'stress' GROUP BY source_id")
        [(without,)] = self.query(
            f"SELECT count(*) FROM {EXECUTIONS} e WHERE e.worker = 'stress' AND e.status = "
            "'finished' AND NOT EXISTS (SELECT 1 FROM testapp_effect f WHERE f.worker = "
            "'stress' AND f.source_id = e.source_id)")
        return {"rows": rows, "finished": finished, "effects": len(per_row),
                "twice": sum(1 for _, n in per_row if n > 1), "lost": without}

    def status(self) -> dict[str, int]:
        counts = self.counts()
        hosts = self.query(f"SELECT claimed_by, count(*) FROM {EXECUTIONS} WHERE worker = "
                           "'stress' AND status = 'finished' GROUP BY claimed_by")
        per_host: dict[str, int] = {}
        for claimed_by, n in hosts:
            name = (claimed_by or "?").rsplit(":", 1)[0]
            per_host[name] = per_host.get(name, 0) + n
        print(f"[{time.monotonic() - self.started:6.1f}s] rows {counts['rows']}, finished "
              f"{counts['finished']}, with an effect {counts['effects']}, twice "
              f"{counts['twice']}, finished without an effect (lost) {counts['lost']}; "
              f"finished per host {per_host}", flush=True)
        return counts

    def wait(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                counts = self.counts()
                if counts["finished"] == counts["rows"]:
                    break
            except Exception as exc:  # noqa: BLE001 - the database is away (a failover)
                print(f"  (database not answering: {exc.__class__.__name__})", flush=True)
            time.sleep(0.5)
        else:
            print(f"  not every row finished within {seconds:g}s", flush=True)
        self.status()

    # -- processes --------------------------------------------------------------------------
    def coordinator(self, name: str | None) -> tuple[str, subprocess.Popen]:
        if name is None:
            name = next(iter(self.coordinators))
        if name not in self.coordinators:
            raise ValueError(f"no coordinator on {name!r}: one of {sorted(self.coordinators)}")
        return name, self.coordinators[name]

    def kill_child(self, name: str | None) -> None:
        from tests.processes import kill_one_child

        name, proc = self.coordinator(name)
        pid = kill_one_child([proc.pid])
        print(f"  {name}: killed child {pid}" if pid else f"  {name}: no worker child to kill",
              flush=True)

    def kill_coordinator(self, name: str | None) -> None:
        name, proc = self.coordinator(name)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)
        print(f"  {name}: killed its coordinator {proc.pid} and children", flush=True)

    @abstractmethod
    def start(self, name: str | None) -> None:
        """A new runworkers (on host ``name``)."""

    # -- commands ---------------------------------------------------------------------------
    def commands(self) -> dict[str, Callable[..., object]]:
        return {
            "status": lambda: self.status(),
            "wait": lambda seconds="300": self.wait(float(seconds)),
            "add": lambda n: self.add(int(n)),
            "sleep": lambda seconds: time.sleep(float(seconds)),
            "kill": lambda name=None: self.kill_child(name),
            "kill-coordinator": lambda name=None: self.kill_coordinator(name),
            "start": lambda name=None: self.start(name),
        }

    @abstractmethod
    def add(self, n: int) -> None:
        """``n`` more rows of the stress worker's model."""

    def run(self, script: str | None) -> int:
        commands = self.commands()
        lines: Iterator[str] = iter(script.replace(";", "\n").splitlines()) if script \
            else _prompted()
        for line in lines:
            try:
                words = shlex.split(line)
            except ValueError as exc:
                print(f"  {line.strip()!r}: {exc}", flush=True)
                continue
            if not words:
                continue
            if words[0] == "quit":
                break
            if words[0] not in commands:
                print(f"  unknown command {words[0]!r}: one of {', '.join(commands)}, quit")
                continue
            print(f"> {line.strip()}", flush=True)
            try:
                commands[words[0]](*words[1:])
            except Exception as exc:  # noqa: BLE001 - a command failed; the lab goes on
                print(f"  {words[0]}: {exc.__class__.__name__}: {exc}", flush=True)
        try:
            counts = self.status()
        except Exception as exc:  # noqa: BLE001 - the database is away: say so, clean up
            print(f"could not count: {exc.__class__.__name__}: {exc}")
            return 1
        good = counts["finished"] == counts["rows"] and counts["twice"] == counts["lost"] == 0
        print("every row finished once" if good else "NOT every row finished exactly once")
        return 0 if good else 1


def _prompted() -> Iterator[str]:
    while True:
        try:
            yield input("lab> ")
        except EOFError:
            return


class HostsLab(Lab):
    def __init__(self, hosts, delay: float) -> None:
        from django.db import connection

        def query(sql: str) -> list[tuple]:
            with connection.cursor() as cursor:
                cursor.execute(sql)
                return list(cursor.fetchall())

        super().__init__(query, delay)
        self.hosts = {h.name: h for h in hosts}

    def start(self, name: str | None) -> None:
        name = self.host(name or next(iter(self.hosts))).name
        self.coordinators[name] = self.hosts[name].runworkers("--worker", "stress")
        print(f"  {name}: runworkers {self.coordinators[name].pid} "
              f"(log {getattr(self.coordinators[name], 'log', '-')})", flush=True)

    def add(self, n: int) -> None:
        from tests.testapp.models import StressJob

        StressJob.objects.bulk_create([StressJob(delay=self.delay) for _ in range(n)])

    def host(self, name: str):
        if name not in self.hosts:
            raise ValueError(f"no host {name!r}: one of {sorted(self.hosts)}")
        return self.hosts[name]

    def commands(self) -> dict[str, Callable[..., object]]:
        return {**super().commands(),
                "cut": lambda name: self.host(name).cut(),
                "heal": lambda name: self.host(name).heal()}


class FailoverLab(Lab):
    def __init__(self, pair, env: dict[str, str], delay: float) -> None:
        super().__init__(lambda sql: pair.current.query(sql, database=FAILOVER_DATABASE), delay)
        self.pair = pair
        self.env = env
        self.outputs: list = []

    def start(self, name: str | None) -> None:
        from tests.helpers import runworkers
        from tests.processes import Output

        proc = runworkers("--worker", "stress", env=self.env)
        self.outputs.append(Output(proc))
        self.coordinators["local"] = proc
        print(f"  runworkers {proc.pid}", flush=True)

    def add(self, n: int) -> None:
        self.pair.current.query("INSERT INTO testapp_stressjob (delay) SELECT %s "
                                "FROM generate_series(1, %s)", (self.delay, n),
                                database=FAILOVER_DATABASE)

    def failover(self) -> None:
        if self.pair.failed_over:
            raise ValueError("already failed over: the replica is the primary now")
        self.pair.stop_primary()
        stopped = time.monotonic()
        self.pair.promote()
        print(f"  primary stopped, replica promoted in {time.monotonic() - stopped:.1f}s",
              flush=True)

    def commands(self) -> dict[str, Callable[..., object]]:
        return {**super().commands(), "lag": lambda: self.lag(), "failover": lambda: self.failover()}

    def lag(self) -> None:
        if self.pair.failed_over:
            raise ValueError("after a failover there is no replica left to lag")
        self.pair.cut_replication()

    def stderr(self) -> str:
        return "".join(o.err for o in self.outputs)


@contextmanager
def hosts_lab(args: argparse.Namespace) -> Iterator[Lab]:
    # A database of the lab's own (made and dropped here), never a test run's.
    os.environ["DBWORKER_TEST_RUN_ID"] = f"lab_{os.getpid()}"
    os.environ.pop("DBWORKER_TEST_USE_TEST_DB", None)
    os.environ["DJANGO_SETTINGS_MODULE"] = "tests.settings"
    if os.environ.get("DBWORKER_TEST_DB", "sqlite") == "sqlite":
        raise SystemExit("hosts need a database server: set DBWORKER_TEST_DB=postgres or mysql")
    import django

    django.setup()
    from django.db import connection

    from tests.hosts import Hosts, unavailable

    require(unavailable())
    old_name = connection.creation.create_test_db(verbosity=0, autoclobber=True, serialize=False)
    names = [f"host-{chr(ord('a') + i)}" for i in range(args.hosts)]
    try:
        with Hosts(names, Path(tempfile.mkdtemp(prefix="dbworker-lab-"))) as hosts:
            lab = HostsLab(hosts, args.delay)
            for name in names:
                lab.start(name)
            lab.add(args.rows)
            yield lab
    finally:
        # After Hosts has stopped every coordinator: nothing is connected to it any more.
        connection.creation.destroy_test_db(old_name, verbosity=0)


@contextmanager
def failover_lab(args: argparse.Namespace) -> Iterator[Lab]:
    os.environ["DBWORKER_TEST_DB"] = "postgres"
    os.environ["DJANGO_SETTINGS_MODULE"] = "tests.settings"
    import django

    django.setup()
    from tests import replica
    from tests.helpers import kill_started, settings_module, subprocess_env

    # A pair of the lab's own: never the clusters a test run may be using.
    require(replica.unavailable((5443, 5444), prefix="dbwlab"))
    with replica.ReplicaPair(5443, 5444, prefix="dbwlab") as pair:
        pair.primary.query(f"CREATE DATABASE {FAILOVER_DATABASE}")
        workdir = Path(tempfile.mkdtemp(prefix="dbworker-lab-"))
        env = settings_module(workdir, (
            f"DATABASES = {{'default': {{'ENGINE': 'django.db.backends.postgresql', "
            f"'NAME': {FAILOVER_DATABASE!r}, **{pair.host_settings()!r}}}}}\n"))
        subprocess.run([sys.executable, "-m", "django", "migrate", "-v", "0"], cwd=ROOT,
                       env=subprocess_env(**env), check=True, timeout=180)
        lab = FailoverLab(pair, env, args.delay)
        try:
            lab.start("local")
            lab.add(args.rows)
            yield lab
        finally:
            kill_started()
            log = workdir / "runworkers.log"
            log.write_text(lab.stderr())
            print(f"runworkers' log: {log}")


def require(reason: str | None) -> None:
    """The harness's own check (root, tools): a one-line error where it cannot run."""
    if reason is not None:
        raise SystemExit(f"lab: {reason}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=["hosts", "failover"])
    parser.add_argument("--rows", type=int, default=1000, help="rows at the start (1000)")
    parser.add_argument("--delay", type=float, default=0.02,
                        help="seconds each handler sleeps (0.02)")
    parser.add_argument("--hosts", type=int, default=3, help="hosts (3)")
    parser.add_argument("--commands", help="commands separated by ';' instead of stdin")
    args = parser.parse_args()
    # Ctrl-C, SIGTERM and SIGHUP (a closed terminal) end the lab through the clean-up of
    # everything it made; a second signal during that clean-up is ignored.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _interrupted)
    try:
        with (hosts_lab if args.kind == "hosts" else failover_lab)(args) as lab:
            return lab.run(args.commands)
    except KeyboardInterrupt:
        return 130


def _interrupted(signum: int, frame: object) -> None:
    for ignored in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(ignored, signal.SIG_IGN)
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
