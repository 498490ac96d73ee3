"""Shared test helpers: run coordinators in this process or as real `runworkers` processes."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from django.conf import settings

from django_dbworker import Coordinator
from django_dbworker.models import Execution
from tests.testapp.models import Effect

ROOT = Path(__file__).resolve().parent.parent


def drain(*workers: str, **overrides) -> Counter:
    return Coordinator(list(workers) or None, **overrides).drain()


def effects(worker: str) -> Counter:
    return Counter(Effect.objects.filter(worker=worker).values_list("source_id", flat=True))


def lost_and_twice(worker: str, ids: set[str]) -> tuple[int, int]:
    """Of the source rows ``ids``: how many have no effect, and how many more than one."""
    counted = effects(worker)
    return len(ids - set(counted)), sum(1 for source in ids if counted[source] > 1)


def subprocess_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        DJANGO_SETTINGS_MODULE="tests.settings",
        DBWORKER_TEST_USE_TEST_DB="1",
        DBWORKER_TEST_RUN_ID=settings.RUN_ID,
        DBWORKER_TEST_DB=settings.DB,
        PYTHONPATH=str(ROOT),
    )
    env.update(extra)
    return env


def run_lab(*args: str, timeout: float, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess:
    """``scripts/lab.py ARGS``; past ``timeout`` it gets SIGTERM, which it answers by
    removing what it made (namespaces, clusters, its database) before it exits."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "lab.py"), *args],
                            env={**os.environ, **(env or {})}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        out, err = proc.communicate(timeout=180)
        raise AssertionError(f"scripts/lab.py {' '.join(args)} ran past {timeout}s:\n{out}{err}"
                             ) from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


STARTED: list[subprocess.Popen] = []


def runworkers(*args: str, env: dict[str, str] | None = None, **popen) -> subprocess.Popen:
    """A real `manage.py runworkers` process on the test database (killed, with its
    children, when the test ends: see conftest); ``env`` adds environment variables."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "django", "runworkers", *args],
        cwd=ROOT, env=subprocess_env(**(env or {})), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True, **popen,
    )
    STARTED.append(proc)
    return proc


def settings_module(tmp_path: Path, body: str) -> dict[str, str]:
    """An environment whose settings module is the test settings plus ``body``."""
    import textwrap

    name = f"dbworker_settings_{len(list(tmp_path.glob('dbworker_settings_*.py')))}"
    (tmp_path / f"{name}.py").write_text("from tests.settings import *  # noqa: F403\n"
                                         + textwrap.dedent(body))
    return {"DJANGO_SETTINGS_MODULE": name, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}


def run_with_settings(tmp_path: Path, body: str, *args: str, timeout: float = 120,
                      drain: bool = True) -> tuple[int, str, str]:
    """`runworkers [--drain] ARGS` under the test settings changed by ``body``."""
    proc = runworkers(*(["--drain"] if drain else []), *args, env=settings_module(tmp_path, body))
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def kill_started() -> None:
    import signal

    while STARTED:
        proc = STARTED.pop()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)


def wait_for(predicate: Callable[[], object], timeout: float = 30, interval: float = 0.05,
             state: Callable[[], object] | None = None):
    """``predicate``'s first true value; past ``timeout`` an AssertionError, which shows
    ``state()`` (what was there instead) when given."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    seen = f": {state()!r}" if state is not None else ""
    raise AssertionError(f"condition not met within {timeout}s{seen}")


def running_marker(worker: str, key) -> Path:
    """The file a test handler writes when it starts (see testapp.workers.pid_file),
    cleared of any earlier run's. A claimed row ("working") may still wait in its
    child's queue; this says the handler itself is running."""
    from tests.testapp.workers import pid_file

    path = pid_file(worker, key)
    path.unlink(missing_ok=True)
    return path


class busy_machine:
    """Keep every core busy (a spinning process per core) while the block runs: races
    hide on an idle machine."""

    def __init__(self, processes: int | None = None) -> None:
        self.processes = processes or os.cpu_count() or 2
        self.spinners: list[subprocess.Popen] = []

    def __enter__(self) -> busy_machine:
        self.spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                         for _ in range(self.processes)]
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.spinners:
            p.kill()
            p.wait(timeout=30)


def counting_probes(coordinator: Coordinator) -> list[float]:
    """A list that gets the time (monotonic) of each change probe the running
    ``coordinator`` makes from now on."""
    assert coordinator.bridge is not None
    probes: list[float] = []
    change_token = coordinator.bridge.change_token

    def counted():
        probes.append(time.monotonic())
        return change_token()

    coordinator.bridge.change_token = counted  # looked up on each probe
    return probes


def seconds_to_claim() -> float:
    """Insert a Document; the seconds from its commit until its ``docs`` row is claimed."""
    from tests.testapp.models import Document

    doc = Document.objects.create()
    committed = time.monotonic()
    wait_for(lambda: execution("docs", doc).status != "pending", timeout=30, interval=0.005)
    return time.monotonic() - committed


def execution(worker: str, obj) -> Execution:
    """This row's Execution for ``worker`` (``obj``: an instance or a primary key)."""
    from django_dbworker.api import source_key
    from django_dbworker.registration.registry import registry

    return Execution.objects.get(worker=worker, source_id=source_key(registry[worker], obj))


def claim(worker: str, limit: int = 1, claimer: str = "test:1", *, contended: bool = False,
          **bridge_options) -> list:
    """Claim rows through a Bridge of its own, as another coordinator would.

    ``contended``: a claim that loses a deadlock or a lock wait to another claim is made
    again, as the coordinator's loop does (races of many claimers on a loaded machine: a
    claim may wait past LOCK_WAIT_SECONDS for the one holding the worker's lock row)."""
    from django_dbworker.registration.registry import registry
    from django_dbworker.store.bridge import Bridge

    bridge = Bridge(**bridge_options)
    try:
        attempts = 10 if contended else 1
        for attempt in range(1, attempts + 1):
            try:
                return bridge.claim(registry[worker], limit, claimer)
            except Exception as exc:
                if attempt == attempts or not bridge.vendor.is_deadlock(exc):
                    raise
    finally:
        bridge.close()


def claim_and_run_group(worker_name, n, tamper=None, *, monkeypatch):
    """Claim n rows and run them as one group in this process (what a child does).

    The group's time budget is raised so that a busy machine cannot split the group: these
    tests are about outcomes inside one transaction, not about the deadline."""
    from collections import deque
    from multiprocessing.sharedctypes import RawArray, RawValue

    from django_dbworker.processes import groups
    from django_dbworker.processes.groups import run_group
    from django_dbworker.processes.protocol import SLOT_SIZE
    from django_dbworker.registration.registry import registry

    monkeypatch.setattr(groups, "GROUP_SECONDS", 60.0)
    claims = claim(worker_name, n, "test:group")
    if tamper:
        tamper(claims)
    pending = deque(c.delivery(c.execution_id) for c in claims)  # seq: the execution id
    results = run_group(registry[worker_name], "default", pending, RawArray("d", SLOT_SIZE),
                        RawValue("b", 0))
    return claims, results, pending


def statements_of(run):
    """The SQL that ``run()`` sends on the default connection, in order."""
    from django.db import connection

    sent = []

    def record(execute, sql, params, many, context):
        sent.append(sql)
        return execute(sql, params, many, context)

    with connection.execute_wrapper(record):
        result = run()
    return sent, result


def insert_raw(model, **values) -> None:
    """INSERT a row with raw SQL (not the ORM): another program writing the table."""
    from django.db import connection

    table = connection.ops.quote_name(model._meta.db_table)
    columns = ", ".join(connection.ops.quote_name(model._meta.get_field(k).column) for k in values)
    marks = ", ".join(["%s"] * len(values))
    with connection.cursor() as cursor:
        cursor.execute(f"INSERT INTO {table} ({columns}) VALUES ({marks})", list(values.values()))


def mark_failed(executions, message: str = "cannot handle it") -> None:
    """Make these executions FAILED as a handler's failure leaves them."""
    from django.utils import timezone

    executions.update(
        status="failed", attempts=1, error_type="ValueError",
        error_message=f"{message}\nsecond line",
        error_traceback=f'Traceback (most recent call last):\n  File "w.py", line 3\nValueError: {message}',
        finished_at=timezone.now(), claimed_by="host:1", claim_token=None, lease_expires_at=None)


def session_processes(session: int) -> list[int]:
    """Live (not zombie) processes of a session: a runworkers process started by
    ``runworkers`` leads its own, which its children (orphaned or not) stay in."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        if fields[0] != "Z" and int(fields[3]) == session:
            pids.append(int(entry))
    return pids


class held_handler:
    """A gate a test handler waits on. The test handlers (testapp.workers) write their pid
    to a marker file when they start: ``pid_file`` for ``sleep:`` rows, ``gate_file(name)``
    for ``hold:<name>`` rows. Made a FIFO whose pipe is full, that write blocks inside the
    handler until the test calls ``release()``; ``wait()`` returns once a process has the
    FIFO open, that is once the handler is running and held.

    No fixed window: a signal sent between ``wait()`` and ``release()`` surely lands
    while the handler runs (``sleep:0`` then finishes at once when released). Every run
    that reaches the gate before ``release()`` is held there (a row run again by a
    replacement child, say); runs after it pass straight through."""

    def __init__(self, worker: str | None = None, key=None, *, gate: str | None = None) -> None:
        from tests.testapp.workers import gate_file

        self.path = running_marker(worker, key) if gate is None else gate_file(gate)
        self.path.unlink(missing_ok=True)
        os.mkfifo(self.path)
        self._releasing = threading.Lock()  # release() may come from a timer thread too
        st = os.stat(self.path)
        self._inode = (st.st_dev, st.st_ino)
        # Our own read and write ends: the handler's open() does not wait for a reader,
        # and its write finds the pipe full.
        self._read: int | None = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        self._write = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
        try:
            while True:
                os.write(self._write, b"x" * 4096)
        except BlockingIOError:
            pass
        try:
            while True:
                os.write(self._write, b"x")
        except BlockingIOError:
            pass

    def openers(self) -> list[int]:
        """Processes other than this one with the gate open (the held handlers)."""
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                for fd in os.listdir(f"/proc/{entry}/fd"):
                    st = os.stat(f"/proc/{entry}/fd/{fd}")
                    if (st.st_dev, st.st_ino) == self._inode:
                        found.append(int(entry))
                        break
            except OSError:
                continue  # exited meanwhile, or not ours to read
        return found

    def wait(self, timeout: float = 60, besides: tuple[int, ...] = ()) -> int:
        """Until a handler (other than the pids ``besides``) is running, held at the gate;
        returns its pid."""
        return wait_for(lambda: [p for p in self.openers() if p not in besides],
                        timeout=timeout)[0]

    def release(self) -> None:
        """Let the held handlers go on, and later runs pass: a plain file takes the FIFO's
        name (so no later run can block on it), then the pipe is emptied until every
        held handler has written its pid and closed it."""
        with self._releasing:
            self._release()

    def _release(self) -> None:
        if self._read is None:
            return
        open_gate = self.path.with_name(self.path.name + ".open")
        open_gate.write_text("")
        os.replace(open_gate, self.path)
        os.close(self._write)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if os.read(self._read, 65536) == b"" and not self.openers():
                    break  # every writer closed: the handlers wrote their pids and went on
            except BlockingIOError:
                if not self.openers():
                    break
                time.sleep(0.01)
        os.close(self._read)
        self._read = None

    def __enter__(self) -> held_handler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def analyze(*models) -> None:
    """Fresh planner statistics for these models' tables (before an EXPLAIN test)."""
    from django.db import connection

    sql = {"postgresql": "ANALYZE {}", "mysql": "ANALYZE TABLE {}", "sqlite": "ANALYZE"}[
        connection.vendor]
    with connection.cursor() as cursor:
        for model in models:
            cursor.execute(sql.format(connection.ops.quote_name(model._meta.db_table)))
            if connection.vendor == "mysql":
                cursor.fetchall()


@contextmanager
def without_trigger(name: str, model) -> Iterator[None]:
    """The test database without one of the triggers `migrate` installed (``name``, on
    ``model``'s table) while the block runs; every trigger is installed again after."""
    from django.db import connection

    from django_dbworker.installation.triggers import install
    from django_dbworker.vendors import for_connection

    with connection.cursor() as cursor:
        for sql in for_connection(connection).drop_trigger_sql(name, model._meta.db_table):
            cursor.execute(sql)
    try:
        yield
    finally:
        install("default")


def skip_or_fail(what: str, reason: str) -> None:
    """A test that cannot run here: skipped with the reason, or, with CI=true, failed (a
    green CI must have run it)."""
    import pytest

    if os.environ.get("CI") == "true":
        pytest.fail(f"cannot {what} and CI=true: {reason}")
    pytest.skip(f"cannot {what}: {reason}")


# -- the claim's statements, for EXPLAIN ---------------------------------------------------
def candidates(bridge, worker, limit: int):
    """A worker's claim candidates (the SELECT its claim locks), from the start of its
    rows; and whether their order is a custom one."""
    from django_dbworker.store.claims import FLOOR

    claims = bridge.claims
    stmt, custom = claims._candidates(worker, limit, claims.eligible_sql(worker))
    return stmt.params({FLOOR: 0}), custom


def claim_sql(bridge, worker, limit: int = 1) -> str:
    """The candidate SELECT as the database sees it."""
    stmt, _ = candidates(bridge, worker, limit)
    return str(stmt.compile(bridge.engine, compile_kwargs={"literal_binds": True}))


def execute(bridge, sql: str) -> list:
    with bridge.engine.connect() as conn:
        return list(conn.exec_driver_sql(sql).all())


def at_once(threads: int, rounds: int, step: Callable[[int], list]) -> list:
    """``step(n)`` in ``threads`` threads, each with a database connection of its own,
    ``rounds`` times, every round started together (a barrier); every value the steps
    returned, in the order they came. An error in a thread fails the caller."""
    import threading

    from django.db import connections

    barrier = threading.Barrier(threads)
    found: list = []
    errors: list[BaseException] = []

    def run(n: int) -> None:
        try:
            for _ in range(rounds):
                barrier.wait(timeout=60)
                found.extend(step(n))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            barrier.abort()
        finally:
            connections.close_all()

    pool = [threading.Thread(target=run, args=(n,)) for n in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(timeout=180)
    assert not errors, errors
    return found
