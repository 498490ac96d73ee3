"""``runworkers --metrics-port PORT``: ``/metrics``, ``/healthz`` and ``/readyz`` on one port.

- ``/metrics``: Prometheus text (``prometheus_client``).
- ``/healthz``: 200 while the coordinator's loop is alive (it passed through its loop
  within ``STALL_SECONDS``), else 503: restart me.
- ``/readyz``: 200 while, moreover, the database answers and every pool's children are
  ready, else 503: do not count on me now (a restart would not help during an outage).

The bodies are small JSON objects saying why.

Whoever connects, the server must not hurt the coordinator it reports on. One thread
answers every client (a selector: no thread per connection) and holds at most
``connection_limit()`` connections, so that a flood of clients never takes the file
descriptors the coordinator needs for its children's pipes. A client has
``REQUEST_SECONDS`` to send its request and ``RESPONSE_SECONDS`` to read the answer; one
that does not (a stalled request, a TLS handshake, a hang-up) is closed with one DEBUG
line, and a WARNING sums them up at most once a minute. When the server is full it drops
the client that has waited longest without a complete request, so a crowd of slow clients
cannot keep a liveness probe out. The backlog gauges are read by a second thread of the
server's own, on its own connection (``metrics.Backlog``): a scrape never waits for the
loop or takes one of its connections.
"""

from __future__ import annotations

import errno
import json
import logging
import resource
import selectors
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

if TYPE_CHECKING:
    from .metrics import Backlog

logger = logging.getLogger("django_dbworker.probes")
# The loop passes at least every MAX_POLL_SECONDS when idle; stalled past this, it is hung.
STALL_SECONDS = 30.0
# Prometheus and a liveness probe use one or two connections at a time: 32 is room to
# spare, and few descriptors next to the coordinator's (a pipe and a sentinel per child).
MAX_CONNECTIONS = 32
# A local client sends its request in a millisecond and reads the answer as fast: these
# only end clients that stall (Kubernetes probes time out after 1 s by default).
REQUEST_SECONDS = 5.0
RESPONSE_SECONDS = 5.0
MAX_REQUEST_BYTES = 8192  # a request head: a GET line and a few headers
# A scrape that finds the backlog gauges stale waits this long for them to be read again,
# then is answered with the figures at hand (the database may be down).
BACKLOG_WAIT_SECONDS = 2.0
REPORT_SECONDS = 60.0  # at most one WARNING this often, summing up the clients dropped
# When accept() fails for want of descriptors (the process's, not ours), the clients wait
# in the kernel's queue meanwhile, instead of the thread spinning on them.
ACCEPT_PAUSE_SECONDS = 1.0
LISTEN_BACKLOG = 64
# Connections taken per second, at most (bursts of ACCEPT_BURST): the server's share of
# the process's CPU, which its loop needs, stays a percent or two however many clients
# hammer it; the others wait in the kernel's queue, holding no descriptor of ours.
# Prometheus and the probes make a few connections a minute.
ACCEPTS_PER_SECOND = 100.0
ACCEPT_BURST = 32
FAILURE_LOG_SECONDS = 60.0  # a failure of the server's own: logged at most this often
# A client waiting this long for its request to arrive may be dropped for a newcomer when
# the server is full (a local request arrives in a millisecond).
EVICTABLE_SECONDS = 0.5
# /metrics is rendered at most this often; the scrapes in between get the same text.
RENDER_SECONDS = 1.0
READING, WAITING, WRITING = "reading", "waiting", "writing"
REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
           431: "Request Header Fields Too Large", 503: "Service Unavailable"}


def connection_limit() -> int:
    """MAX_CONNECTIONS, or an eighth of the process's file limit when that is lower."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    return max(1, min(MAX_CONNECTIONS, soft // 8))


class _Client:
    __slots__ = ("sock", "peer", "since", "received", "deadline", "state", "out", "head_only",
                 "noted", "watched")

    def __init__(self, sock: socket.socket, peer: str, now: float) -> None:
        self.sock, self.peer, self.since = sock, peer, now
        self.received = bytearray()
        self.deadline = now + REQUEST_SECONDS
        self.state = READING
        self.out = memoryview(b"")
        self.head_only = False  # a HEAD request
        self.noted = False  # its one log line was written
        self.watched = 0  # the selector events it is registered for


class ProbeServer:
    def __init__(self, port: int, registry: CollectorRegistry,
                 state: Callable[[], dict[str, Any]], host: str = "0.0.0.0",
                 backlog: Backlog | None = None) -> None:
        self.registry, self.state, self.backlog = registry, state, backlog
        self.limit = connection_limit()
        family, _, _, _, address = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
        self.listener = socket.create_server(  # ("::": IPv6 and IPv4 alike, where it can)
            address, family=family, backlog=LISTEN_BACKLOG,
            dualstack_ipv6=address[0] == "::" and socket.has_dualstack_ipv6())
        try:
            self.listener.setblocking(False)
            self.port: int = self.listener.getsockname()[1]
            self._wake_reader, self._wake_writer = socket.socketpair()
            self._wake_reader.setblocking(False)
            self._wake_writer.setblocking(False)
            self.selector = selectors.DefaultSelector()
        except BaseException:
            self.listener.close()
            raise
        self.selector.register(self.listener, selectors.EVENT_READ)
        self.selector.register(self._wake_reader, selectors.EVENT_READ)
        self.clients: dict[socket.socket, _Client] = {}  # oldest first
        self.dropped: Counter[str] = Counter()  # since the last WARNING, by why
        self._next_report = 0.0
        self._accept_paused_until: float | None = None
        self._paused_full = False  # paused because every place was taken
        self._tokens, self._tokens_at = float(ACCEPT_BURST), time.monotonic()
        self._rendered: tuple[bytes, float] | None = None  # /metrics, and when
        self._stopping = False
        self._closed = False
        self._refreshing = False  # a backlog read is asked for or under way
        self._wanted = threading.Event()  # ask the backlog thread for a read
        self._thread = threading.Thread(target=self._serve, name="dbworker-probes",
                                        daemon=True)
        self._backlog_thread = (None if backlog is None else threading.Thread(
            target=self._read_backlog, name="dbworker-probes-backlog", daemon=True))

    def start(self) -> None:
        self._thread.start()
        if self._backlog_thread is not None:
            self._backlog_thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wanted.set()
        self._wake()
        if self._thread.is_alive():
            self._thread.join(10)
        else:
            self._close_all()
        if self._backlog_thread is not None and self._backlog_thread.is_alive():
            self._backlog_thread.join(10)  # (a read under way ends first)
        if self.backlog is not None:
            self.backlog.close()

    # -- the server's thread ------------------------------------------------------------
    def _serve(self) -> None:
        logged = -FAILURE_LOG_SECONDS
        try:
            while not self._stopping:
                try:
                    for key, _ in self.selector.select(self._timeout(time.monotonic())):
                        if self._stopping:
                            break
                        self._ready(key.fileobj)  # type: ignore[arg-type]
                    self._expire(time.monotonic())
                except Exception:  # a bug of ours: the probes must outlive it (a dead
                    # /healthz gets a healthy coordinator restarted)
                    if time.monotonic() - logged >= FAILURE_LOG_SECONDS:
                        logged = time.monotonic()
                        logger.exception("Probe server: a round failed; it goes on")
                    time.sleep(0.1)  # (one that fails again is no busy loop)
        finally:
            self._close_all()

    def _timeout(self, now: float) -> float | None:
        deadlines = [c.deadline for c in self.clients.values()]
        if self._accept_paused_until is not None:
            deadlines.append(self._accept_paused_until)
        if self.dropped:
            deadlines.append(self._next_report)
        return max(min(deadlines) - now, 0.0) if deadlines else None

    def _ready(self, sock: socket.socket) -> None:
        if sock is self.listener:
            self._accept()
        elif sock is self._wake_reader:
            try:
                while self._wake_reader.recv(512):
                    pass
            except OSError:
                pass
            if not self._refreshing:  # the backlog was read: answer who waited for it
                self._answer_metrics([c for c in self.clients.values() if c.state == WAITING],
                                     afresh=True)
        elif (client := self.clients.get(sock)) is not None:
            try:
                if client.state == READING:
                    self._read(client)
                elif client.state == WRITING:
                    self._write(client)
            except Exception:  # a bug of ours: the server goes on
                logger.exception("Probe server: answering %s failed", client.peer)
                self._close(client)

    def _accept(self) -> None:
        now = time.monotonic()
        self._tokens = min(self._tokens + (now - self._tokens_at) * ACCEPTS_PER_SECOND,
                           float(ACCEPT_BURST))
        self._tokens_at = now
        while self._tokens >= 1:
            full = len(self.clients) >= self.limit
            if full and self._slowest(now) is None:
                # Full of clients being answered (or just come): the next waits in the
                # kernel's queue until one is done or has been slow long enough.
                self._pause_accepting(min(c.deadline if c.state != READING else
                                          min(c.deadline, c.since + EVICTABLE_SECONDS)
                                          for c in self.clients.values()), full=True)
                return
            try:
                sock, address = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self._pause_accepting(now + ACCEPT_PAUSE_SECONDS)
                    self._tally("not accepted: the process is out of file descriptors", now)
                    return
                continue  # (ECONNABORTED: the client left before we took it)
            self._tokens -= 1
            if full and (slow := self._slowest(now)) is not None:
                self._drop(slow, f"dropped for a newer client: {self.limit} connections were "
                                 "open and it had not sent a complete request", "too slow")
            sock.setblocking(False)
            client = _Client(sock, f"{address[0]}:{address[1]}", now)
            self.clients[sock] = client
            self._watch(client, selectors.EVENT_READ)
        # (out of tokens: the next one comes in 1 / ACCEPTS_PER_SECOND s)
        self._pause_accepting(now + (1 - self._tokens) / ACCEPTS_PER_SECOND)

    def _slowest(self, now: float) -> _Client | None:
        """The oldest client that has waited EVICTABLE_SECONDS for its request to arrive:
        the one dropped to make room for a newcomer."""
        return next((c for c in self.clients.values()  # (the oldest first)
                     if c.state == READING and now - c.since >= EVICTABLE_SECONDS), None)

    def _pause_accepting(self, until: float, *, full: bool = False) -> None:
        if self._accept_paused_until is None:
            self.selector.unregister(self.listener)
        self._accept_paused_until = until
        self._paused_full = full

    def _read(self, client: _Client) -> None:
        try:
            data = client.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._drop(client, f"failed before sending a complete request ({exc})", "hung up")
            return
        if not data:
            if client.received:
                self._drop(client, "hung up before sending a complete request", "hung up")
            else:  # a TCP check (connect, then close): nothing wrong
                self._close(client)
            return
        client.received += data
        self._parse(client)

    def _parse(self, client: _Client) -> None:
        received = client.received
        if not received[:1].isupper():  # (a TLS handshake starts with 0x16)
            self._refuse(client, 400, "sent something else than an HTTP request", "not HTTP")
            return
        end = received.find(b"\r\n\r\n")
        if end < 0:
            end = received.find(b"\n\n")
        if end < 0:
            if len(received) > MAX_REQUEST_BYTES:
                self._refuse(client, 431, f"sent a request head over {MAX_REQUEST_BYTES} bytes",
                             "not HTTP")
            return
        words = bytes(received[:received.find(b"\n")]).decode("latin-1").split()
        if len(words) != 3 or not words[2].startswith("HTTP/"):
            self._refuse(client, 400, "sent a malformed request line", "not HTTP")
            return
        method, target = words[0], words[1]
        if method not in ("GET", "HEAD"):
            self._respond(client, 405, "text/plain", b"GET or HEAD only\n",
                          "Allow: GET, HEAD\r\n")
            return
        client.head_only = method == "HEAD"
        path = target.split("?", 1)[0]
        if path == "/metrics":
            if self.backlog is not None and self.backlog.stale():
                client.state = WAITING  # until the backlog thread has read the figures
                client.deadline = time.monotonic() + BACKLOG_WAIT_SECONDS
                self._watch(client, 0)
                if not self._refreshing:
                    self._refreshing = True
                    self._wanted.set()
            else:
                self._answer_metrics([client])
        elif path in ("/healthz", "/readyz"):
            state = self.state()
            alive = time.monotonic() - state["last_pass"] < STALL_SECONDS
            ok = alive if path == "/healthz" else (
                alive and state["database"] and state["children_ready"])
            payload = {"ok": ok, "loop_alive": alive, "database": state["database"],
                       "children_ready": state["children_ready"], "stopping": state["stopping"]}
            self._respond(client, 200 if ok else 503, "application/json",
                          json.dumps(payload).encode())
        else:
            self._respond(client, 404, "text/plain", b"not found: /metrics, /healthz or /readyz\n")

    def _answer_metrics(self, clients: list[_Client], *, afresh: bool = False) -> None:
        if not clients:
            return
        now = time.monotonic()
        if afresh or self._rendered is None or now - self._rendered[1] >= RENDER_SECONDS:
            self._rendered = (generate_latest(self.registry), now)
        for client in clients:
            self._respond(client, 200, CONTENT_TYPE_LATEST, self._rendered[0])

    def _refuse(self, client: _Client, status: int, why: str, tally: str) -> None:
        self._note(client, why, tally)
        self._respond(client, status, "text/plain", f"{REASONS[status]}\n".encode())

    def _respond(self, client: _Client, status: int, kind: str, body: bytes,
                 headers: str = "") -> None:
        head = (f"HTTP/1.1 {status} {REASONS[status]}\r\nContent-Type: {kind}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n{headers}\r\n")
        client.out = memoryview(head.encode("latin-1") + (b"" if client.head_only else body))
        client.state = WRITING
        client.deadline = time.monotonic() + RESPONSE_SECONDS
        self._write(client)
        if client.sock in self.clients:  # more than the socket's buffer took at once
            self._watch(client, selectors.EVENT_WRITE)

    def _write(self, client: _Client) -> None:
        try:
            sent = client.sock.send(client.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(client, "hung up before reading the whole response", "hung up")
            return
        client.out = client.out[sent:]
        if not client.out:
            self._close(client)

    def _expire(self, now: float) -> None:
        if self._accept_paused_until is not None and now >= self._accept_paused_until:
            self._accept_paused_until = None
            self.selector.register(self.listener, selectors.EVENT_READ)
        late = [c for c in self.clients.values() if now >= c.deadline]
        for client in late:
            if client.state == READING:
                self._drop(client, f"sent no complete request within {REQUEST_SECONDS:g} s",
                           "too slow")
            elif client.state == WRITING:
                self._drop(client, f"did not read the response within {RESPONSE_SECONDS:g} s",
                           "too slow")
        # (the backlog is not read in time: they get the figures at hand)
        self._answer_metrics([c for c in late if c.state == WAITING])
        if self.dropped and now >= self._next_report:
            self._report(now)

    def _drop(self, client: _Client, why: str, tally: str) -> None:
        self._note(client, why, tally)
        self._close(client)

    def _note(self, client: _Client, why: str, tally: str) -> None:
        """One DEBUG line per client at most, and a count for the next WARNING."""
        if client.noted:
            return
        client.noted = True
        logger.debug("Probe client %s %s; closed", client.peer, why)
        self._tally(tally, time.monotonic())

    def _tally(self, tally: str, now: float) -> None:
        self.dropped[tally] += 1
        if now >= self._next_report:
            self._report(now)

    def _report(self, now: float) -> None:
        logger.warning("Probe server on port %d: closed %d client connection(s) (%s); "
                       "each is logged at DEBUG", self.port, sum(self.dropped.values()),
                       ", ".join(f"{why}: {n}" for why, n in sorted(self.dropped.items())))
        self.dropped.clear()
        self._next_report = now + REPORT_SECONDS

    def _watch(self, client: _Client, events: int) -> None:
        if events == client.watched:
            return
        if not events:
            self.selector.unregister(client.sock)
        elif client.watched:
            self.selector.modify(client.sock, events)
        else:
            self.selector.register(client.sock, events)
        client.watched = events

    def _close(self, client: _Client) -> None:
        self.clients.pop(client.sock, None)
        self._watch(client, 0)
        client.sock.close()
        if self._paused_full and self._accept_paused_until is not None:
            self._accept_paused_until = 0.0  # a place is free: accept again (see _expire)

    def _close_all(self) -> None:
        if self._closed:
            return
        self._closed = True
        for client in list(self.clients.values()):
            self._close(client)
        self.selector.close()
        self.listener.close()
        self._wake_reader.close()
        self._wake_writer.close()

    def _wake(self) -> None:
        try:
            self._wake_writer.send(b"\0")
        except OSError:
            pass  # (full: a wake-up is pending anyway; closed: stopped)

    # -- the backlog's thread -----------------------------------------------------------
    def _read_backlog(self) -> None:
        assert self.backlog is not None
        while True:
            self._wanted.wait()
            self._wanted.clear()
            if self._stopping:
                return
            # Only if still stale: the server's thread may have asked just as the read
            # before ended (it saw the figures stale, then this thread's _refreshing =
            # False, and asked again). Either way its waiting scrapes are answered.
            if self.backlog.stale():
                self.backlog.refresh()
            self._refreshing = False
            self._wake()
