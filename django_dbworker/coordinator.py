"""The coordinator: claims rows for each worker and hands them to its children.

One thread runs one loop. It waits on the children's pipes and process sentinels, a
wake-up pipe (stop requests) and, on PostgreSQL, the LISTEN socket; between waits it
claims for pools with free children, renews leases, recovers expired claims and writes
its heartbeat. ``manage.py runworkers`` runs it in the foreground; embed it with
``start()``/``stop()`` or run ``drain()`` in scripts and tests.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import Counter, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.db import connections

from . import child as messages
from . import conf, failpoints
from .bridge import DATABASE_ERRORS, Bridge, Claim, Listener, listener_for
from .installation import missing_triggers
from .pool import SPAWN, Child, Pool
from .registry import Worker, registry
from .vendors import for_connection

logger = logging.getLogger("django_dbworker.coordinator")
CHILD_START_SECONDS = 120.0
RELEASE_PATIENCE_SECONDS = 10.0  # at shutdown, for releases the database refused


@dataclass
class Settings:
    database: str
    lease_seconds: float
    poll_seconds: float
    max_poll_seconds: float
    shutdown_timeout: float | None = None
    status_interval: float = 60.0
    concurrency: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_conf(cls, overrides: Mapping[str, Any]) -> Settings:
        known = {"database", "lease_seconds", "poll_seconds", "max_poll_seconds",
                 "shutdown_timeout", "status_interval", "concurrency"}
        unknown = set(overrides) - known
        if unknown:
            raise TypeError(f"Unknown Coordinator option(s): {', '.join(sorted(unknown))}. "
                            f"Known: {', '.join(sorted(known))}.")
        return cls(
            database=overrides.get("database") or conf.value("DATABASE"),
            lease_seconds=float(overrides.get("lease_seconds") or conf.value("LEASE_SECONDS")),
            poll_seconds=float(overrides.get("poll_seconds") or conf.value("POLL_SECONDS")),
            max_poll_seconds=float(
                overrides.get("max_poll_seconds") or conf.value("MAX_POLL_SECONDS")),
            shutdown_timeout=overrides.get("shutdown_timeout"),
            status_interval=float(overrides.get("status_interval") or 60.0),
            concurrency=dict(overrides.get("concurrency") or {}),
        )


class Backoff:
    """When a pool may claim next: at once after work, doubling waits while idle."""

    def __init__(self, first: float, most: float) -> None:
        self.first, self.most = first, most
        self.delay = first
        self.next_at = 0.0
        self.exhausted = False  # the last claim found nothing (drain uses this)

    def found_work(self) -> None:
        self.delay, self.next_at, self.exhausted = self.first, 0.0, False

    def found_nothing(self, now: float) -> None:
        self.next_at = now + self.delay
        self.delay = min(self.delay * 2, self.most)
        self.exhausted = True

    def wake(self) -> None:
        """Something changed (a row was inserted, a handler finished): claim again now."""
        self.delay, self.next_at, self.exhausted = self.first, 0.0, False


class Coordinator:
    """Claims rows for ``workers`` (names; default all registered) and runs them.

    Overrides: ``database``, ``lease_seconds``, ``poll_seconds``, ``max_poll_seconds``,
    ``concurrency`` (an int for all, or {name: int}), ``shutdown_timeout``,
    ``status_interval``.
    """

    def __init__(self, workers: Iterable[str] | None = None, **overrides: Any) -> None:
        concurrency = overrides.pop("concurrency", None)
        names = list(workers) if workers is not None else list(registry)
        if not names:
            raise ImproperlyConfigured(
                "No workers are registered: add @worker(...) handlers in a workers.py module "
                "of an installed app (or list modules in DBWORKER['WORKER_MODULES'])."
            )
        self.workers: list[Worker] = [registry[name] for name in names]
        if isinstance(concurrency, int):
            concurrency = {w.name: concurrency for w in self.workers}
        for name in concurrency or {}:
            registry[name]  # an unknown name fails here, naming the known ones
        overrides["concurrency"] = concurrency or {}
        self.settings = Settings.from_conf(overrides)
        for w in self.workers:
            n = self.settings.concurrency.get(w.name, w.concurrency)
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ImproperlyConfigured(f"Concurrency for {w.name!r} must be an int >= 1.")
        self.identity = f"{socket.gethostname()}:{os.getpid()}"
        self.stats: Counter[str] = Counter()
        self.pools: list[Pool] = []
        self.bridge: Bridge | None = None
        self.listener: Listener | None = None
        self._backoff: dict[str, Backoff] = {}
        self._stopping = False
        self._force = False
        self._stop_deadline: float | None = None
        self._stop_announced = False
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._coordinator_id: int | None = None
        self._database_down_until = 0.0
        self._database_delay = self.settings.poll_seconds
        self._error: BaseException | None = None
        # Releases the database refused (down, or SQLite's lock held by a handler): kept,
        # renewed like held rows, and retried until they are done.
        self._unreleased: deque[tuple[Claim, bool, tuple[str, str] | None]] = deque()
        # Read by every child before it starts a row: set, they send back what they
        # have not started instead of running it.
        self._stop_flag = SPAWN.RawValue("b", 0)

    # -- public API ---------------------------------------------------------------------
    def start(self) -> None:
        """Start claiming in a background thread; returns once the children are ready."""
        self.set_up()
        self._thread = threading.Thread(target=self._run_and_tear_down, name="dbworker",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop claiming, wait for running handlers, release what was not started."""
        self.request_stop()
        if timeout is not None:
            self.settings.shutdown_timeout = timeout
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            raise self._error

    def drain(self) -> Counter[str]:
        """Run until this process's handlers are done and nothing is claimable."""
        self.set_up()
        try:
            self.loop(drain=True)
        finally:
            self.tear_down()
        return self.stats

    def run(self) -> None:
        """Run in this thread until request_stop() (runworkers: SIGTERM/SIGINT)."""
        self.set_up()
        try:
            self.loop()
        finally:
            self.tear_down()

    def request_stop(self, *, force: bool = False) -> None:
        """Graceful first; ``force`` kills children and releases their claims at once.
        Safe to call from a signal handler or another thread."""
        if self._stopping:
            force = True
        self._stopping = True
        self._stop_flag.value = 1
        self._force = self._force or force
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    # -- set-up and tear-down ------------------------------------------------------------
    def check(self) -> None:
        """Everything that must hold before anything is claimed; raises with the fix."""
        connection = connections[self.settings.database]
        vendor = for_connection(connection)
        vendor.check_supported()
        for w in self.workers:
            if w.handler.__module__ == "__main__":
                raise ImproperlyConfigured(
                    f"Worker {w.name!r}: handler {w.handler.__qualname__} lives in __main__, "
                    "which children cannot import; move it into a module (e.g. workers.py)."
                )
        missing = missing_triggers(self.settings.database, self.workers)
        if missing:
            raise ImproperlyConfigured(
                f"Triggers missing for workers ({', '.join(missing)}): run "
                "`python manage.py migrate` after registering workers."
            )

    def set_up(self) -> None:
        self.check()
        self.bridge = Bridge(self.settings.database, self.settings.lease_seconds)
        databases = {
            alias: str(connections[alias].settings_dict["NAME"]) for alias in connections
        }
        self.pools = [
            Pool(w, self.settings.concurrency.get(w.name, w.concurrency), databases,
                 self.settings.database, self._stop_flag)
            for w in self.workers
        ]
        self._backoff = {
            w.name: Backoff(self.settings.poll_seconds, self.settings.max_poll_seconds)
            for w in self.workers
        }
        for pool in self.pools:
            pool.start()
        try:
            self._wait_until_ready()
        except BaseException:
            self._kill_children()
            self.bridge.close()
            raise
        self._register()
        self.listener = listener_for(self.bridge)
        logger.info(
            "django-dbworker coordinator %s: %s; database %s, claims by %s, lease %ss",
            self.identity,
            ", ".join(f"{p.worker.name} x{p.concurrency}" for p in self.pools),
            self.bridge.vendor.describe(), self.bridge.vendor.claim_mode,
            self.settings.lease_seconds,
        )

    def _register(self) -> None:
        """Record this coordinator for the admin (retried with each renewal while the
        database is busy or down: it must never stop work from starting)."""
        assert self.bridge is not None
        self._coordinator_id = self._quietly(
            self.bridge.register_coordinator, socket.gethostname(), os.getpid(),
            [w.name for w in self.workers])

    def _wait_until_ready(self) -> None:
        deadline = time.monotonic() + CHILD_START_SECONDS
        waiting = {c.conn: (p, c) for p in self.pools for c in p.children}
        while waiting:
            ready = wait(list(waiting), timeout=max(deadline - time.monotonic(), 0))
            if not ready:
                raise ImproperlyConfigured("Worker children did not start within "
                                           f"{CHILD_START_SECONDS:.0f}s.")
            for conn in ready:
                pool, child = waiting.pop(conn)  # type: ignore[call-overload]
                try:
                    kind, detail = child.conn.recv()
                except EOFError:
                    kind, detail = messages.SETUP_FAILED, "the child exited during set-up"
                if kind != messages.READY:
                    last = str(detail).strip().splitlines()[-1] if detail else ""
                    raise ImproperlyConfigured(
                        f"A child for worker {pool.worker.name!r} could not start "
                        f"({pool.worker.handler_path}): {last}"
                    )
                child.ready = True

    def _run_and_tear_down(self) -> None:
        try:
            self.loop()
        except BaseException as exc:  # surfaced by stop()
            logger.exception("Coordinator stopped by an error")
            self._error = exc
        finally:
            self.tear_down()

    def tear_down(self) -> None:
        for pool in self.pools:
            for c in pool.children:
                c.stop()
        for pool in self.pools:
            for c in pool.children:
                c.join(10)
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        self._flush_releases(patience=RELEASE_PATIENCE_SECONDS)
        if self.bridge is not None:
            if self._coordinator_id is not None:
                self._quietly(self.bridge.unregister_coordinator, self._coordinator_id)
            self.bridge.close()
        logger.info("Coordinator %s stopped: %s", self.identity, self.stats_line())

    # -- the loop -----------------------------------------------------------------------
    def loop(self, drain: bool = False) -> None:
        assert self.bridge is not None
        lease = self.settings.lease_seconds
        renew_every = max(lease / 3, 0.05)
        next_renew = next_recover = time.monotonic()
        next_status = time.monotonic() + self.settings.status_interval
        while True:
            now = time.monotonic()
            if self._force:
                self._abandon_all()
                return
            if self._stopping:
                if not self._stop_announced:
                    self._stop_announced = True
                    if self.settings.shutdown_timeout is not None:
                        self._stop_deadline = now + self.settings.shutdown_timeout
                    logger.info("Stopping: no new claims; waiting for %d running handler(s)",
                                sum(len(p.busy) for p in self.pools))
                failpoints.reached("coordinator.stopping")
                if not any(p.busy for p in self.pools) and not self._unreleased:
                    return
                if self._stop_deadline is not None and now >= self._stop_deadline:
                    logger.warning("Shutdown timeout reached: terminating running handlers")
                    self._force = True
                    continue
            elif now >= self._database_down_until:
                if drain and now >= next_recover:
                    self._quietly(self._recover_expired)
                    next_recover = now + renew_every
                self._claim_and_dispatch(now, drain)
            if self._unreleased and now >= self._database_down_until:
                self._flush_releases()
            if now >= next_renew:
                self._quietly(self._renew)
                next_renew = now + renew_every
            self._check_timeouts(now)
            self._revoke_waiting(now)
            if not drain and now >= next_recover:
                self._quietly(self._recover_expired)
                next_recover = now + lease / 2
            if now >= next_status:
                logger.info("Status: %s", self.stats_line())
                next_status = now + self.settings.status_interval
            if drain and self._drained():
                return
            self._wait(self._timeout(now, next_renew, drain))

    def _claim_and_dispatch(self, now: float, drain: bool) -> None:
        assert self.bridge is not None
        for pool in self.pools:
            backoff = self._backoff[pool.worker.name]
            free = pool.free_slots()
            if free > 0 and (now >= backoff.next_at or (drain and not backoff.exhausted)):
                try:
                    claims = self.bridge.claim(pool.worker, free, self.identity)
                except DATABASE_ERRORS as exc:
                    self._database_down(exc)
                    return
                self._database_delay = self.settings.poll_seconds
                if claims:
                    failpoints.reached("coordinator.after_claim")
                    self.stats["claimed"] += len(claims)
                    for claim in pool.distribute(claims):  # a child died as we sent
                        self._release(claim, started=False)
                    backoff.found_work()
                else:
                    backoff.found_nothing(now)

    def _drained(self) -> bool:
        return all(
            not p.busy and not self._unreleased and self._backoff[p.worker.name].exhausted
            for p in self.pools
        )

    def _timeout(self, now: float, next_renew: float, drain: bool) -> float:
        deadlines = [next_renew]
        if not self._stopping:
            for pool in self.pools:
                if pool.free_slots() > 0:
                    deadlines.append(self._backoff[pool.worker.name].next_at)
            deadlines.append(self._database_down_until)
        if self._stop_deadline is not None:
            deadlines.append(self._stop_deadline)
        if self._unreleased:
            deadlines.append(self._database_down_until)
        for pool in self.pools:
            for c in pool.busy:
                running = c.running()
                if running is None:
                    continue
                if pool.worker.timeout is not None:
                    deadlines.append(running[1] + pool.worker.timeout)
                if len(c.outstanding) > 1:
                    deadlines.append(running[1] + pool.stuck_after())
        future = [d for d in deadlines if d > now]
        return min(min(future) - now, self.settings.max_poll_seconds) if future else 0.0

    def _wait(self, timeout: float) -> None:
        watched: dict[Any, tuple[str, Any]] = {self._wake_r: ("wake", None)}
        if self.listener is not None:
            watched[self.listener] = ("notify", None)
        for pool in self.pools:
            for c in pool.children:
                watched[c.conn] = ("message", (pool, c))
                watched[c.sentinel] = ("exit", (pool, c))
        exited: list[tuple[Pool, Child]] = []
        for ready in wait(list(watched), timeout=timeout):
            kind, where = watched[ready]
            if kind == "exit":
                exited.append(where)
            elif kind == "wake":
                try:
                    os.read(self._wake_r, 1024)
                except BlockingIOError:
                    pass
            elif kind == "notify":
                self._on_notify()
            elif kind == "message":
                self._on_message(*where)
        # Exits after messages: a child that sent its result and then died is handled
        # as a finished row plus a dead child. (One retired meanwhile is already gone.)
        for pool, c in exited:
            if c in pool.children:
                c.process.join(0)  # reap it, so that exitcode is set
                self._on_child_exit(pool, c)

    def _on_notify(self) -> None:
        assert self.listener is not None
        try:
            names = self.listener.drain()
        except Exception as exc:  # noqa: BLE001 - the listener's connection broke
            logger.warning("LISTEN connection lost (%s); polling until it is back", exc)
            self.listener.close()
            self.listener = None
            self._quietly(self._relisten)
            return
        for name in names:
            if name in self._backoff:
                self._backoff[name].wake()

    def _relisten(self) -> None:
        assert self.bridge is not None
        self.listener = listener_for(self.bridge)

    def _on_message(self, pool: Pool, c: Child) -> None:
        assert self.bridge is not None
        try:
            _, results, seconds = c.conn.recv()
        except (EOFError, OSError):
            return  # the exit is handled with the sentinel
        ran = 0
        for kind, execution_id, detail in results:
            claim = c.settle(execution_id)
            if kind == messages.SKIPPED:
                if claim is not None:  # (a revoked row was released already)
                    c.sent -= 1
                    self.stats["released"] += 1
                    self._release(claim, started=False)
                continue
            ran += 1
            if kind == messages.DONE:
                self.stats[detail] += 1
            elif kind == messages.LOST:
                self.stats["lost"] += 1
                logger.warning("Worker %s lost its claim on execution %s: its writes were "
                               "discarded", pool.worker.name, execution_id)
            elif kind == messages.INTERRUPTED:
                self.stats["interrupted"] += 1
                logger.warning("Worker %s: database error during execution %s (%s); "
                               "releasing it", pool.worker.name, execution_id, detail)
                if claim is not None:
                    self._release(claim, started=True)
        pool.timed(ran, seconds)
        # A finished handler may have made rows eligible (here or for another worker).
        for backoff in self._backoff.values():
            backoff.wake()
        if pool.retiring(c) and not self._stopping:
            c.stop()
            c.join(10)
            pool.replace(c)
            self._await_ready(pool)

    def _on_child_exit(self, pool: Pool, c: Child) -> None:
        code = c.process.exitcode
        running = c.running()
        if running is not None:
            self.stats["crashed"] += 1
            logger.error("A child of worker %s died (exit code %s) while handling execution "
                         "%s; releasing the row", pool.worker.name, code, running[0])
        elif c.outstanding:
            logger.error("A child of worker %s died (exit code %s) between handlers; "
                         "releasing the %d row(s) it had not reported on (a row it had "
                         "already committed stays as committed)",
                         pool.worker.name, code, len(c.outstanding))
        self._release_held(c, error=("ChildDied", f"The child process died with exit code "
                                                  f"{code} while running the handler."))
        if self._stopping and not pool.busy:
            pool.children.remove(c)
            c.kill()
            return
        pool.replace(c)
        self._await_ready(pool)

    def _release_held(self, c: Child, error: tuple[str, str] | None = None) -> None:
        """Give back every row a dead (or killed) child held: the one its handler was
        running keeps its attempt (and ``error``); the rest never ran to a commit, so
        they return as they were."""
        assert self.bridge is not None
        running = c.running()
        for execution_id, claim in list(c.outstanding.items()):
            started = running is not None and running[0] == execution_id
            self._release(claim, started=started, error=error if started else None)
            self.stats["released"] += 1
        c.outstanding.clear()

    def _await_ready(self, pool: Pool) -> None:
        """Block for the new child's handshake (spawning is rare: a crash or recycling)."""
        for c in pool.children:
            if not c.ready and c.process.is_alive():
                if c.conn.poll(CHILD_START_SECONDS):
                    try:
                        kind, _ = c.conn.recv()
                        c.ready = kind == messages.READY
                    except EOFError:
                        pass

    def _revoke_waiting(self, now: float) -> None:
        """Rows sent ahead to a child whose handler is stuck go back to the database,
        claimable at once by anyone, instead of waiting behind it."""
        assert self.bridge is not None
        for pool in self.pools:
            for c in pool.busy:
                stuck = pool.stuck_since(c)
                if stuck is None or now < stuck or len(c.outstanding) < 2:
                    continue
                waiting = c.revoke_waiting()
                for claim in waiting:
                    self._release(claim, started=False)
                    self.stats["released"] += 1
                if waiting:
                    logger.info("Worker %s: a handler has run for over %.1fs; %d row(s) "
                                "waiting behind it were given back", pool.worker.name,
                                now - stuck + pool.stuck_after(), len(waiting))
                    self._backoff[pool.worker.name].wake()

    def _check_timeouts(self, now: float) -> None:
        assert self.bridge is not None
        for pool in self.pools:
            limit = pool.worker.timeout
            if limit is None:
                continue
            for c in pool.busy:
                running = c.running()
                if running is None or now - running[1] < limit:
                    continue
                claim = c.outstanding.get(running[0])
                c.kill()
                if claim is None or c.running() != running:
                    continue  # it finished just now; its exit is handled as a crash
                logger.error("Worker %s: execution %s ran past its %ss timeout; killing "
                             "its child", pool.worker.name, claim.execution_id, limit)
                c.settle(claim.execution_id)
                status = self._quietly(
                    self.bridge.fail, pool.worker, claim, "TimeoutError",
                    f"The handler ran longer than its timeout of {limit}s.")
                self.stats[status or "lost"] += 1
                self._release_held(c)
                pool.replace(c)
                self._await_ready(pool)

    def _renew(self) -> None:
        assert self.bridge is not None
        failpoints.reached("coordinator.before_renew")
        self.bridge.renew([*(claim for pool in self.pools for claim in pool.claims()),
                           *(claim for claim, _, _ in self._unreleased)])
        failpoints.reached("coordinator.after_renew")
        if self.listener is None and self.bridge.vendor.notifies:
            self._relisten()  # lost in an outage: back to wake-ups instead of polling
        if self._coordinator_id is None:
            self._register()
        else:
            self.bridge.heartbeat(self._coordinator_id)

    def _recover_expired(self) -> None:
        assert self.bridge is not None
        dead = self.bridge.expire_claims_of_dead(socket.gethostname(), self._coordinator_id,
                                                 pid_alive)
        if dead:
            logger.warning("Coordinator process(es) %s on this host are gone; their claims "
                           "are released now, without waiting for their leases",
                           ", ".join(map(str, dead)))
        for w in self.workers:
            recovered = self.bridge.recover_expired(w)
            if recovered:
                self.stats["recovered"] += recovered
                logger.warning("Worker %s: %d claim(s) had expired leases; they are claimable "
                               "again", w.name, recovered)
                self._backoff[w.name].wake()

    def _abandon_all(self) -> None:
        """Second signal: kill the children and release every claim for others at once."""
        for pool in self.pools:
            for c in pool.children:
                c.kill()
                self._release_held(c)
            pool.children = []
        logger.warning("Terminated running handlers; their rows are claimable again")

    def _kill_children(self) -> None:
        for pool in self.pools:
            for c in pool.children:
                c.kill()
            pool.children = []

    # -- releases ------------------------------------------------------------------------
    def _release(self, claim: Claim, *, started: bool,
                 error: tuple[str, str] | None = None) -> None:
        """Give a held row back now, or as soon as the database takes it."""
        self._unreleased.append((claim, started, error))
        self._flush_releases()

    def _flush_releases(self, patience: float = 0.0) -> None:
        """Retry the releases the database refused, in order; with ``patience`` (seconds,
        at shutdown) keep trying that long before leaving the rest to their leases."""
        if not self._unreleased:
            return
        assert self.bridge is not None
        deadline = time.monotonic() + patience
        while self._unreleased:
            claim, started, error = self._unreleased[0]
            try:
                self.bridge.release(claim, started=started, error=error)
            except DATABASE_ERRORS as exc:
                self._database_down(exc)
                if time.monotonic() >= deadline:
                    if patience:
                        logger.warning("%d row(s) could not be released; they become "
                                       "claimable when their leases end",
                                       len(self._unreleased))
                    return
                time.sleep(min(self.settings.poll_seconds, 1.0))
                continue
            self._unreleased.popleft()

    # -- database outages ---------------------------------------------------------------
    def _database_down(self, exc: BaseException) -> None:
        if self._lock_contention(exc):
            # Not an outage: a handler's transaction holds the database's only write lock
            # (SQLite, see docs/troubleshooting.md). Try again soon, quietly.
            logger.debug("The database is busy (a running handler holds its write lock); "
                         "retrying in %.2fs", self.settings.poll_seconds)
            self._database_down_until = time.monotonic() + self.settings.poll_seconds
            return
        delay = self._database_delay
        logger.warning("Database unavailable (%s); retrying in %.1fs",
                       str(exc).strip().splitlines()[0] if str(exc) else type(exc).__name__, delay)
        self._database_down_until = time.monotonic() + delay
        self._database_delay = min(delay * 2, self.settings.max_poll_seconds)

    def _lock_contention(self, exc: BaseException) -> bool:
        return self.bridge is not None and self.bridge.vendor.is_lock_contention(exc)

    def _quietly(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except DATABASE_ERRORS as exc:
            self._database_down(exc)
            return None

    @property
    def stopping(self) -> bool:
        return self._stopping

    def stats_line(self) -> str:
        keys = ["claimed", "finished", "unfinished", "failed", "lost", "crashed", "released"]
        return ", ".join(f"{k} {self.stats[k]}" for k in keys)


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this machine (a zombie counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True
