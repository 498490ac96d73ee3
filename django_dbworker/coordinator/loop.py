"""The coordinator: claims rows for each worker and hands them to its children.

One thread runs one loop. Each pass is a short list of steps: claim for pools with room,
retry refused releases, renew leases (and the heartbeat), recover work whose holder is
gone, let the pools enforce timeouts and give back rows stuck behind a slow handler; then
it waits on the children's pipes and sentinels, a wake-up pipe (stop requests) and, on
PostgreSQL, the LISTEN socket. ``manage.py runworkers`` runs it in the foreground; embed
it with ``start()``/``stop()`` or run ``drain()`` in scripts and tests.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from django.core.exceptions import ImproperlyConfigured
from django.db import connections

from ..installation.preflight import check_can_start
from ..operations.events import EVENTS
from ..pauses import PausedWorkers
from ..processes import failpoints
from ..processes.children import SPAWN, ChildProcess
from ..processes.pool import Pool, start_all
from ..processes.pool_events import PoolEvents
from ..registration.options import Options
from ..registration.registry import Worker, registry
from ..schedules import Scheduler
from ..store import clock
from ..store.bridge import Bridge
from ..vendors import for_connection
from . import identity
from .due import DueRows
from .outage import DatabaseHealth, wait_for_database
from .recovery import Watchman
from .releases import ReleaseQueue
from .wakeups import Probed, Wakeups
from .watching import Watcher

if TYPE_CHECKING:
    from ..operations.metrics import Metrics
    from ..operations.probes import ProbeServer

logger = logging.getLogger("django_dbworker.coordinator")
# The least wait for a rate's next token. A token due now (its wait 0: the oldest claim
# left the window between the count and the reading of its age) is a deadline of this
# very pass, which _timeout, keeping only deadlines after now, dropped: the loop then
# slept to its next periodic deadline, and two coordinators at 50/s sat idle for 8 s.
RATE_WAIT_LEAST = 0.001


def token_wait(rate_wait: float | None) -> float | None:
    """How long a worker whose rate is used up waits for its next token (None: no rate
    holds it back): never 0, which would be a deadline the loop drops."""
    return None if rate_wait is None else max(rate_wait, RATE_WAIT_LEAST)
RELEASE_PATIENCE_SECONDS = 10.0  # at shutdown, for releases the database refused
STATS = list(EVENTS)  # the stats line: every event the metrics count, in one order


class Coordinator:
    """Claims rows for ``workers`` (names; default all registered) and runs them.

    Overrides: ``database``, ``lease_seconds``, ``poll_seconds``, ``max_poll_seconds``,
    ``concurrency`` (an int for all, or {name: int}), ``shutdown_timeout``,
    ``status_interval``, ``wait_for_database`` (seconds set-up waits for a database that
    does not answer yet), ``schedules`` (False: enqueue no schedule's slots),
    ``metrics_port`` and ``metrics_host`` (serve /metrics, /healthz and /readyz there).
    """

    def __init__(self, workers: Iterable[str] | None = None, **overrides: Any) -> None:
        names = list(workers) if workers is not None else list(registry)
        if not names:
            raise ImproperlyConfigured(
                "No workers are registered: add @worker(...) handlers in a workers.py module "
                "of an installed app (or list modules in DBWORKER['WORKER_MODULES'])."
            )
        self.workers: list[Worker] = [registry[name] for name in names]
        self.settings = Options.build(self.workers, overrides)
        self.host = identity.host()
        self.identity = f"{self.host}:{os.getpid()}"
        self.stats: Counter[str] = Counter()
        self.pools: list[Pool] = []
        self.bridge: Bridge | None = None
        # Made in set_up(), with the bridge they use.
        self.health: DatabaseHealth
        self.releases: ReleaseQueue
        self.watchman: Watchman
        self.wakeups: Wakeups
        self.events: PoolEvents
        self.due: DueRows
        self.paused: PausedWorkers
        self.scheduler: Scheduler | None = None
        self.metrics: Metrics | None = None
        self.probes: ProbeServer | None = None
        self._last_pass = time.monotonic()
        self._stopping = False
        self._force = False
        self._stop_deadline: float | None = None
        self._stop_announced = False
        self._thread: threading.Thread | None = None
        self.watcher = Watcher()
        self._coordinator_id: int | None = None
        self._error: BaseException | None = None
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
        if timeout is not None:  # before waking the loop, which reads it when it wakes
            self.settings.shutdown_timeout = timeout
        self.request_stop()
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
        self.watcher.poke()

    @property
    def stopping(self) -> bool:
        return self._stopping

    def stats_line(self) -> str:
        return ", ".join(f"{k} {self.stats[k]}" for k in STATS)

    # -- set-up and tear-down ------------------------------------------------------------
    def set_up(self) -> None:
        for_connection(connections[self.settings.database])  # a backend we support, unconnected
        wait_for_database(self.settings.database, self.settings.wait_for_database)
        check_can_start(self.settings.database, self.workers)
        self.bridge = bridge = Bridge(self.settings.database, self.settings.lease_seconds)
        self.health = DatabaseHealth(bridge.vendor, bridge.ping, self.settings.poll_seconds,
                                     on_back=bridge.reset_connections)
        self.releases = ReleaseQueue(bridge, self.health)
        self.scheduler = (Scheduler(self.settings.database, self.settings.lease_seconds)
                          if self.settings.schedules else None)
        databases = {alias: str(connections[alias].settings_dict["NAME"]) for alias in connections}
        self.pools = [Pool(w, self.settings.concurrency[w.name], self._spawner(w, databases))
                      for w in self.workers]
        self.wakeups = Wakeups([w.name for w in self.workers], self.settings, self.health)
        self.events = PoolEvents(self.stats, self.releases, self.wakeups)
        self.watchman = Watchman(bridge, self.workers, self.host, identity.namespace(),
                                 self.events.count, self.wakeups.wake)
        self.due = DueRows(bridge, self.health, self.workers, self.settings.poll_seconds)
        self.paused = PausedWorkers(bridge, self.wakeups)
        try:
            start_all(self.pools)
        except BaseException:
            bridge.close()
            raise
        try:
            self._register()
            self.wakeups.open_doorbell(bridge)
            self.wakeups.listen(bridge)
            self.paused.refresh()
            if self.settings.metrics_port is not None:
                self._serve_probes(self.settings.metrics_port, self.settings.metrics_host)
        except BaseException:
            # (e.g. the metrics port is taken) nothing made so far outlives the error:
            # the children, the doorbell, the LISTEN connection, this coordinator's record
            self.tear_down()
            raise
        logger.info(
            "django-dbworker coordinator %s: %s; database %s, claims by %s, lease %ss",
            self.identity,
            ", ".join(f"{p.worker.name} x{p.concurrency}" for p in self.pools),
            bridge.vendor.describe(), bridge.vendor.claim_mode, self.settings.lease_seconds,
        )

    def _spawner(self, worker: Worker, databases: dict[str, str]) -> Callable[[], ChildProcess]:
        def spawn() -> ChildProcess:
            return ChildProcess(worker, databases, self.settings.database, self._stop_flag)
        return spawn

    def _serve_probes(self, port: int, host: str) -> None:
        from ..operations.metrics import Backlog, Metrics
        from ..operations.probes import ProbeServer

        # The backlog gauges are read by the probe server's thread through a Bridge of
        # their own: a scrape takes none of the loop's time or connections.
        backlog = Backlog.on_own_connection(self.settings.database, self.settings.lease_seconds,
                                            self.workers)
        bridge = self.bridge
        metrics = Metrics(self.workers, backlog,
                          lambda: {p.worker.name: len(p.busy) for p in self.pools},
                          bridge.throttled if bridge is not None else dict)
        self.probes = ProbeServer(port, metrics.registry, self.probe_state, host, backlog)
        self.metrics = self.events.metrics = metrics
        self.probes.start()
        logger.info("Serving /metrics, /healthz and /readyz on %s port %d", host,
                    self.probes.port)

    def probe_state(self) -> dict[str, Any]:
        """What /healthz and /readyz answer from (read from the probes' thread)."""
        return {"last_pass": self._last_pass, "stopping": self._stopping,
                "database": self.health.down_since is None,
                "children_ready": not any(p.starting for p in self.pools)}

    def _register(self) -> None:
        """Record this coordinator for the admin (retried with each renewal while the
        database is busy or down: it must never stop work from starting)."""
        assert self.bridge is not None
        self._coordinator_id = self.health.call(
            self.bridge.register_coordinator, self.host, identity.namespace(), os.getpid(),
            [w.name for w in self.workers])

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
            pool.stop()
        for pool in self.pools:
            pool.join(10)
        if self.bridge is not None:
            self.wakeups.close()
        if self.probes is not None:
            self.probes.stop()
            self.probes = None
        if self.bridge is not None:
            self.releases.flush(patience=RELEASE_PATIENCE_SECONDS)
            if self._coordinator_id is not None:
                self.health.call(self.bridge.unregister_coordinator, self._coordinator_id)
            self.bridge.close()
        logger.info("Coordinator %s stopped: %s", self.identity, self.stats_line())

    # -- the loop -----------------------------------------------------------------------
    def loop(self, drain: bool = False) -> None:
        assert self.bridge is not None
        lease = self.settings.lease_seconds
        renew_every = max(lease / 3, 0.05)
        # Draining looks for expired leases as often as it renews: it ends only when
        # nothing is left, and an expired lease is work left.
        recover_every = renew_every if drain else lease / 2
        next_renew = next_recover = next_pauses = time.monotonic()
        next_status = time.monotonic() + self.settings.status_interval
        while True:
            now = self._last_pass = time.monotonic()
            if self._force:
                self._abandon_all()
                return
            if self._stopping and self._stopped(now):
                return
            for pool in self.pools:
                pool.tick(now)
                events, revoked = pool.check(now)
                self.events.handle(pool, events)
                for claim in revoked:
                    self.events.give_back(claim, pool.worker.name)
                if revoked:
                    self.wakeups.wake(pool.worker.name)
            if self.health.available(now):
                if not self._stopping:
                    # First: a change it reports is claimed in this pass, not the next.
                    self._probe(now)
                    if self.scheduler:
                        self.health.call(self.scheduler.run)
                    for name in self.due.promote_due(self.workers, now):
                        self.wakeups.wake(name)
                    self._claim(now, drain)
                self.releases.flush()
                if now >= next_renew:
                    self.health.call(self._renew)
                    next_renew = now + renew_every
                if now >= next_recover:
                    self.health.call(self.watchman.run, self._coordinator_id)
                    next_recover = now + recover_every
                if now >= next_pauses:
                    # Only the fallback: NOTIFY announces each pause at once, and where
                    # there is none the change probe sees it.
                    self.health.call(self.paused.refresh)
                    next_pauses = now + self.settings.max_poll_seconds
            if now >= next_status:
                logger.info("Status: %s", self.stats_line())
                next_status = now + self.settings.status_interval
            if drain and self._drained():
                return
            self._wait(now + self._timeout(now, next_renew, next_recover, next_pauses,
                                           next_status))

    def _stopped(self, now: float) -> bool:
        """While stopping: whether every handler finished and every row went back."""
        if self._stop_deadline is None and self.settings.shutdown_timeout is not None:
            self._stop_deadline = now + self.settings.shutdown_timeout
        if not self._stop_announced:
            self._stop_announced = True
            logger.info("Stopping: no new claims; waiting for %d running handler(s)",
                        sum(len(p.busy) for p in self.pools))
        failpoints.reached("coordinator.stopping")
        if not any(p.busy for p in self.pools) and not len(self.releases):
            return True
        if self._stop_deadline is not None and now >= self._stop_deadline:
            logger.warning("Shutdown timeout reached: terminating running handlers")
            self._force = True
        return False

    def _claim(self, now: float, drain: bool) -> None:
        assert self.bridge is not None
        for pool in self.pools:
            if pool.worker.name in self.paused:
                continue  # its running handlers finish; it claims nothing new
            backoff = self.wakeups.backoff[pool.worker.name]
            free = pool.free_slots(now)
            if free > 0 and (now >= backoff.next_at or (drain and not backoff.exhausted)):
                claims = self.health.call(self.bridge.claim, pool.worker, free, self.identity)
                if claims is None:
                    return  # the database failed: the outage (or wait) is under way
                self.due.claimed(pool.worker, bool(claims))
                rate_wait = token_wait(self.bridge.rate_wait(pool.worker))
                if claims:
                    failpoints.reached("coordinator.after_claim")
                    self.events.count(pool.worker.name, "claimed", len(claims))
                    for claim in pool.distribute(claims, now):  # a child died as we sent
                        self.events.give_back(claim, pool.worker.name)
                    backoff.found_work()
                    if rate_wait is not None:  # its rate is used up: next at its token
                        backoff.wait_until(now + rate_wait)
                elif rate_wait is not None:
                    backoff.wait_until(now + rate_wait)
                elif self.due.promote(pool.worker, now):
                    backoff.wake()  # rows were waiting for their due time: claim them
                else:
                    backoff.found_nothing(now)

    def _drained(self) -> bool:
        return not len(self.releases) and all(
            not p.busy and (self.wakeups.backoff[p.worker.name].exhausted
                            or p.worker.name in self.paused)
            for p in self.pools)

    def _timeout(self, now: float, *periodic: float) -> float:
        deadlines = list(periodic)
        if not self._stopping:
            deadlines.extend(self.wakeups.backoff[p.worker.name].next_at for p in self.pools
                             if p.free_slots(now) > 0)
            deadlines.extend(self.due.deadlines())
            slot = self.scheduler.due_at() if self.scheduler else None
            if slot is not None:  # (the database's clock, for cron times; the loop waits in
                # monotonic time, and must not query here: an outage reaches this line too)
                wait = (slot - clock.estimate(self.settings.database)).total_seconds()
                deadlines.append(now + max(wait, 0.0))
        health = self.health.deadline()
        if health is not None:
            deadlines.append(health)
        if self._stop_deadline is not None:
            deadlines.append(self._stop_deadline)
        deadlines.extend(d for p in self.pools if (d := p.next_deadline()) is not None)
        future = [d for d in deadlines if d > now]
        return min(min(future) - now, self.settings.max_poll_seconds) if future else 0.0

    def _wait(self, until: float) -> None:
        """Wait until ``until`` or until something happens. Where there is no NOTIFY,
        the change probe runs between waits: an idle coordinator pays one query per
        probe, not a whole pass of the loop, and a change it sees ends the wait."""
        while True:
            now = time.monotonic()
            # (not while the database is down or busy: the loop's deadlines handle that)
            probing = not self._stopping and self.health.available(now)
            probe_at = self.wakeups.deadline() if probing else None
            end = until if probe_at is None else min(until, probe_at)
            # (read while every slot is busy too: a child's commit rings it for nothing,
            # but a pause committed then must be seen before the next claim)
            doorbell = self.wakeups.doorbell
            ready = self.watcher.wait(self.pools, self.wakeups.listener, max(end - now, 0.0),
                                      doorbell)
            rang = False
            for owner, handle in ready:
                if owner is not None:
                    self.events.handle(owner, owner.on_ready(handle))
                elif handle is doorbell:
                    rang = True  # the probe decides: it runs next, or soon
                    self.wakeups.on_ring(time.monotonic())
                elif self.wakeups.on_notify():
                    self.health.call(self.paused.refresh)
            now = time.monotonic()
            news = any(handle is not doorbell for _, handle in ready)  # a ring alone: probe below
            if news or self._stopping or now >= until:
                return
            if probe_at is None:  # not probing now (the database is busy or down)
                if rang:
                    continue  # the loop's deadlines handle the database: wait on
                return
            if self._probe(now) is not Probed.NOTHING:
                return
            self._last_pass = now  # (for /healthz: probing is the idle loop's work)

    def _probe(self, now: float) -> Probed:
        """The change probe (where there is no NOTIFY); it reads the pauses anew when it
        saw one change."""
        assert self.bridge is not None
        probed = self.wakeups.probe(self.bridge, now)
        if probed is Probed.PAUSES and not self.health.call(self.paused.refresh):
            self.wakeups.pauses_unseen()  # the next probe reports them again
        return probed

    # -- leases -------------------------------------------------------------------------
    def _renew(self) -> None:
        assert self.bridge is not None
        failpoints.reached("coordinator.before_renew")
        self.bridge.renew([*(claim for pool in self.pools for claim in pool.claims()),
                           *self.releases.claims()])
        failpoints.reached("coordinator.after_renew")
        self.wakeups.listen(self.bridge)  # after a lost LISTEN: back to wake-ups
        if self._coordinator_id is None:
            self._register()
        else:
            self.bridge.heartbeat(self._coordinator_id)

    def _abandon_all(self) -> None:
        """Second signal: kill the children and give every row back for others at once.
        Their transactions never committed; an interrupted attempt is not counted."""
        for pool in self.pools:
            for claim in pool.kill():
                self.events.give_back(claim, pool.worker.name)
        logger.warning("Terminated running handlers; their rows are claimable again")
