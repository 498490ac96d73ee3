"""``runworkers --metrics-port PORT``: ``/metrics``, ``/healthz`` and ``/readyz`` on one port.

- ``/metrics``: Prometheus text (``prometheus_client``).
- ``/healthz``: 200 while the coordinator's loop is alive (it passed through its loop
  within ``STALL_SECONDS``), else 503: restart me.
- ``/readyz``: 200 while, moreover, the database answers and every pool's children are
  ready, else 503: do not count on me now (a restart would not help during an outage).

The bodies are small JSON objects saying why.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

logger = logging.getLogger("django_dbworker.probes")
# The loop passes at least every MAX_POLL_SECONDS when idle; stalled past this, it is hung.
STALL_SECONDS = 30.0


class ProbeServer:
    def __init__(self, port: int, registry: CollectorRegistry,
                 state: Callable[[], dict[str, Any]], host: str = "0.0.0.0") -> None:
        self.registry, self.state = registry, state
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the http.server API
                server.answer(self)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                logger.debug("probe %s", format % args)

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="dbworker-probes",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def answer(self, request: BaseHTTPRequestHandler) -> None:
        path = request.path.split("?", 1)[0]
        if path == "/metrics":
            body, status, kind = generate_latest(self.registry), 200, CONTENT_TYPE_LATEST
        elif path in ("/healthz", "/readyz"):
            state = self.state()
            alive = time.monotonic() - state["last_pass"] < STALL_SECONDS
            ok = alive if path == "/healthz" else (
                alive and state["database"] and state["children_ready"])
            payload = {"ok": ok, "loop_alive": alive, "database": state["database"],
                       "children_ready": state["children_ready"], "stopping": state["stopping"]}
            body, status, kind = json.dumps(payload).encode(), 200 if ok else 503, "application/json"
        else:
            body, status, kind = b"not found: /metrics, /healthz or /readyz\n", 404, "text/plain"
        request.send_response(status)
        request.send_header("Content-Type", kind)
        request.send_header("Content-Length", str(len(body)))
        request.end_headers()
        request.wfile.write(body)
