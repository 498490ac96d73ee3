"""The coordinator's one wait: on its children's pipes and sentinels, the LISTEN socket
or SQLite's doorbell, and a wake-up pipe that stop requests (from signal handlers or
other threads) write to.
"""

from __future__ import annotations

import os
import select
from collections.abc import Sequence
from typing import Any

from ..processes.pool import Pool

# Ready to read, or closed, or broken: each ends the wait, as multiprocessing's wait() does.
_EVENTS = select.POLLIN | select.POLLPRI


def _fd(handle: Any) -> int:
    return handle if isinstance(handle, int) else handle.fileno()


class Watcher:
    """Waits until something is ready; says whose it is.

    It keeps one ``poll`` object, registered anew only when a pool's children, the
    listener or the doorbell change: an idle coordinator without either waits up to 50
    times a second (the change probe), and ``multiprocessing.connection.wait`` builds and
    fills a new selector on each call, which cost an idle coordinator more than the
    waiting itself."""

    def __init__(self) -> None:
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._key: tuple[int, ...] | None = None
        self._listener: Any = None
        self._doorbell: Any = None
        self._poll = select.poll()
        self._owners: dict[int, tuple[Any, Pool | None]] = {}  # fd -> (handle, owner)

    def poke(self) -> None:
        """End the current (or next) wait at once. Safe from a signal handler."""
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass  # the pipe is full: a wake-up is already waiting

    def wait(self, pools: Sequence[Pool], listener: Any, timeout: float,
             doorbell: Any = None) -> list[tuple[Pool | None, Any]]:
        """(pool, handle) for each child handle that is ready, (None, listener) if the
        listener is, (None, doorbell) if the doorbell is; a poke only ends the wait."""
        if listener is not None and not listener.usable:
            # Broken during a claim on it (its socket is gone: no file number to watch):
            # ready, so that its drain() fails and the coordinator drops it.
            return [(None, listener)]
        self._watch(pools, listener, doorbell)
        # (notifications read with the result of a claim on its connection)
        heard = listener is not None and listener.heard()
        ready_owners: list[tuple[Pool | None, Any]] = [(None, listener)] if heard else []
        if heard:
            timeout = 0.0
        for fd, _ in self._poll.poll(max(timeout, 0.0) * 1000):
            handle, owner = self._owners[fd]
            if fd == self._wake_r:
                try:
                    os.read(self._wake_r, 1024)
                except BlockingIOError:
                    pass
            elif not (heard and handle is listener):
                ready_owners.append((owner, handle))
        return ready_owners

    def _watch(self, pools: Sequence[Pool], listener: Any, doorbell: Any) -> None:
        """Register everything to wait on, anew only when a pool's children, the
        listener or the doorbell changed."""
        key = (id(listener), id(doorbell), *(p.version for p in pools))
        # (an id can be reused by the next listener: check that it is the one watched)
        if key == self._key and listener is self._listener and doorbell is self._doorbell:
            return
        owners: dict[int, tuple[Any, Pool | None]] = {self._wake_r: (self._wake_r, None)}
        for handle in (listener, doorbell):
            if handle is not None:
                owners[_fd(handle)] = (handle, None)
        for pool in pools:
            for handle in pool.handles():
                owners[_fd(handle)] = (handle, pool)
        self._poll = select.poll()  # (a closed file's number may be reused by a new one)
        for fd in owners:
            self._poll.register(fd, _EVENTS)
        self._owners, self._key = owners, key
        self._listener, self._doorbell = listener, doorbell
