"""The /metrics, /healthz and /readyz server cannot be knocked over, and never takes the
coordinator with it: stalled requests, TLS handshakes, hang-ups, a crowd of scrapers and
a low file limit; and every event the coordinator counts reaches its metrics."""

from __future__ import annotations

import ast
import logging
import os
import re
import resource
import selectors
import socket
import struct
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily

from django_dbworker import Coordinator
from django_dbworker.models import Execution
from django_dbworker.operations import probes
from django_dbworker.operations.events import EVENTS, UnknownEvent
from django_dbworker.operations.metrics import Backlog, Metrics
from django_dbworker.operations.probes import ProbeServer
from django_dbworker.registration.options import METRICS_HOST, Options
from django_dbworker.registration.registry import registry
from django_dbworker.status import ExecutionStatus
from tests.helpers import claim, execution, runworkers, wait_for
from tests.processes import Output
from tests.testapp.models import Document

PACKAGE = Path(__file__).resolve().parent.parent / "django_dbworker"
TLS_CLIENT_HELLO = bytes.fromhex("16030100c4010000c00303") + os.urandom(32) + b"\x00" * 40


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(port: int, path: str, timeout: float = 10) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def healthz(port: int, timeout: float = 2) -> int | None:
    """/healthz's status, or None when it does not answer (yet) within ``timeout``."""
    try:
        return get(port, "/healthz", timeout)[0]
    except (urllib.error.URLError, OSError):
        return None


def metric(port: int, name: str, worker: str = "docs") -> float | None:
    text = get(port, "/metrics")[1].decode()
    found = re.search(rf'^{name}{{queue="",worker="{worker}"}} (\S+)$', text, re.M)
    return float(found[1]) if found else None


def alive() -> dict:
    return {"last_pass": time.monotonic(), "database": True, "children_ready": True,
            "stopping": False}


def descriptors_on(port: int) -> int:
    """This process's open descriptors of connections accepted on local ``port`` (the
    server's side: the kernel's accept queue holds none)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] != "0A":  # (LISTEN)
                inodes.add(fields[9])
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # (closed meanwhile)
        count += target.startswith("socket:[") and target[8:-1] in inodes
    return count


def closed_by_server(sock: socket.socket, within: float) -> bool:
    """Whether the server closes ``sock`` within ``within`` seconds (what it sent first
    is read and ignored)."""
    sock.settimeout(within)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return False
    except ConnectionError:
        pass
    return True


@pytest.fixture
def server():
    made: list[ProbeServer] = []

    def make(registry: CollectorRegistry | None = None, backlog: Backlog | None = None,
             state=alive) -> ProbeServer:
        made.append(ProbeServer(0, registry or CollectorRegistry(), state, "127.0.0.1", backlog))
        made[-1].start()
        return made[-1]

    yield make
    for s in made:
        s.stop()


def probe_lines(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "django_dbworker.probes"]


# -- the server, in this process --------------------------------------------------------------
def test_a_stalled_request_and_a_tls_handshake_are_closed_with_one_line_each(server, caplog,
                                                                            monkeypatch, capfd):
    monkeypatch.setattr(probes, "REQUEST_SECONDS", 0.5)
    caplog.set_level(logging.DEBUG, logger="django_dbworker.probes")
    s = server()
    stalled = socket.create_connection(("127.0.0.1", s.port), timeout=5)
    stalled.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
    tls = socket.create_connection(("127.0.0.1", s.port), timeout=5)
    tls.sendall(TLS_CLIENT_HELLO)
    try:
        assert tls.recv(100).startswith(b"HTTP/1.1 400 ")  # at once: it is no HTTP
        assert closed_by_server(tls, within=5)
        assert closed_by_server(stalled, within=5)  # after REQUEST_SECONDS
    finally:
        stalled.close()
        tls.close()
    assert get(s.port, "/healthz")[0] == 200
    lines = [r.getMessage() for r in probe_lines(caplog) if r.levelno == logging.DEBUG]
    for why in ("sent no complete request within 0.5 s",
                "sent something else than an HTTP request"):
        assert sum(why in line for line in lines) == 1, lines
    assert len(lines) == 2, lines
    assert not any(r.exc_info for r in caplog.records)
    assert "Traceback" not in capfd.readouterr().err
    warnings = [r.getMessage() for r in probe_lines(caplog) if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "closed 1 client connection(s)" in warnings[0], warnings


def test_a_crowd_of_stalled_clients_holds_a_few_descriptors_and_healthz_gets_through(server):
    s = server()
    crowd, stalled, most = [], set(), 0
    try:
        for _ in range(100):
            c = socket.socket()
            c.setblocking(False)
            c.connect_ex(("127.0.0.1", s.port))
            crowd.append(c)
        # Each sends half a request as soon as it is connected (the kernel retries those
        # it could not queue), then nothing.
        until = time.monotonic() + 4
        while time.monotonic() < until:
            for c in crowd:
                if c not in stalled:
                    try:
                        c.send(b"GET /healthz HTTP/1.1\r\n")
                        stalled.add(c)
                    except OSError:
                        pass  # (not connected yet)
            most = max(most, descriptors_on(s.port))
            time.sleep(0.05)
        print(f"\n{len(stalled)} stalled clients; the server held {most} at most, "
              f"{descriptors_on(s.port)} now")
        assert most <= probes.connection_limit() <= probes.MAX_CONNECTIONS
        # The slowest are dropped for a newcomer: a probe is answered, crowd or not.
        for _ in range(3):
            began = time.monotonic()
            assert get(s.port, "/healthz", timeout=5)[0] == 200
            print(f"/healthz answered in {time.monotonic() - began:.3f}s")
        assert descriptors_on(s.port) <= probes.connection_limit()
    finally:
        for c in crowd:
            c.close()


def test_a_client_hanging_up_mid_response_costs_one_line_and_no_traceback(server, caplog,
                                                                           capfd):
    caplog.set_level(logging.DEBUG, logger="django_dbworker.probes")
    class BigPage:  # (larger than the sockets' buffers can take: up to 4 MB on Linux)
        def collect(self):
            yield GaugeMetricFamily("big", "x" * 16_000_000, value=1)

    big = CollectorRegistry()
    big.register(BigPage())
    s = server(big)
    for _ in range(5):
        c = socket.socket()
        c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        c.settimeout(5)
        c.connect(("127.0.0.1", s.port))
        c.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")
        c.recv(1000)
        c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        c.close()  # a reset, mid-response
    wait_for(lambda: descriptors_on(s.port) == 0, timeout=10)
    assert get(s.port, "/healthz")[0] == 200
    lines = [r.getMessage() for r in probe_lines(caplog) if r.levelno == logging.DEBUG]
    assert len(lines) == 5 and all("hung up before reading the whole response" in line
                                   for line in lines), lines
    assert not any(r.exc_info for r in caplog.records)
    assert "Traceback" not in capfd.readouterr().err


def test_a_scrape_that_found_the_figures_stale_as_a_read_ended_asks_for_no_second_read(server):
    """The race the test below met beside another CI lane (a second read in 2 of 3 runs,
    whatever the reading's age), made to happen here: a scrape checks the figures (stale: the read
    is under way), the read ends (the figures are fresh, no read is under way), and the
    scrape, finding none under way, asks for one. The backlog's thread reads only figures
    still stale: one read for both scrapes."""
    reads: list[int] = []
    checked = threading.Event()
    calls: list[str] = []

    class Racing(Backlog):
        def stale(self, now=None):
            result = super().stale(now)
            if threading.current_thread().name == "dbworker-probes":
                calls.append("server")
                if len(calls) == 2:  # the second scrape's check, while the read is under way
                    checked.set()
                    time.sleep(0.3)  # the read ends meanwhile
            return result

    def read() -> dict:
        checked.wait(10)  # the read ends only once the second scrape has looked
        reads.append(1)
        return {"docs": (3, 1.0)}

    backlog = Racing(read, max_age=600.0)
    metrics = Metrics([registry["docs"]], backlog, lambda: {"docs": 0})
    s = server(metrics.registry, backlog)
    pages: list = []
    first = threading.Thread(target=lambda: pages.append(get(s.port, "/metrics")))
    first.start()
    time.sleep(0.2)
    pages.append(get(s.port, "/metrics"))
    first.join()
    assert [status for status, _ in pages] == [200, 200]
    assert checked.is_set() and reads == [1], (calls, reads)


def test_scrapes_read_the_backlog_at_most_every_few_seconds_on_the_servers_thread(server):
    reads: list[str] = []
    gate = threading.Event()
    gate.set()

    def read() -> dict:
        gate.wait()
        reads.append(threading.current_thread().name)
        return {"docs": (7, 10.0)}

    # Older than max_age, a reading is read again: an age longer than the 200 scrapes
    # take on a loaded machine (they once outlasted the default's 5 s), so one read is
    # what caching allows, and a second would be a scrape reading for itself.
    backlog = Backlog(read, max_age=600.0)
    metrics = Metrics([registry["docs"]], backlog, lambda: {"docs": 0})
    s = server(metrics.registry, backlog)
    pages = []

    def scrape() -> None:
        for _ in range(5):
            pages.append(get(s.port, "/metrics"))

    scrapers = [threading.Thread(target=scrape) for _ in range(40)]
    for t in scrapers:
        t.start()
    for t in scrapers:
        t.join()
    assert len(pages) == 200 and all(status == 200 for status, _ in pages)
    assert all(b'dbworker_pending_rows{queue="",worker="docs"} 7.0' in page for _, page in pages)
    assert reads == ["dbworker-probes-backlog"]  # 200 scrapes, one read, not theirs
    # A read that hangs (the database is away) holds a scrape BACKLOG_WAIT_SECONDS at
    # most, and /healthz not at all.
    gate.clear()
    backlog.max_age = 0.0
    began = time.monotonic()
    result: list = []
    waiting = threading.Thread(target=lambda: result.append(get(s.port, "/metrics")))
    waiting.start()
    time.sleep(0.2)
    assert get(s.port, "/healthz", timeout=1)[0] == 200
    waiting.join()
    assert result[0][0] == 200 and b"dbworker_pending_rows" in result[0][1]
    assert probes.BACKLOG_WAIT_SECONDS <= time.monotonic() - began < probes.BACKLOG_WAIT_SECONDS + 2
    gate.set()


# -- the events counted ------------------------------------------------------------------------
def counted_names() -> set[str]:
    """Every literal event name the package counts: ``count(worker, "name", ...)`` and
    ``stats["name"]`` (a conditional of two literals counts both)."""

    def literals(node: ast.AST) -> set[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return {node.value}
        if isinstance(node, ast.IfExp):
            return literals(node.body) | literals(node.orelse)
        return set()

    found: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "count" and len(node.args) >= 2):
                found |= literals(node.args[1])
            elif (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute)
                    and node.value.attr == "stats"):
                found |= literals(node.slice)
    return found


def test_an_unknown_event_is_an_error_and_every_event_counted_is_listed():
    metrics = Metrics([registry["docs"]], Backlog(dict), lambda: {})
    with pytest.raises(UnknownEvent, match="'recoverd'"):
        metrics.count("docs", "recoverd")
    names = counted_names()
    assert {"claimed", "released", "lost", "crashed", "interrupted", "recovered"} <= names
    # A child reports its rows' new status (or "retried"), counted as they come.
    reported = {ExecutionStatus.FINISHED, ExecutionStatus.UNFINISHED, ExecutionStatus.FAILED,
                "retried"}
    assert names | reported <= set(EVENTS), (names | reported) - set(EVENTS)
    for event in EVENTS:
        metrics.count("docs", event)
        assert metrics.registry.get_sample_value(
            f"dbworker_{event}_total", {"worker": "docs", "queue": ""}) == 1
    assert Coordinator(["docs"]).stats_line().split(", ") == [f"{e} 0" for e in EVENTS]


@pytest.mark.django_db(transaction=True)
def test_recovered_and_interrupted_runs_reach_the_metrics():
    port = free_port()
    abandoned = Document.objects.create()
    [held] = claim("docs", claimer="gone-machine:1")  # its holder never comes back
    Execution.objects.filter(pk=held.execution_id).update(lease_expires_at="2000-01-01T00:00:00Z")
    proc = runworkers("--worker", "docs", "--metrics-port", str(port))
    output = Output(proc)
    try:
        wait_for(lambda: execution("docs", abandoned).status == "finished", timeout=60)
        wait_for(lambda: metric(port, "dbworker_recovered_total") == 1, timeout=30)
        if os.environ.get("DBWORKER_TEST_DB", "sqlite") != "sqlite":  # (a connection to lose)
            cut = Document.objects.create(behaviour="lose_connection")
            wait_for(lambda: (metric(port, "dbworker_interrupted_total") or 0) >= 1, timeout=30)
            Document.objects.filter(pk=cut.pk).update(behaviour="ok")
            # Cured, it finishes; or, interrupted max_crashes times in a row before the
            # cure was seen (each retry comes at once), it has ended failed.
            wait_for(lambda: execution("docs", cut).status in ("finished", "failed"), timeout=60)
    finally:
        proc.terminate()
        assert output.wait(timeout=60) == 0, output.err
    assert re.search(r"stopped: .*interrupted \d+, recovered 1$", output.err, re.M), output.err


# -- --metrics-host ---------------------------------------------------------------------------
@pytest.mark.django_db(transaction=True)
def test_metrics_host_says_where_the_server_listens():
    assert Options.build([registry["docs"]], {}).metrics_host == METRICS_HOST == "0.0.0.0"
    for wrong in ("", " ", 127001):
        with pytest.raises(ImproperlyConfigured, match="metrics_host must be an address"):
            Options.build([registry["docs"]], {"metrics_host": wrong})
    coordinator = Coordinator(["docs"], metrics_port=0, metrics_host="127.0.0.1")
    coordinator.start()
    try:
        assert coordinator.probes is not None
        assert coordinator.probes.listener.getsockname()[0] == "127.0.0.1"
        assert get(coordinator.probes.port, "/healthz")[0] == 200
    finally:
        coordinator.stop()


# -- the whole process, under attack ----------------------------------------------------------
class Flood:
    """Bad clients and a crowd of scrapers against one port, from threads of this process.
    ``ports`` counts the local port of every connection made, to match the server's log."""

    def __init__(self, port: int, *, stalled: int, scrapers: int, tls: int, hang_ups: int):
        self.port, self.stalled, self.tls, self.hang_ups = port, stalled, tls, hang_ups
        self.ports: Counter[int] = Counter()
        self.scrapes = Counter[str]()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._stall, daemon=True),
                        threading.Thread(target=self._misbehave, daemon=True),
                        *(threading.Thread(target=self._scrape, daemon=True)
                          for _ in range(scrapers))]
        self.opened = 0

    def __enter__(self) -> Flood:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)

    def _connect(self, blocking: bool = True) -> socket.socket:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.ports[sock.getsockname()[1]] += 1
        if blocking:
            sock.settimeout(10)
            sock.connect(("127.0.0.1", self.port))
        else:
            sock.setblocking(False)
            sock.connect_ex(("127.0.0.1", self.port))
        return sock

    def _stall(self) -> None:
        """Keep ``stalled`` connections open that send half a request, then nothing."""
        selector = selectors.DefaultSelector()
        try:
            while not self.stop.is_set():
                while len(selector.get_map()) < self.stalled:
                    selector.register(self._connect(blocking=False), selectors.EVENT_WRITE)
                    self.opened += 1
                for key, _ in selector.select(0.1):
                    sock = key.fileobj
                    try:
                        if key.events == selectors.EVENT_WRITE:  # connected
                            sock.send(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
                            selector.modify(sock, selectors.EVENT_READ)
                            continue
                        if sock.recv(4096):
                            continue  # (an answer? there is none to a half request)
                    except OSError:
                        pass
                    selector.unregister(sock)  # closed by the server: open another
                    sock.close()
        finally:
            for key in list(selector.get_map().values()):
                key.fileobj.close()
            selector.close()

    def _misbehave(self) -> None:
        """TLS handshakes, and clients that reset the connection mid-response."""
        for n in range(max(self.tls, self.hang_ups)):
            if self.stop.is_set():
                return
            for kind, count in (("tls", self.tls), ("hang up", self.hang_ups)):
                if n >= count:
                    continue
                try:
                    sock = self._connect()
                    sock.sendall(TLS_CLIENT_HELLO if kind == "tls" else
                                 b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
                    if kind == "hang up":
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    sock.close()
                except OSError:
                    pass
            time.sleep(0.2)

    def _scrape(self) -> None:
        while not self.stop.is_set():
            try:
                with self._connect() as sock:
                    sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
                    page = b""
                    while chunk := sock.recv(65536):
                        page += chunk
                self.scrapes["ok" if page.startswith(b"HTTP/1.1 200 ") else "bad"] += 1
            except OSError:
                self.scrapes["failed"] += 1
                time.sleep(0.05)


def limit_files() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (200, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))


@pytest.mark.django_db(transaction=True)
def test_a_flood_of_bad_clients_and_scrapers_under_a_low_file_limit_stops_nothing():
    """400 stalled requests (kept up: each one closed is opened again), TLS handshakes,
    resets mid-response and 40 scrapers without a pause, against a coordinator limited to
    200 files. Meanwhile it drains rows, and a child dies and is replaced (a pipe: two
    descriptors it must find). It keeps running and draining; /healthz answers once the
    flood ends; no traceback, and one log line at most for each bad client."""
    port = free_port()
    proc = runworkers("--worker", "docs", "--metrics-port", str(port), "--metrics-host",
                      "127.0.0.1", "-v", "2", preexec_fn=limit_files)
    output = Output(proc)
    try:
        wait_for(lambda: healthz(port) == 200, timeout=60)
        with Flood(port, stalled=400, scrapers=40, tls=20, hang_ups=30) as flood:
            wait_for(lambda: flood.opened >= 400, timeout=30)
            time.sleep(2)  # the server is full: the flood is on
            crash = Document.objects.create(behaviour="crash")  # its child dies
            docs = Document.objects.bulk_create([Document() for _ in range(200)])
            for _ in range(10):
                time.sleep(1)
                assert proc.poll() is None, output.err[-3000:]
            during = Execution.objects.filter(worker="docs", status="finished").count()
        print(f"\nduring the flood: {flood.opened} stalled connections, {flood.scrapes}, "
              f"{during} rows finished")
        assert proc.poll() is None, output.err[-3000:]
        began = time.monotonic()
        wait_for(lambda: healthz(port) == 200, timeout=15)
        print(f"/healthz answered {time.monotonic() - began:.2f}s after the flood")
        wait_for(lambda: Execution.objects.filter(
            worker="docs", source_id__in=[str(d.pk) for d in docs], status="finished"
        ).count() == len(docs), timeout=60)
        # Children died, and were replaced while the flood went on (the rows ran).
        assert (metric(port, "dbworker_crashed_total") or 0) >= 1
        Document.objects.filter(pk=crash.pk).update(behaviour="ok")
        assert flood.scrapes["ok"] > 0
    finally:
        proc.terminate()
        code = output.wait(timeout=60)
    err = output.err
    assert code == 0, err[-3000:]
    assert "Traceback" not in err and "Too many open files" not in err, err[-3000:]
    logged = Counter(int(m[1]) for m in re.finditer(r"Probe client 127\.0\.0\.1:(\d+) ", err))
    assert logged, err[-3000:]  # (-v 2: one DEBUG line per client closed)
    assert all(n <= flood.ports[p] for p, n in logged.items()), [
        (p, n, flood.ports[p]) for p, n in logged.items() if n > flood.ports[p]]
    assert sum(logged.values()) <= flood.opened + flood.tls + flood.hang_ups
